// Paged attention on the CPU (see cpu_attention.h for the contract and how the work is split).
//
// This file checks arguments, plans the work items, and dispatches on dtype and instruction set; the
// kernels themselves are in cpu_attention_kernels.inc, compiled here once per instruction set.
#include "attention/cpu_attention.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if !defined(__GNUC__)
#error "cbcore's CPU attention kernels use GCC/Clang vector extensions; build with GCC or Clang"
#endif

// The AVX2 and AVX-512 copies need GCC's `#pragma GCC target` on x86-64 (Clang builds get the generic copy only).
#if defined(__x86_64__) && !defined(__clang__)
#define CBCORE_HAVE_AVX2_COPY 1
#define CBCORE_HAVE_AVX512_COPY 1
// The intrinsics' declarations only: each carries its own target attribute, so including them compiles no AVX
// instruction into the generic copy.
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define CBCORE_HAVE_AVX2_COPY 0
#define CBCORE_HAVE_AVX512_COPY 0
#endif

#if defined(__clang__) || __GNUC__ >= 12
#define CB_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define CB_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi32{__VA_ARGS__})
#endif

// Every function taking or returning a 32-byte vector is always_inline, so the "AVX vector argument
// without AVX changes the ABI" note of the generic copy concerns no real call.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace cbcore {
namespace cpu {
namespace {

// 8 x fp32 and friends. The generic copy lowers them to two SSE registers (or NEON on ARM); the AVX2
// copy to one ymm register.
typedef float vfloat __attribute__((vector_size(32)));
typedef int32_t vi32 __attribute__((vector_size(32)));
typedef uint32_t vu32 __attribute__((vector_size(32)));
typedef uint16_t vu16x8 __attribute__((vector_size(16)));

struct DecodeParams {
  const void* q;
  int64_t q_stride_b, q_stride_h;  // elements; the head dim is contiguous
  const void* k_cache;
  const void* v_cache;
  int64_t page_size, page_stride, token_stride;  // elements, of k_cache
  int64_t v_page_stride, v_token_stride;          // elements, of v_cache (its head dim may differ)
  int64_t group, head_dim, v_head_dim;
  const int32_t* block_table;
  int64_t table_stride;
  float scale;
  float softcap;       // <= 0: none; else scores become softcap * tanh(score / softcap)
  const float* sinks;  // nullptr: none; else [heads] sink logits joining every softmax's denominator
  void* out;  // [batch, heads, v_head_dim] contiguous
  int64_t out_stride_b;
  float* partials;   // per split chunk: num_rows x (max, sum, v_head_dim accumulators)
  int64_t num_rows;  // query heads
  bool dpbf16;       // the AVX-512 copy may use vdpbf16ps (the CPU has AVX512-BF16 and the ISA allows it)
  bool amx = false;  // ... and AMX's bf16 tiles for the lane kernels (the cascade's shared prefix)
};

struct DecodeItem {
  int64_t request, head_begin, head_end;  // kv heads [head_begin, head_end)
  int64_t begin, end;                     // key positions
  int64_t partial;  // -1: write the output directly; else the chunk's slot in DecodeParams::partials
  bool first;       // the request's first chunk: the one that adds the sink (exactly once per request)
};

// Cascade decode: requests whose block tables start with the same physical blocks (prefix sharing) attend to that
// common prefix together, as one matrix of queries (members x query heads) against keys read once, and each to its
// own suffix alone (ordinary DecodeItems); the partial softmax states are merged like split-K chunks.
struct CascadeGroup {
  std::vector<int64_t> members;    // requests, in batch order
  std::vector<int64_t> slot_base;  // per member: its first partial slot (the prefix chunks' slots come first)
  int64_t table_request;           // a member whose block table row is read for the prefix (all hold the same)
  int64_t prefix;                  // shared key positions [0, prefix)
};

struct CascadeItem {
  int64_t group, kv_head;
  int64_t row_begin, row_end;  // rows member * group + g of the group's members, for this kv head
  int64_t begin, end;          // key positions inside the prefix (one split-K chunk of it)
  int64_t chunk;               // which chunk: its slot is slot_base[member] + chunk; chunk 0 adds the sinks
};

struct PrefillParams {
  const void* q;
  int64_t q_stride_t, q_stride_h;
  const void* k_cache;
  const void* v_cache;
  int64_t page_size, page_stride, token_stride;  // of k_cache
  int64_t v_page_stride, v_token_stride;          // of v_cache
  int64_t group, head_dim, v_head_dim;
  const int32_t* block_table;
  int64_t table_stride;
  const int32_t* cu_seqlens_q;
  const int32_t* seq_lens_k;
  float scale;
  int64_t window;      // <= 0: none
  float softcap;       // <= 0: none
  const float* sinks;  // nullptr: none; else [heads]
  void* out;           // [num_tokens, heads, v_head_dim] contiguous
  int64_t out_stride_t;
  bool dpbf16;       // the AVX-512 copy may use vdpbf16ps (as DecodeParams::dpbf16)
  bool amx = false;  // ... and AMX's bf16 tiles for the lane kernels (as DecodeParams::amx)
};

struct PrefillItem {
  int64_t request, kv_head, q_begin, q_end;  // query positions [q_begin, q_end) within the request
};

// Split-K chunk for decode: positions [c * kDecodeChunk, (c + 1) * kDecodeChunk).
constexpr int64_t kDecodeChunk = 1024;

// Below this much work (cost units: one key for one query row) a call stays on the calling thread: waking
// the pool costs more than it saves.
constexpr int64_t kMinCostPerThread = 4096;

// How many threads a parallel region over num_items items of total_cost takes: at most one per item, and one per
// kMinCostPerThread of work.
int64_t item_threads(int64_t num_items, int64_t total_cost) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_items);
  return std::max<int64_t>(1, std::min(threads, total_cost / kMinCostPerThread));
}

