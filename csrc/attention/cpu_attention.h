// Paged attention on the CPU: writing new K/V into pages, decode (one query per request) and packed
// causal prefill, all reading the pages in place through the block table.
//
// Semantics are those of the plain-torch references in cbcore/ops/reference.py (`*_reference`), which are the
// specification; tests/test_kernels_cpu.py holds the two together. Shapes (docs/design.md, "Kernels and their
// dispatch"):
//
//   k_cache, v_cache  [num_blocks, page_size, num_kv_heads, head_dim], contiguous, fp32 / bf16 / fp16
//   block_table       [batch, max_blocks] int32 (int64 accepted); entries past a request's length unread
//   slot_mapping      [num_tokens] int64, block * page_size + offset
//   decode            q [batch, heads, head_dim], seq_lens [batch]
//   prefill           q [num_tokens, heads, head_dim] packed, cu_seqlens_q [batch + 1], seq_lens_k [batch];
//                     request i's queries are the LAST q_len_i of its seq_lens_k[i] keys
//   sliding_window    w >= 1 lets query position p see key k iff p - w < k <= p; -1 means no window
//   softcap           c > 0: scores (q . k * scale) become c * tanh(score / c) before masking; 0 means none
//   sinks             None, or [heads] fp32: a logit per query head that joins the softmax's denominator
//                     (e^sink) and has no value (GPT-OSS); added once per request, in split-K by its first chunk
//   v_cache's head dim may differ from k_cache's (multi-head latent attention); the output has V's
//
// q must have the cache's dtype and a contiguous last dimension (any other strides are fine); head_dim
// must be a multiple of 8; heads a multiple of kv_heads. Scores, softmax and the weighted sum run in
// fp32 whatever the storage dtype. Anything else raises (cbcore/ops routes such calls to the
// reference instead). Results do not depend on the number of threads or on the other requests of the
// batch: each (request, kv head, chunk) is computed by one thread in a fixed order.
//
// How the work is split (why: 2..N cores, ragged requests, caches bigger than the CPU's caches):
//   decode   one item per (request, 1024-position chunk of its keys), covering all its kv heads (or a
//            slice of them when there are too few items to feed the threads). A request longer than
//            one chunk is merged from its chunks' partial softmax states (split-K), so one long request
//            still keeps every core busy; chunk boundaries are fixed positions, never a function of the
//            batch. Keys are walked in tiles of 32: the tile's K and V rows (all the item's heads,
//            adjacent in a page) are converted into a small fp32 stage in page order while the next
//            tile is prefetched, then every query head of each kv head (GQA: the group together)
//            attends to it with an online softmax. (The AVX-512 copy reads K/V in place instead of
//            staging: cpu_attention_avx512.inc.)
//   cascade  requests whose block tables start with the same physical blocks (prefix sharing) are
//            grouped by the plan; each group's shared prefix is one more kind of item, (group, kv head,
//            tile of rows = members x query heads, chunk of prefix keys), computed like prefill with
//            every key visible and merged with each member's own chunks (its keys after the prefix) as
//            split-K chunks are. See plan_decode for when a group is formed.
//   prefill  one item per (request, kv head, tile of ~128 query rows = positions x query heads of that
//            kv head); keys are walked in tiles of 64 with an online softmax, each tile of K/V
//            converted once into an fp32 panel shared by all the tile's query rows.
//   Items are handed out longest first from an atomic counter inside one at::parallel_for region.
//
// Instruction sets: the kernels are written with GCC/Clang vector extensions (8 x fp32) and compiled
// three times in cpu_attention.cpp: once for the build's baseline (x86-64: SSE2; elsewhere: whatever
// the compiler targets by default) and, with GCC on x86-64, under `#pragma GCC target("avx2,fma,f16c")`
// and under AVX-512F/BW/VL/DQ. The AVX-512 copy adds a 512-bit decode (cpu_attention_avx512.inc) whose
// bf16 dot products use vdpbf16ps in one function compiled for AVX512-BF16 and called only where the
// CPU has it (and the lane kernels' bf16 scores AMX's tiles, in one compiled for AMX, where it has those). The
// best copy the CPU runs is chosen at run time (__builtin_cpu_supports); set_isa forces
// one. No -march flag is used: the extension is compiled where it is installed, but wheels built from
// it get copied and cached, and a -march=native binary dies with SIGILL on an older CPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cbcore {
namespace cpu {

// k/v [num_tokens, kv_heads, head_dim] (any dtype among fp32/bf16/fp16; converted to the cache's)
// into the slots slot_mapping[t] of k_cache / v_cache. ValueError for a slot outside the cache.
void cache_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& slot_mapping);

