// The launch plan of paged decode attention, shared by the host code (cuda_ops.cpp, compiled by the host compiler)
// and the kernels (cuda_decode_attention.cuh). Plain C++ and the CUDA runtime only, so the host side can build
// without nvcc parsing torch's headers once per GPU architecture.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace cbcore {
namespace cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kDecodeWarps = 4;          // warps per CTA of the split kernel
constexpr int kMergeThreads = 128;       // threads per CTA of the merge kernel
constexpr int kMergeChunk = 256;         // split weights staged in shared memory at a time by the merge kernel

struct DecodeParams {
  void* out;                  // [B, H, DV], q's dtype (DV: V's head dim, D unless V has its own)
  float* partial_out;         // [B, H, max_splits, DV]: per-split normalised outputs (unused when max_splits == 1)
  float* partial_max;         // [B, H, max_splits]: per-split max score (log2 domain)
  float* partial_sum;         // [B, H, max_splits]: per-split sum of exp2(score - max)
  const void* q;              // [B, H, D], last dim contiguous
  int64_t q_stride_b;
  int64_t q_stride_h;
  const void* k_cache;        // [num_blocks, page_size, num_kv_heads, D], contiguous
  const void* v_cache;        // [num_blocks, page_size, num_kv_heads, DV], contiguous
  const int32_t* block_table;  // [B, table_width], rows of stride bt_stride
  int64_t bt_stride;
  const int32_t* seq_lens;    // [B]
  int num_heads;
  int num_kv_heads;
  int group;                  // num_heads / num_kv_heads
  int num_head_chunks;        // ceil(group / GPAD)
  int log2_page;
  int table_width;
  int num_cache_blocks;
  int window;                 // <= 0: no sliding window
  int split_tokens;
  int max_splits;
  int max_pages_per_split;
  float scale_log2;           // softmax scale * log2(e)
  float softcap_log2;         // <= 0: none; else softcap * log2(e): scores s (log2 domain) become c * tanh(s / c)
  const float* sinks;         // nullptr: none; else [H] sink logits (natural log), one more softmax term, no value
};

// The keys a request's query sees, and how many splits cover them; shared by both kernels and the host.
struct KeyRange {
  int first;       // first visible key position
  int count;       // number of visible keys (0 for an empty request)
  int num_splits;  // >= 1
};

__host__ __device__ __forceinline__ KeyRange key_range(int seq_len, int table_width, int log2_page, int window,
                                                       int split_tokens) {
  const int capacity = table_width << log2_page;
  int len = seq_len < 0 ? 0 : seq_len;
  len = len > capacity ? capacity : len;  // never read past the block table
  KeyRange r;
  r.first = (window > 0 && len > window) ? len - window : 0;
  r.count = len - r.first;
  r.num_splits = r.count <= 0 ? 1 : (r.count + split_tokens - 1) / split_tokens;
  return r;
}

// Shared memory of the split kernel, in floats: the score area (split_tokens x GPAD scores, later reused for the
// NW x GPAD x DV cross-warp reduction of the V accumulators), the per-warp statistics, the per-head max and sum; then
// the split's block ids.
__host__ __device__ __forceinline__ int decode_score_floats(int split_tokens, int gpad, int v_head_dim) {
  const int scores = split_tokens * gpad;
  const int reduce = kDecodeWarps * gpad * v_head_dim;
  return scores > reduce ? scores : reduce;
}

__host__ __device__ __forceinline__ int decode_smem_bytes(int split_tokens, int gpad, int v_head_dim,
                                                          int max_pages_per_split) {
  const int floats = decode_score_floats(split_tokens, gpad, v_head_dim) + kDecodeWarps * gpad + 2 * gpad;
  return static_cast<int>(sizeof(float)) * floats + static_cast<int>(sizeof(int)) * max_pages_per_split;
}

// ---- the launch plan (FlashInfer's plan/run split in miniature: everything the launch needs, from shapes alone) ----

constexpr int kMinSplitTokens = 64;    // below this, a split's fixed costs (query, barriers, partial write) dominate
constexpr int kMaxSplitTokens = 1024;  // scores of a split live in shared memory: 1024 x 8 heads x 4 bytes = 32 KiB
constexpr int kMaxGroupPerCta = 8;     // query heads per CTA: registers hold the query and accumulator of each
constexpr int kDeterministicSplit = 256;  // deterministic mode's fixed split size (see cuda_ops.h)