// Runs work(i, scratch) for every item i, items taken in order from a shared counter by up to
// at::get_num_threads() threads (dynamic scheduling: items are ragged). Each thread reuses one scratch buffer.
template <typename F>
void run_items(int64_t num_items, int64_t total_cost, const F& work) {
  if (num_items == 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, item_threads(num_items, total_cost), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) work(i, scratch);
  });
}

// run_items, each thread taking its next item before it runs the current one: work(i, following, scratch) knows
// the item it runs after i (-1: none), so that i's last tiles can prefetch following's first keys. Taking one item
// early leaves the other threads at most one (the smallest: items come sorted by cost) more to wait for at the end.
template <typename F>
void run_items_with_next(int64_t num_items, int64_t total_cost, const F& work) {
  if (num_items == 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, item_threads(num_items, total_cost), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next.fetch_add(1); i < num_items;) {
      const int64_t following = next.fetch_add(1);
      work(i, following < num_items ? following : -1, scratch);
      i = following;
    }
  });
}

namespace generic {
#include "attention/cpu_attention_kernels.inc"
}  // namespace generic

#if CBCORE_HAVE_AVX2_COPY
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "attention/cpu_attention_kernels.inc"
}  // namespace avx2
#pragma GCC pop_options
#endif

// The AVX-512 copy: the same kernels compiled for AVX-512F/BW/VL/DQ (32 vector registers, masked and 3-operand
// forms; the 8-lane code stays 8 lanes), plus the 512-bit decode of cpu_attention_avx512.inc, whose bf16 dot
// products use AVX512-BF16 in one function compiled for it and called only where the CPU has it.
#if CBCORE_HAVE_AVX512_COPY
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12 warns inside its own AVX-512 headers (the "undefined" pass-through source of unmasked intrinsics).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace avx512 {
#define CB_WIDE_DECODE 1
#include "attention/cpu_attention_kernels.inc"
#undef CB_WIDE_DECODE
}  // namespace avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

// ---- instruction set -----------------------------------------------------------------------------------

// kAvx512, kAvx512Bf16 and kAvx512Amx run the same copy; kAvx512Bf16 also lets it use vdpbf16ps, kAvx512Amx
// vdpbf16ps and AMX's bf16 tiles (the lane kernels' scores and weighted sums).
enum class Isa { kGeneric, kAvx2, kAvx512, kAvx512Bf16, kAvx512Amx };

