// The CUDA ops of cbcore._cuda (host side). The Python dispatcher in cbcore/ops calls exactly these.
//
// Every op validates its inputs (device, dtype, contiguity, shapes) with messages that name the argument and what
// is wrong, and launches on the current CUDA stream of the inputs' device. Nothing here synchronises with the host.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>

namespace cbcore {
namespace cuda {

// Split size (keys per split) of decode attention in deterministic mode: fixed, so that a request's result never
// depends on the rest of the batch.
constexpr int kDeterministicSplitTokens = 256;

// Writes new K/V rows k, v [T, kv_heads, head_dim] into the pages k_cache, v_cache
// [num_blocks, page_size, kv_heads, head_dim] at slot_mapping [T] (int64, block * page_size + offset). A negative
// slot skips its token (padding); a slot past the cache is skipped too rather than faulting (checking it on the
// host would need a device synchronisation).
void cache_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& slot_mapping);

// Paged decode: q [B, H, D] (one token per request) against each request's seq_lens[b] keys, found through
// block_table [B, max_blocks] (int32). sliding_window -1: none; else the query at position len - 1 sees keys
// k > len - 1 - window. deterministic: fixed split size, so the result of a request is bitwise independent of the
// batch it is in. softcap 0: none; else scores s become softcap * tanh(s / softcap) before the softmax. sinks: None,
// or [H] float32 sink logits joining each request's softmax denominator (no value). v_cache may have its own head dim
// DV (K 192 / V 128: multi-head latent attention). Returns [B, H, DV] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                            int64_t sliding_window, bool deterministic, double softcap,
                            const std::optional<at::Tensor>& sinks);

// Keys per split that decode_attention uses for `work_units` = batch x kv_heads x head chunks CTAs per split and a
// longest possible key range of `span` tokens, on a device with `num_sms` multiprocessors.
int decode_split_tokens(int64_t work_units, int64_t span, bool deterministic, int num_sms);

// Copies block src_ids[i] of src[t] to block dst_ids[i] of dst[t] for every tensor t and every i, in one launch.
// Tensors are [num_blocks, ...] contiguous; either side may be pinned host memory (read or written by the kernel
// through unified addressing); ids are int64 on the CUDA device. Registered as the CUDA kernel of the dispatcher op
// cbcore::copy_blocks, which the swap pool (cbcore._C) calls.
void copy_blocks(at::TensorList src, at::TensorList dst, const at::Tensor& src_ids, const at::Tensor& dst_ids);

}  // namespace cuda
}  // namespace cbcore