// One query token per request against that request's pages. Returns [batch, heads, v_head_dim] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                            int64_t sliding_window, double softcap, const std::optional<at::Tensor>& sinks,
                            bool cascade = true);

// Packed bottom-right aligned causal attention over the pages. Returns [num_tokens, heads, v_head_dim].
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& seq_lens_k, double scale, int64_t sliding_window, double softcap,
                             const std::optional<at::Tensor>& sinks);

// ---- plan once per step, run per layer ----------------------------------------------------------------
// A step's block tables and lengths are the same for every layer: the work split (items, split-K merges) and the
// validation of every block-table entry are done once, by a plan, and every layer's call reuses it. A plan is
// specific to a sliding window and a (kv heads, query heads) shape, which may differ between layers (cbcore/ops
// keeps one per key for the step). The planned calls write into `out` ([rows, heads, v_head_dim], contiguous, q's
// dtype: a slice of the attention layer's output) instead of allocating.

struct DecodePlanData;
struct PrefillPlanData;

// Hidden like pybind11's own types (the extension's classes are not part of any shared-library interface).
#define CBCORE_HIDDEN __attribute__((visibility("hidden")))

class CBCORE_HIDDEN DecodePlan {
 public:
  explicit DecodePlan(std::shared_ptr<const DecodePlanData> data) : data(std::move(data)) {}
  int64_t batch() const;
  // The cascade groups: (member requests, shared prefix length) each.
  std::vector<std::pair<std::vector<int64_t>, int64_t>> cascade_groups() const;
  std::shared_ptr<const DecodePlanData> data;
};

class CBCORE_HIDDEN PrefillPlan {
 public:
  explicit PrefillPlan(std::shared_ptr<const PrefillPlanData> data) : data(std::move(data)) {}
  int64_t num_tokens() const;
  std::shared_ptr<const PrefillPlanData> data;
};

// Validates block_table / seq_lens against a cache of num_blocks x page_size and splits the work for kv_heads x
// heads attention with this window (-1: none). ValueError naming the request and the entry on bad input.
// With cascade, requests sharing leading blocks are grouped (cpu_attention.cpp, find_cascade_groups): a group needs
// >= 8 query rows per kv head (members x heads / kv_heads) and >= 32 shared keys, and takes no request whose window
// starts after key 0.
DecodePlan plan_decode(const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t num_blocks,
                       int64_t page_size, int64_t kv_heads, int64_t heads, int64_t sliding_window,
                       bool cascade = true);

void decode_attention_planned(const DecodePlan& plan, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, double scale, double softcap,
                              const std::optional<at::Tensor>& sinks, const at::Tensor& out);

PrefillPlan plan_prefill(const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k,
                         int64_t num_blocks, int64_t page_size, int64_t kv_heads, int64_t heads,
                         int64_t sliding_window);

void prefill_attention_planned(const PrefillPlan& plan, const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, double scale, double softcap,
                               const std::optional<at::Tensor>& sinks, const at::Tensor& out);

// The instruction set the kernels run with: "avx512_amx" (AVX-512 with vdpbf16ps, and AMX's bf16 tiles for the lane
// kernels' scores and weighted sums), "avx512_bf16" (AVX-512 with vdpbf16ps for bf16), "avx512", "avx2" or "generic".
std::string isa();

// Whether this CPU has AMX's bf16 tiles and Linux granted this process their state (asked once, on the first call);
// false where the build has no AVX-512 copy. The skinny matmul's bf16 tiles ask here too.
bool amx_tiles();

// The instruction sets this CPU and build can run, portable first.
std::vector<std::string> available_isas();

// Force one of available_isas() (ValueError naming the available ones otherwise), or "auto": the best one.
void set_isa(const std::string& name);

}  // namespace cpu
}  // namespace cbcore