bool cpu_has_avx2() {
#if CBCORE_HAVE_AVX2_COPY
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if CBCORE_HAVE_AVX512_COPY
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool cpu_has_avx512_bf16() {
#if CBCORE_HAVE_AVX512_COPY
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// AMX's tile registers are off for a process until it asks Linux for them (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, Linux 5.16+); asked once. oneDNN asks too, for its own AMX kernels.
bool cpu_has_amx() {
#if CBCORE_HAVE_AVX512_COPY && defined(__linux__) && defined(SYS_arch_prctl)
  static const bool granted = [] {
    __builtin_cpu_init();
    if (!cpu_has_avx512_bf16() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16"))
      return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

Isa best_isa() {
  if (cpu_has_amx()) return Isa::kAvx512Amx;
  if (cpu_has_avx512_bf16()) return Isa::kAvx512Bf16;
  if (cpu_has_avx512()) return Isa::kAvx512;
  return cpu_has_avx2() ? Isa::kAvx2 : Isa::kGeneric;
}

std::atomic<Isa>& active_isa() {
  static std::atomic<Isa> isa{best_isa()};
  return isa;
}

// Runs NAME<T>(args...) of the active instruction set's copy.
#if CBCORE_HAVE_AVX512_COPY
#define CB_RUN_ISA(isa, NAME, ...)                                 \
  do {                                                             \
    switch (isa) {                                                 \
      case Isa::kAvx512Amx:                                        \
      case Isa::kAvx512Bf16:                                       \
      case Isa::kAvx512: avx512::NAME(__VA_ARGS__); break;         \
      case Isa::kAvx2: avx2::NAME(__VA_ARGS__); break;             \
      default: generic::NAME(__VA_ARGS__); break;                  \
    }                                                              \
  } while (0)
#else
#define CB_RUN_ISA(isa, NAME, ...)        \
  do {                                    \
    (void)(isa);                          \
    generic::NAME(__VA_ARGS__);           \
  } while (0)
#endif

// ---- argument checks -----------------------------------------------------------------------------------

bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK_VALUE(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "cbcore CPU attention: caches must be CPU tensors");
  TORCH_CHECK_VALUE(k_cache.dim() == 4, "cbcore CPU attention: k_cache must be [num_blocks, page_size, kv_heads, head_dim], got ",
                    k_cache.sizes());
  // V may have its own head dim (multi-head latent attention: DeepSeek-V2/V3); everything else matches K's.
  TORCH_CHECK_VALUE(v_cache.dim() == 4 && k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3) &&
                        k_cache.scalar_type() == v_cache.scalar_type(),
                    "cbcore CPU attention: k_cache ", k_cache.sizes(), " ", k_cache.scalar_type(), " and v_cache ",
                    v_cache.sizes(), " ", v_cache.scalar_type(), " differ (only the head dims may)");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "cbcore CPU attention: caches must be contiguous");
  TORCH_CHECK_VALUE(supported_dtype(k_cache.scalar_type()), "cbcore CPU attention: cache dtype ", k_cache.scalar_type(),
                    " is not supported (float32, bfloat16, float16)");
  TORCH_CHECK_VALUE(k_cache.size(3) % 8 == 0 && v_cache.size(3) % 8 == 0,
                    "cbcore CPU attention: head dims must be multiples of 8, got ", k_cache.size(3), " (K) and ",
                    v_cache.size(3), " (V)");
}

// softcap: 0 for none, else a positive finite cap.
float check_softcap(double softcap) {
  TORCH_CHECK_VALUE(softcap == 0.0 || (softcap > 0.0 && std::isfinite(softcap)),
                    "cbcore CPU attention: softcap must be 0 (none) or a positive finite number, got ", softcap);
  return static_cast<float>(softcap);
}

// sinks: None, or [heads] fp32 contiguous on the CPU (cbcore/ops converts them).
const float* check_sinks(const std::optional<at::Tensor>& sinks, int64_t heads) {
  if (!sinks.has_value()) return nullptr;
  const at::Tensor& t = *sinks;
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == heads &&
                        t.is_contiguous(),
                    "cbcore CPU attention: sinks must be a contiguous float32 CPU tensor [heads=", heads, "], got ",
                    t.sizes(), " ", t.scalar_type(), " on ", t.device());
  return t.const_data_ptr<float>();
}

void check_query(const at::Tensor& q, const at::Tensor& k_cache) {
  TORCH_CHECK_VALUE(q.device().is_cpu(), "cbcore CPU attention: q must be a CPU tensor");
  TORCH_CHECK_VALUE(q.dim() == 3 && q.size(2) == k_cache.size(3), "cbcore CPU attention: q must be [*, heads, ",
                    k_cache.size(3), "], got ", q.sizes());
  TORCH_CHECK_VALUE(q.size(1) % k_cache.size(2) == 0, "cbcore CPU attention: ", q.size(1),
                    " query heads are not a multiple of ", k_cache.size(2), " kv heads");
  TORCH_CHECK_VALUE(q.scalar_type() == k_cache.scalar_type(), "cbcore CPU attention: q is ", q.scalar_type(),
                    " but the cache is ", k_cache.scalar_type());
  TORCH_CHECK_VALUE(q.stride(2) == 1, "cbcore CPU attention: q's last dimension must be contiguous");
}

at::Tensor as_int32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.dim() == dim, "cbcore CPU attention: ", name, " must be a ", dim,
                    "-D CPU tensor, got ", t.sizes());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "cbcore CPU attention: ", name,
                    " must be int32 or int64, got ", t.scalar_type());
  return t.to(at::kInt).contiguous();
}

int64_t check_window(int64_t sliding_window) {
  TORCH_CHECK_VALUE(sliding_window == -1 || sliding_window >= 1,
                    "cbcore CPU attention: sliding_window must be >= 1, or -1 for none; got ", sliding_window);
  return sliding_window;
}

// Every block a request of `length` tokens reads must be in its table row and inside the cache.
void check_table_row(const int32_t* row, int64_t max_blocks, int64_t num_blocks, int64_t page_size, int64_t length,
                     int64_t request) {
  const int64_t needed = (length + page_size - 1) / page_size;
  TORCH_CHECK_VALUE(needed <= max_blocks, "cbcore CPU attention: request ", request, " has ", length,
                    " keys but its block table row holds ", max_blocks, " blocks of ", page_size);
  for (int64_t i = 0; i < needed; ++i)
    TORCH_CHECK_VALUE(row[i] >= 0 && row[i] < num_blocks, "cbcore CPU attention: request ", request,
                      " block table entry ", i, " is ", row[i], ", outside [0, ", num_blocks, ")");
}

// Query positions per prefill item: about 128 query rows (positions x query heads of one kv head); 128 measured
// 5-20% faster than 64 (the K/V panels are packed once per item, so bigger items pack less often).
int64_t prefill_query_tile(int64_t group) { return std::max<int64_t>(1, 128 / group); }