// Keys per split. Deterministic: fixed. Otherwise start from the largest split and halve it until the launch has
// `target_ctas` CTAs: large batches keep big splits (little merge work), short batches of long contexts get many
// small splits so that every multiprocessor has work.
inline int plan_split_tokens(int64_t work_units, int64_t span, bool deterministic, int64_t target_ctas) {
  if (deterministic) return kDeterministicSplit;
  int split = kMaxSplitTokens;
  while (split > kMinSplitTokens && work_units * ((span + split - 1) / split) < target_ctas) split /= 2;
  return split;
}

struct DecodePlan {
  int gpad;                 // query heads per CTA, a power of two (the kernel template argument)
  int num_head_chunks;      // CTAs per KV head along the heads: ceil(group / gpad)
  int split_tokens;
  int max_splits;           // splits of the longest possible request: grid.z
  int log2_page;
  int window;               // <= 0: none
  int max_pages_per_split;
  int smem_bytes;
  unsigned grid_x, grid_y, grid_z;
};

// The plan for a batch; needs only shapes (never seq_lens, which live on the device). span is the longest key range
// a request can have: the block table's capacity, or the window when that is shorter.
inline DecodePlan plan_decode(int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t v_head_dim,
                              int64_t page_size, int64_t table_width, int64_t sliding_window, bool deterministic,
                              int64_t target_ctas) {
  DecodePlan plan{};
  const int group = static_cast<int>(num_heads / num_kv_heads);
  const int capped = group < kMaxGroupPerCta ? group : kMaxGroupPerCta;
  plan.gpad = 1;
  while (plan.gpad < capped) plan.gpad *= 2;
  plan.num_head_chunks = (group + plan.gpad - 1) / plan.gpad;
  const int64_t capacity = table_width * page_size;
  const int64_t span = sliding_window > 0 && sliding_window < capacity ? sliding_window : capacity;
  plan.split_tokens = plan_split_tokens(batch * num_kv_heads * plan.num_head_chunks, span, deterministic, target_ctas);
  const int64_t splits = (span + plan.split_tokens - 1) / plan.split_tokens;
  plan.max_splits = static_cast<int>(splits < 1 ? 1 : (splits > 0x7fffffff ? 0x7fffffff : splits));
  plan.log2_page = 0;
  while ((int64_t{1} << plan.log2_page) < page_size) ++plan.log2_page;
  plan.window = sliding_window > 0 ? static_cast<int>(sliding_window < capacity + 1 ? sliding_window : capacity + 1)
                                   : 0;
  // A split of S keys starting anywhere in a page touches at most ceil(S / page) + 1 pages.
  plan.max_pages_per_split = static_cast<int>((plan.split_tokens + page_size - 1) / page_size + 1);
  plan.smem_bytes = decode_smem_bytes(plan.split_tokens, plan.gpad, static_cast<int>(v_head_dim),
                                      plan.max_pages_per_split);
  plan.grid_x = static_cast<unsigned>(num_kv_heads * plan.num_head_chunks);
  plan.grid_y = static_cast<unsigned>(batch);
  plan.grid_z = static_cast<unsigned>(plan.max_splits);
  return plan;
}

// The (K, V) head dims the kernels are compiled for: equal dims of 64, 128 or 256, and multi-head latent attention's
// K 192 / V 128 (DeepSeek-V2/V3 and their relatives).
__host__ __device__ constexpr bool decode_head_dims_supported(int64_t head_dim, int64_t v_head_dim) {
  return (head_dim == v_head_dim && (head_dim == 64 || head_dim == 128 || head_dim == 256)) ||
         (head_dim == 192 && v_head_dim == 128);
}

// Launch the split kernel over `grid` = (kv_heads x head chunks, batch, max_splits) and, when a request can have
// more than one split, the merge kernel over (heads, batch); one per element type (cuda_decode_attention_<dtype>.cu).
// They return the launch status (cudaErrorInvalidValue for head dims outside decode_head_dims_supported).
cudaError_t launch_decode_attention_f16(const DecodeParams& p, int head_dim, int v_head_dim, int gpad, dim3 grid,
                                        int smem_bytes, cudaStream_t stream);
cudaError_t launch_decode_attention_bf16(const DecodeParams& p, int head_dim, int v_head_dim, int gpad, dim3 grid,
                                         int smem_bytes, cudaStream_t stream);
cudaError_t launch_decode_attention_f32(const DecodeParams& p, int head_dim, int v_head_dim, int gpad, dim3 grid,
                                        int smem_bytes, cudaStream_t stream);

}  // namespace cuda
}  // namespace cbcore