template <typename T>
void copy_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  const int64_t num_tokens = src.size(0), kv_heads = src.size(1), head_dim = src.size(2);
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  const int64_t token_stride = kv_heads * head_dim;
  T* dst = cache.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, 65536 / token_stride);
  auto run = [&](auto* src_ptr) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(src_ptr)>>;
    at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          const S* from = src_ptr + t * s0 + h * s1;
          T* to = dst + slots[t] * token_stride + h * head_dim;
          if constexpr (std::is_same_v<S, T>) {
            std::memcpy(to, from, sizeof(T) * head_dim);
          } else {
            for (int64_t d = 0; d < head_dim; ++d) to[d] = static_cast<T>(static_cast<float>(from[d]));
          }
        }
      }
    });
  };
  switch (src.scalar_type()) {
    case at::kFloat: run(src.const_data_ptr<float>()); break;
    case at::kBFloat16: run(src.const_data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(src.const_data_ptr<c10::Half>()); break;
    default: TORCH_CHECK_VALUE(false, "cbcore cache_write: k/v dtype ", src.scalar_type(), " is not supported");
  }
}

template <typename F>
void dispatch_dtype(at::ScalarType t, const F& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK_VALUE(false, "cbcore CPU attention: dtype ", t, " is not supported");
  }
}

}  // namespace

bool amx_tiles() { return cpu_has_amx(); }

// ---- public ops ------------------------------------------------------------------------------------------

void cache_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(k_cache.device().is_cpu() && v_cache.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
                    "cbcore cache_write: every tensor must be on the CPU");
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.dim() == 4 &&
                        k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3) && k_cache.is_contiguous() &&
                        v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
                    "cbcore cache_write: k_cache and v_cache must be contiguous [num_blocks, page_size, kv_heads, "
                    "head_dim] tensors of one dtype, differing in head_dim at most");
  TORCH_CHECK_VALUE(supported_dtype(k_cache.scalar_type()), "cbcore cache_write: cache dtype ", k_cache.scalar_type(),
                    " is not supported");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK_VALUE(k.dim() == 3 && v.dim() == 3 && k.size(0) == v.size(0) && k.size(1) == k_cache.size(2) &&
                        v.size(1) == v_cache.size(2) && k.size(2) == k_cache.size(3) && v.size(2) == v_cache.size(3),
                    "cbcore cache_write: k and v must be [num_tokens, ", k_cache.size(2), ", ", k_cache.size(3),
                    "] and [num_tokens, ", v_cache.size(2), ", ", v_cache.size(3), "], got ", k.sizes(), " and ",
                    v.sizes());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) && slot_mapping.device().is_cpu() &&
                        (slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt),
                    "cbcore cache_write: slot_mapping must be a 1-D integer CPU tensor of ", k.size(0),
                    " slots, got ", slot_mapping.sizes(), " ", slot_mapping.scalar_type());
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* s = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK_VALUE(s[t] >= 0 && s[t] < num_slots, "cbcore cache_write: slot ", s[t], " of token ", t,
                      " is outside the cache [0, ", num_slots, ")");
  const at::Tensor kc = k.stride(2) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(2) == 1 ? v : v.contiguous();
  at::Tensor k_dst = k_cache, v_dst = v_cache;  // shallow handles onto the same storage
  dispatch_dtype(k_cache.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    copy_rows<T>(kc, k_dst, s);
    copy_rows<T>(vc, v_dst, s);
  });
}

// ---- plans -----------------------------------------------------------------------------------------------

struct DecodePlanData {
  at::Tensor table, lens;  // int32, contiguous: the planned items point into them
  int64_t num_blocks, page_size, kv_heads, heads;
  std::vector<DecodeItem> items;  // longest first
  std::vector<std::array<int64_t, 3>> merges;  // (request, first partial slot, count) of split requests
  std::vector<CascadeGroup> groups;            // cascade groups (empty: plain decode)
  std::vector<CascadeItem> cascade_items;      // their shared-prefix work, most expensive first
  int64_t num_partials = 0, total_cost = 0;
};

struct PrefillPlanData {
  at::Tensor table, cu, lens;
  int64_t num_blocks, page_size, kv_heads, heads, num_tokens, window;
  std::vector<PrefillItem> items;  // most expensive first
  int64_t total_cost = 0;
};

int64_t DecodePlan::batch() const { return data->lens.size(0); }
int64_t PrefillPlan::num_tokens() const { return data->num_tokens; }

namespace {

void check_plan_shape(int64_t num_blocks, int64_t page_size, int64_t kv_heads, int64_t heads) {
  TORCH_CHECK_VALUE(num_blocks >= 1 && page_size >= 1 && kv_heads >= 1 && heads >= 1 && heads % kv_heads == 0,
                    "cbcore CPU attention plan: num_blocks ", num_blocks, ", page_size ", page_size, ", kv_heads ",
                    kv_heads, " and heads ", heads, " must be positive, heads a multiple of kv_heads");
}

// What every planned call checks of its layer's tensors against the plan: cheap, shape-only (the per-request
// entries were validated when the plan was built).
void check_layer(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& out,
                 int64_t rows, int64_t num_blocks, int64_t page_size, int64_t kv_heads, int64_t heads,
                 const char* op) {
  check_caches(k_cache, v_cache);
  check_query(q, k_cache);
  TORCH_CHECK_VALUE(q.size(0) == rows && q.size(1) == heads && k_cache.size(0) == num_blocks &&
                        k_cache.size(1) == page_size && k_cache.size(2) == kv_heads,
                    "cbcore ", op, ": q ", q.sizes(), " and k_cache ", k_cache.sizes(), " do not match the plan (",
                    rows, " rows, ", heads, " heads; ", num_blocks, " blocks of ", page_size, ", ", kv_heads,
                    " kv heads)");
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.dim() == 3 && out.size(0) == rows && out.size(1) == heads &&
                        out.size(2) == v_cache.size(3) && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
                    "cbcore ", op, ": out must be a contiguous ", q.scalar_type(), " CPU tensor [", rows, ", ", heads,
                    ", ", v_cache.size(3), "], got ", out.sizes(), " ", out.scalar_type());
}

}  // namespace

namespace {

// When a cascade group pays: at least kCascadeMinRows query rows per kv head (members x query heads per kv head;
// fewer leave the shared-prefix matrix product mostly padding) sharing at least kCascadeMinPrefix leading keys.
constexpr int64_t kCascadeMinRows = 8;
constexpr int64_t kCascadeMinPrefix = 32;

// The requests of a step that share leading physical blocks, grouped (DecodePlanData::groups). A request whose
// sliding window starts after key 0 is left out (its window would cut into the shared prefix); so is every request
// that shares too little. Requests are sorted by their block rows, so sharers are adjacent, then swept in that order:
// a group grows while adding the next request does not lower the reads it saves, (members - 1) x prefix.
std::vector<CascadeGroup> find_cascade_groups(const int32_t* rows, int64_t stride, const int32_t* len, int64_t batch,
                                              int64_t page_size, int64_t window, int64_t group) {
  auto blocks = [&](int64_t b) { return (len[b] + page_size - 1) / page_size; };
  std::vector<int64_t> order;
  for (int64_t b = 0; b < batch; ++b)
    if (window <= 0 || len[b] <= window) order.push_back(b);
  auto lcp = [&](int64_t a, int64_t b) {  // leading blocks two requests share
    const int64_t n = std::min(blocks(a), blocks(b));
    int64_t i = 0;
    while (i < n && rows[a * stride + i] == rows[b * stride + i]) ++i;
    return i;
  };
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int64_t i = lcp(a, b);
    if (i < std::min(blocks(a), blocks(b))) return rows[a * stride + i] < rows[b * stride + i];
    return blocks(a) != blocks(b) ? blocks(a) < blocks(b) : a < b;
  });
  std::vector<CascadeGroup> groups;
  for (size_t i = 0; i < order.size();) {
    int64_t shared = blocks(order[i]), min_len = len[order[i]], prefix = min_len;
    size_t j = i + 1;
    for (; j < order.size(); ++j) {
      const int64_t s = std::min(shared, lcp(order[j - 1], order[j]));
      if (s == 0) break;
      const int64_t next_len = std::min<int64_t>(min_len, len[order[j]]);
      const int64_t next_prefix = std::min(s * page_size, next_len);
      const int64_t members = static_cast<int64_t>(j - i);
      if (members >= 2 && members * next_prefix < (members - 1) * prefix) break;
      shared = s;
      min_len = next_len;
      prefix = next_prefix;
    }
    const int64_t members = static_cast<int64_t>(j - i);
    if (members >= 2 && members * group >= kCascadeMinRows && prefix >= kCascadeMinPrefix) {
      CascadeGroup g;
      g.members.assign(order.begin() + i, order.begin() + j);
      std::sort(g.members.begin(), g.members.end());
      g.table_request = g.members[0];
      g.prefix = prefix;
      groups.push_back(std::move(g));
    }
    i = j;
  }
  std::sort(groups.begin(), groups.end(),
            [](const CascadeGroup& a, const CascadeGroup& b) { return a.members[0] < b.members[0]; });
  return groups;
}

}  // namespace

DecodePlan plan_decode(const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t num_blocks,
                       int64_t page_size, int64_t kv_heads, int64_t heads, int64_t sliding_window, bool cascade) {
  check_plan_shape(num_blocks, page_size, kv_heads, heads);
  auto plan = std::make_shared<DecodePlanData>();
  plan->table = as_int32(block_table, "block_table", 2);
  plan->lens = as_int32(seq_lens, "seq_lens", 1);
  plan->num_blocks = num_blocks;
  plan->page_size = page_size;
  plan->kv_heads = kv_heads;
  plan->heads = heads;
  const int64_t window = check_window(sliding_window);
  const int64_t batch = plan->lens.size(0);
  TORCH_CHECK_VALUE(plan->table.size(0) == batch, "cbcore decode_attention: ", batch, " seq_lens but block_table has ",
                    plan->table.size(0), " rows");
  const int32_t* len = plan->lens.const_data_ptr<int32_t>();
  const int32_t* rows = plan->table.const_data_ptr<int32_t>();
  const int64_t stride = plan->table.size(1), group = heads / kv_heads;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(len[b] >= 1, "cbcore decode_attention: request ", b, " has seq_len ", len[b],
                      "; it must be >= 1");
    check_table_row(rows + b * stride, stride, num_blocks, page_size, len[b], b);
  }
  if (cascade) plan->groups = find_cascade_groups(rows, stride, len, batch, page_size, window, group);
  std::vector<int64_t> prefix(batch, 0);  // keys a cascade group attends for the request
  for (const CascadeGroup& g : plan->groups)
    for (int64_t b : g.members) prefix[b] = g.prefix;

  // Each request's own key range (after its window's start and its cascade prefix) and its chunks.
  std::vector<int64_t> begins(batch);
  int64_t num_chunks = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = len[b];
    begins[b] = std::max<int64_t>(window > 0 ? std::max<int64_t>(0, n - window) : 0, prefix[b]);
    if (begins[b] < n) num_chunks += (n - 1) / kDecodeChunk - begins[b] / kDecodeChunk + 1;
    plan->total_cost += (n - begins[b]) * heads;
  }
  // An item takes every kv head of its chunk (pages are then read front to back) unless that leaves too few items
  // to balance over the threads; splitting heads changes no result, each head is computed the same way.
  int64_t head_split = 1;
  while (head_split < kv_heads && num_chunks * head_split < 4 * at::get_num_threads()) head_split *= 2;
  const int64_t heads_per_item = (kv_heads + head_split - 1) / head_split;

  std::vector<int64_t> slot_base(batch, -1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = len[b], begin = begins[b];
    const int64_t prefix_chunks = (prefix[b] + kDecodeChunk - 1) / kDecodeChunk;
    const int64_t first_chunk = begin / kDecodeChunk, last_chunk = (n - 1) / kDecodeChunk;
    const int64_t own_chunks = begin < n ? last_chunk - first_chunk + 1 : 0;
    const bool merged = prefix_chunks + own_chunks > 1 || prefix[b] > 0;
    if (merged) {
      slot_base[b] = plan->num_partials;
      plan->merges.push_back({b, plan->num_partials, prefix_chunks + own_chunks});
      plan->num_partials += prefix_chunks;  // the cascade prefix's slots, then the request's own chunks'
    }
    for (int64_t c = first_chunk; own_chunks > 0 && c <= last_chunk; ++c) {
      const int64_t partial = merged ? plan->num_partials++ : -1;
      // The sink is added once per request: by its cascade prefix when it has one, else by its first chunk.
      for (int64_t h = 0; h < kv_heads; h += heads_per_item)
        plan->items.push_back({b, h, std::min(kv_heads, h + heads_per_item), std::max(begin, c * kDecodeChunk),
                               std::min(n, (c + 1) * kDecodeChunk), partial, c == first_chunk && prefix[b] == 0});
    }
  }
  std::stable_sort(plan->items.begin(), plan->items.end(), [](const DecodeItem& a, const DecodeItem& b) {
    return (a.end - a.begin) * (a.head_end - a.head_begin) > (b.end - b.begin) * (b.head_end - b.head_begin);
  });

  // The shared prefixes: (group, kv head, tile of rows, chunk of keys). Tiles of up to 128 rows (as prefill),
  // smaller when that leaves fewer than two items per thread.
  int64_t prefix_units = 0;
  for (const CascadeGroup& g : plan->groups) prefix_units += kv_heads * ((g.prefix + kDecodeChunk - 1) / kDecodeChunk);
  const int64_t wanted = 2 * at::get_num_threads();
  for (size_t gi = 0; gi < plan->groups.size(); ++gi) {
    CascadeGroup& g = plan->groups[gi];
    for (int64_t b : g.members) g.slot_base.push_back(slot_base[b]);
    const int64_t total_rows = static_cast<int64_t>(g.members.size()) * group;
    int64_t tile = std::min<int64_t>(128, total_rows);
    if (prefix_units < wanted) {
      const int64_t pieces = (wanted + prefix_units - 1) / prefix_units;
      tile = std::max<int64_t>(std::min<int64_t>(16, total_rows), (total_rows + pieces - 1) / pieces);
    }
    tile = (tile + 3) / 4 * 4;  // whole micro-tiles of 4 rows
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t r = 0; r < total_rows; r += tile)
        for (int64_t c = 0; c * kDecodeChunk < g.prefix; ++c)
          plan->cascade_items.push_back({static_cast<int64_t>(gi), h, r, std::min(total_rows, r + tile),
                                         c * kDecodeChunk, std::min(g.prefix, (c + 1) * kDecodeChunk), c});
    plan->total_cost += g.prefix * total_rows * kv_heads;
  }
  std::stable_sort(plan->cascade_items.begin(), plan->cascade_items.end(),
                   [](const CascadeItem& a, const CascadeItem& b) {
                     return (a.end - a.begin) * (a.row_end - a.row_begin) > (b.end - b.begin) * (b.row_end - b.row_begin);
                   });
  return DecodePlan(std::move(plan));
}

std::vector<std::pair<std::vector<int64_t>, int64_t>> DecodePlan::cascade_groups() const {
  std::vector<std::pair<std::vector<int64_t>, int64_t>> out;
  for (const CascadeGroup& g : data->groups) out.emplace_back(g.members, g.prefix);
  return out;
}

void decode_attention_planned(const DecodePlan& decode_plan, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, double scale, double softcap,
                              const std::optional<at::Tensor>& sinks, const at::Tensor& out) {
  const DecodePlanData& plan = *decode_plan.data;
  check_layer(q, k_cache, v_cache, out, plan.lens.size(0), plan.num_blocks, plan.page_size, plan.kv_heads, plan.heads,
              "decode_attention");
  const float cap = check_softcap(softcap);
  const float* sink = check_sinks(sinks, q.size(1));
  const int64_t heads = q.size(1), head_dim = q.size(2), v_head_dim = v_cache.size(3);
  // The chunks' partial states. Every slot is written by its item before the merge reads it, so the buffer is not
  // zeroed, and up to kKeptPartials floats it is kept from call to call (W2's cascade step: 270 KB a layer).
  constexpr size_t kKeptPartials = size_t{1} << 20;
  const size_t partials_size = static_cast<size_t>(plan.num_partials * heads * (v_head_dim + 2));
  thread_local std::vector<float> kept_partials;
  std::unique_ptr<float[]> own_partials;
  float* partials = nullptr;
  if (partials_size <= kKeptPartials) {
    if (kept_partials.size() < partials_size) kept_partials.resize(partials_size);
    partials = kept_partials.data();
  } else {
    own_partials.reset(new float[partials_size]);
    partials = own_partials.get();
  }
  DecodeParams P{q.const_data_ptr(), q.stride(0), q.stride(1),
                 k_cache.const_data_ptr(), v_cache.const_data_ptr(),
                 plan.page_size, k_cache.stride(0), k_cache.stride(1),
                 v_cache.stride(0), v_cache.stride(1),
                 heads / plan.kv_heads, head_dim, v_head_dim,
                 plan.table.const_data_ptr<int32_t>(), plan.table.size(1),
                 static_cast<float>(scale), cap, sink,
                 out.data_ptr(), out.stride(0),
                 partials, heads, false};
  const Isa isa = active_isa().load();
  P.dpbf16 = isa == Isa::kAvx512Bf16 || isa == Isa::kAvx512Amx;
  P.amx = isa == Isa::kAvx512Amx;
  dispatch_dtype(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    CB_RUN_ISA(isa, decode_run<T>, P, plan.items, plan.groups, plan.cascade_items, plan.merges, plan.total_cost);
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                            int64_t sliding_window, double softcap, const std::optional<at::Tensor>& sinks,
                            bool cascade) {
  check_caches(k_cache, v_cache);
  check_query(q, k_cache);
  TORCH_CHECK_VALUE(block_table.dim() >= 1 && seq_lens.dim() >= 1 && block_table.size(0) == q.size(0) &&
                        seq_lens.size(0) == q.size(0),
                    "cbcore decode_attention: ", q.size(0), " queries but block_table has ",
                    block_table.dim() ? block_table.size(0) : 0, " rows and seq_lens ",
                    seq_lens.dim() ? seq_lens.size(0) : 0, " entries");
  const DecodePlan plan = plan_decode(block_table, seq_lens, k_cache.size(0), k_cache.size(1), k_cache.size(2),
                                      q.size(1), sliding_window, cascade);
  at::Tensor out = at::empty({q.size(0), q.size(1), v_cache.size(3)}, q.options());
  decode_attention_planned(plan, q, k_cache, v_cache, scale, softcap, sinks, out);
  return out;
}

PrefillPlan plan_prefill(const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k,
                         int64_t num_blocks, int64_t page_size, int64_t kv_heads, int64_t heads,
                         int64_t sliding_window) {
  check_plan_shape(num_blocks, page_size, kv_heads, heads);
  auto plan = std::make_shared<PrefillPlanData>();
  plan->table = as_int32(block_table, "block_table", 2);
  plan->cu = as_int32(cu_seqlens_q, "cu_seqlens_q", 1);
  plan->lens = as_int32(seq_lens_k, "seq_lens_k", 1);
  plan->num_blocks = num_blocks;
  plan->page_size = page_size;
  plan->kv_heads = kv_heads;
  plan->heads = heads;
  plan->window = check_window(sliding_window);
  const int64_t batch = plan->lens.size(0);
  TORCH_CHECK_VALUE(plan->cu.size(0) == batch + 1 && plan->table.size(0) == batch,
                    "cbcore prefill_attention: seq_lens_k has ", batch, " entries, so cu_seqlens_q needs ", batch + 1,
                    " (got ", plan->cu.size(0), ") and block_table ", batch, " rows (got ", plan->table.size(0), ")");
  const int32_t* starts = plan->cu.const_data_ptr<int32_t>();
  const int32_t* len = plan->lens.const_data_ptr<int32_t>();
  const int32_t* rows = plan->table.const_data_ptr<int32_t>();
  TORCH_CHECK_VALUE(starts[0] == 0, "cbcore prefill_attention: cu_seqlens_q must start at 0, got ", starts[0]);
  plan->num_tokens = starts[batch];
  const int64_t group = heads / kv_heads;
  const int64_t tile = prefill_query_tile(group);
  const int64_t window = plan->window;

  std::vector<PrefillItem> items;
  std::vector<int64_t> costs;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t q_len = starts[i + 1] - starts[i], k_len = len[i];
    TORCH_CHECK_VALUE(q_len >= 0 && q_len <= k_len, "cbcore prefill_attention: request ", i, " has ", q_len,
                      " queries but ", k_len, " keys; its queries are the last of its keys, so q_len <= k_len");
    if (q_len == 0) continue;
    check_table_row(rows + i * plan->table.size(1), plan->table.size(1), num_blocks, page_size, k_len, i);
    for (int64_t j0 = 0; j0 < q_len; j0 += tile) {
      const int64_t j1 = std::min(q_len, j0 + tile);
      const int64_t last = k_len - q_len + j1 - 1, first = k_len - q_len + j0;
      const int64_t keys = last + 1 - (window > 0 ? std::max<int64_t>(0, first - window + 1) : 0);
      for (int64_t h = 0; h < kv_heads; ++h) {
        items.push_back({i, h, j0, j1});
        costs.push_back(keys * (j1 - j0) * group);
        plan->total_cost += costs.back();
      }
    }
  }
  std::vector<size_t> order(items.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return costs[a] > costs[b]; });
  plan->items.reserve(items.size());
  for (size_t i : order) plan->items.push_back(items[i]);
  return PrefillPlan(std::move(plan));
}

void prefill_attention_planned(const PrefillPlan& prefill_plan, const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, double scale, double softcap,
                               const std::optional<at::Tensor>& sinks, const at::Tensor& out) {
  const PrefillPlanData& plan = *prefill_plan.data;
  check_layer(q, k_cache, v_cache, out, plan.num_tokens, plan.num_blocks, plan.page_size, plan.kv_heads, plan.heads,
              "prefill_attention");
  const float cap = check_softcap(softcap);
  const float* sink = check_sinks(sinks, q.size(1));
  PrefillParams P{q.const_data_ptr(), q.stride(0), q.stride(1),
                  k_cache.const_data_ptr(), v_cache.const_data_ptr(),
                  plan.page_size, k_cache.stride(0), k_cache.stride(1),
                  v_cache.stride(0), v_cache.stride(1),
                  q.size(1) / plan.kv_heads, q.size(2), v_cache.size(3),
                  plan.table.const_data_ptr<int32_t>(), plan.table.size(1),
                  plan.cu.const_data_ptr<int32_t>(), plan.lens.const_data_ptr<int32_t>(),
                  static_cast<float>(scale), plan.window, cap, sink,
                  out.data_ptr(), out.stride(0)};
  const Isa isa = active_isa().load();
  P.dpbf16 = isa == Isa::kAvx512Bf16 || isa == Isa::kAvx512Amx;
  P.amx = isa == Isa::kAvx512Amx;
  dispatch_dtype(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    CB_RUN_ISA(isa, prefill_run<T>, P, plan.items, plan.total_cost);
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& seq_lens_k, double scale, int64_t sliding_window, double softcap,
                             const std::optional<at::Tensor>& sinks) {
  check_caches(k_cache, v_cache);
  check_query(q, k_cache);
  const PrefillPlan plan = plan_prefill(block_table, cu_seqlens_q, seq_lens_k, k_cache.size(0), k_cache.size(1),
                                        k_cache.size(2), q.size(1), sliding_window);
  TORCH_CHECK_VALUE(plan.num_tokens() == q.size(0), "cbcore prefill_attention: cu_seqlens_q must run from 0 to the ",
                    q.size(0), " packed queries, got 0..", plan.num_tokens());
  at::Tensor out = at::empty({q.size(0), q.size(1), v_cache.size(3)}, q.options());
  prefill_attention_planned(plan, q, k_cache, v_cache, scale, softcap, sinks, out);
  return out;
}

namespace {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Amx: return "avx512_amx";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

}  // namespace

std::string isa() { return isa_name(active_isa().load()); }

std::vector<std::string> available_isas() {
  std::vector<std::string> names{"generic"};
  if (cpu_has_avx2()) names.push_back("avx2");
  if (cpu_has_avx512()) names.push_back("avx512");
  if (cpu_has_avx512_bf16()) names.push_back("avx512_bf16");
  if (cpu_has_amx()) names.push_back("avx512_amx");
  return names;
}

void set_isa(const std::string& name) {
  if (name == "auto") {
    active_isa().store(best_isa());
    return;
  }
  for (const Isa isa : {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAvx512Amx}) {
    if (name != isa_name(isa)) continue;
    const auto names = available_isas();
    TORCH_CHECK_VALUE(std::find(names.begin(), names.end(), name) != names.end(), "cbcore: this CPU or build has no ",
                      name, " kernels (available: ", c10::Join(", ", names), ")");
    active_isa().store(isa);
    return;
  }
  TORCH_CHECK_VALUE(false, "cbcore: unknown instruction set '", name,
                    "' (auto, generic, avx2, avx512, avx512_bf16, avx512_amx)");
}

}  // namespace cpu
}  // namespace cbcore
