// The stateful layers' ops on the CPU (the contract and the references: cbcore/ops/state_ops.py).
//
// This file checks arguments, splits the work into items, and dispatches on dtype and instruction set; the kernels
// are in state_ops_kernels.inc, compiled here once per instruction set. States live in pools [num_slots, ...]; each
// request names its slot, and every slot is read and written by that request's items alone (a slot listed twice is
// refused: its writes would race).
//
// Work items: the conv runs one item per (request, block of kConvBlock channels), all of the request's tokens in
// order; the delta rule one per (request, value head, block of value columns), the state's columns being independent
// of one another; Mamba-2 one per (request, head, block of kSsdRows rows of the head's state), and Mamba-1 one per
// (request, block of kSelectiveBlock channels), each row or channel being its own recurrence. Items are taken from a
// shared counter, longest requests first.
#include "state_ops/state_ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/softplus.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if !defined(__GNUC__)
#error "cbcore's state-op kernels use GCC/Clang vector extensions; build with GCC or Clang"
#endif

// The AVX2 and AVX-512 copies need GCC's `#pragma GCC target` on x86-64 (Clang builds get the generic copy only).
#if defined(__x86_64__) && !defined(__clang__)
#define CBCORE_STATE_OPS_X86 1
#else
#define CBCORE_STATE_OPS_X86 0
#endif

// Functions of one copy pass its vectors by value only when inlined (see the .inc); the note on the ABI of AVX
// arguments in the generic copy concerns no real call.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace cbcore {
namespace state_ops {
namespace {

// Channels per conv item: a block's rows (1 KiB of fp32) keep the ring of `width` inputs in L1, and a decode step of
// C = 6144 channels still splits into 24 items per request. (64 was slower: each token's run of x was then one
// 256-byte piece of a row.)
constexpr int64_t kConvBlock = 256;
// How many tokens ahead a conv item prefetches its rows of x.
constexpr int64_t kConvPrefetchTokens = 4;

struct ConvParams {
  const void* x;  // [tokens, channels], channels contiguous
  int64_t x_row_stride;
  void* state;  // [num_slots, channels, width] contiguous
  int64_t state_slot_stride;
  const float* taps;  // [width, taps_row_stride]: the weight transposed, zero-padded to whole channel blocks
  int64_t taps_row_stride;
  const float* bias;  // [taps_row_stride], zeros without a bias
  const int64_t* slots;
  const int64_t* cu_seqlens;      // [requests + 1]; nullptr: one token per request
  const bool* has_initial_state;  // [requests]; nullptr: every request continues its state
  void* out;                      // [tokens, channels] contiguous
  int64_t channels, width;
  bool silu;
};

struct ConvItem {
  int64_t request, c0, n;
};

enum class ColumnBlock { kWide, kOne, kScalar };

struct DeltaParams {
  const void* q;  // [tokens, key_heads, dk], last dim contiguous
  const void* k;
  const void* v;  // [tokens, heads, dv], last dim contiguous
  int64_t q_token_stride, q_head_stride, k_token_stride, k_head_stride, v_token_stride, v_head_stride;
  const float* g;     // [tokens, heads] contiguous fp32
  const float* beta;  // [tokens, heads] contiguous fp32
  float* state;       // [num_slots, heads, dk, dv] contiguous
  int64_t state_slot_stride;
  const int64_t* slots;
  const int64_t* cu_seqlens;      // nullptr: one token per request
  const bool* has_initial_state;  // nullptr: every request continues its state
  void* out;                      // [tokens, heads, dv] contiguous
  int64_t heads, group, dk, dv;   // group: value heads per key head
  bool l2norm;
  float scale;
};

struct DeltaItem {
  int64_t request, head, col0;
  ColumnBlock kind;
};

// Rows of a Mamba-2 head per item: 32 rows of a 128-wide state are 16 KiB, L1-resident across a request's tokens.
constexpr int64_t kSsdRows = 32;
// Channels per Mamba-1 item: 64 channels of a 16-wide state (4 KiB) and their A rows stay in L1.
constexpr int64_t kSelectiveBlock = 64;

struct SsdParams {
  const void* x;  // [tokens, heads, head_dim], last dim contiguous
  int64_t x_token_stride, x_head_stride;
  const float* dt;  // [tokens, heads] contiguous fp32: biased, softplussed and clamped already
  const float* A;   // [heads]
  const void* B;    // [tokens, groups, state_size], last dim contiguous
  const void* C;
  int64_t b_token_stride, b_group_stride, c_token_stride, c_group_stride;
  const float* D;  // [heads]; nullptr: no skip
  const void* z;   // [tokens, heads, head_dim], last dim contiguous; nullptr: no gate
  int64_t z_token_stride, z_head_stride;
  float* state;  // [num_slots, heads, head_dim, state_size] contiguous
  int64_t state_slot_stride;
  const int64_t* slots;
  const int64_t* cu_seqlens;      // nullptr: one token per request
  const bool* has_initial_state;  // nullptr: every request continues its state
  void* out;                      // [tokens, heads, head_dim] contiguous
  int64_t heads, head_dim, state_size, heads_per_group;
  bool update;        // the update's arithmetic and output in x's dtype; else the scan's, output in fp32
  bool d_in_x_dtype;  // D has x's dtype (transformers' x D is then computed in it)
};

struct SsdItem {
  int64_t request, head, row0, rows;
};

struct SelectiveParams {
  const void* x;  // [tokens, channels], channels contiguous
  int64_t x_token_stride;
  const float* dt;  // [tokens, channels] contiguous fp32: biased and softplussed already
  const float* A;   // [channels, state_size] contiguous
  const void* B;    // [tokens, state_size], last dim contiguous
  const void* C;
  int64_t b_token_stride, c_token_stride;
  const float* D;  // [channels]; nullptr: no skip
  const void* z;   // [tokens, channels], channels contiguous; nullptr: no gate
  int64_t z_token_stride;
  float* state;  // [num_slots, channels, state_size] contiguous
  int64_t state_slot_stride;
  const int64_t* slots;
  const int64_t* cu_seqlens;      // nullptr: one token per request
  const bool* has_initial_state;  // nullptr: every request continues its state
  void* out;                      // [tokens, channels] contiguous
  int64_t channels, state_size;
  bool float_output;  // out is fp32 (else x's dtype)
  bool d_in_x_dtype;  // D has x's dtype (transformers' x D is then computed in it)
};

struct SelectiveItem {
  int64_t request, c0, n;
};

// Below this much work (cost units: one multiply-add) per thread, a call stays on fewer threads: waking the pool
// costs more than it saves.
constexpr int64_t kMinCostPerThread = 1 << 15;

// Runs work(i, scratch) for every item i, taken in order from a shared counter by up to at::get_num_threads() threads
// (dynamic scheduling: requests are ragged). Each thread has one scratch buffer of scratch_floats floats.
template <typename F>
void run_items(int64_t num_items, int64_t total_cost, int64_t scratch_floats, const F& work) {
  if (num_items == 0) return;
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>({at::get_num_threads(), num_items, total_cost / kMinCostPerThread}));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(static_cast<size_t>(scratch_floats));
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) work(i, scratch.data());
  });
}

namespace generic {
#define CB_STATE_LANES 4
#include "state_ops/state_ops_kernels.inc"
#undef CB_STATE_LANES
}  // namespace generic

#if CBCORE_STATE_OPS_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define CB_STATE_LANES 8
#include "state_ops/state_ops_kernels.inc"
#undef CB_STATE_LANES
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
#define CB_STATE_LANES 16
#include "state_ops/state_ops_kernels.inc"
#undef CB_STATE_LANES
}  // namespace avx512
#pragma GCC pop_options
#endif

// ---- instruction set --------------------------------------------------------------------------------------------

enum class Isa { kGeneric, kAvx2, kAvx512 };

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

std::vector<Isa> runnable_isas() {
  std::vector<Isa> isas{Isa::kGeneric};
#if CBCORE_STATE_OPS_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2) isas.push_back(Isa::kAvx2);
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    isas.push_back(Isa::kAvx512);
#endif
  return isas;
}

std::atomic<Isa>& active_isa() {
  static std::atomic<Isa> isa{runnable_isas().back()};
  return isa;
}

// Runs NAME<T>(args...) of the active instruction set's copy.
#if CBCORE_STATE_OPS_X86
#define CB_RUN_ISA(NAME, T, ...)                               \
  do {                                                         \
    switch (active_isa().load()) {                             \
      case Isa::kAvx512: avx512::NAME<T>(__VA_ARGS__); break;  \
      case Isa::kAvx2: avx2::NAME<T>(__VA_ARGS__); break;      \
      default: generic::NAME<T>(__VA_ARGS__); break;           \
    }                                                          \
  } while (0)
#else
#define CB_RUN_ISA(NAME, T, ...) generic::NAME<T>(__VA_ARGS__)
#endif

// The columns of the delta rule's wide and one-vector blocks in the active copy.
std::pair<int64_t, int64_t> active_column_blocks() {
#if CBCORE_STATE_OPS_X86
  switch (active_isa().load()) {
    case Isa::kAvx512: return {avx512::wide_columns(), avx512::lanes()};
    case Isa::kAvx2: return {avx2::wide_columns(), avx2::lanes()};
    default: break;
  }
#endif
  return {generic::wide_columns(), generic::lanes()};
}

// ---- argument checks ----------------------------------------------------------------------------------------------

bool kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// slots: int64 [count], each in [0, num_slots), none twice (two requests writing one slot would race).
const int64_t* check_slots(const char* op, const at::Tensor& slots, int64_t count, int64_t num_slots) {
  TORCH_CHECK_VALUE(slots.device().is_cpu() && slots.dim() == 1 && slots.scalar_type() == at::kLong &&
                        slots.is_contiguous(),
                    "cbcore ", op, ": slots must be a contiguous 1-D int64 CPU tensor, got ", slots.sizes(), " ",
                    slots.scalar_type(), " on ", slots.device());
  TORCH_CHECK_VALUE(slots.size(0) == count, "cbcore ", op, ": slots has ", slots.size(0), " entries for ", count,
                    " requests");
  const int64_t* ids = slots.const_data_ptr<int64_t>();
  std::vector<char> seen(static_cast<size_t>(num_slots), 0);
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK_VALUE(ids[i] >= 0 && ids[i] < num_slots, "cbcore ", op, ": slots[", i, "] is ", ids[i],
                      ", outside the state pool's [0, ", num_slots, ")");
    TORCH_CHECK_VALUE(!seen[ids[i]], "cbcore ", op, ": slots lists slot ", ids[i],
                      " twice; each request needs a slot of its own");
    seen[ids[i]] = 1;
  }
  return ids;
}

// cu_seqlens: int32/int64 [requests + 1], from 0 to num_tokens, never decreasing. Returned as int64.
std::vector<int64_t> check_cu_seqlens(const char* op, const at::Tensor& cu_seqlens, int64_t num_tokens) {
  TORCH_CHECK_VALUE(cu_seqlens.device().is_cpu() && cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1 &&
                        (cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong),
                    "cbcore ", op, ": cu_seqlens must be a 1-D int32 or int64 CPU tensor [requests + 1], got ",
                    cu_seqlens.sizes(), " ", cu_seqlens.scalar_type(), " on ", cu_seqlens.device());
  const at::Tensor cu = cu_seqlens.to(at::kLong).contiguous();
  const int64_t* p = cu.const_data_ptr<int64_t>();
  std::vector<int64_t> out(p, p + cu.size(0));
  TORCH_CHECK_VALUE(out.front() == 0 && out.back() == num_tokens, "cbcore ", op, ": cu_seqlens must run from 0 to ",
                    num_tokens, " (the packed tokens), got ", out.front(), " ... ", out.back());
  for (size_t i = 1; i < out.size(); ++i)
    TORCH_CHECK_VALUE(out[i] >= out[i - 1], "cbcore ", op, ": cu_seqlens decreases at ", i, " (", out[i - 1],
                      " then ", out[i], ")");
  return out;
}

const bool* check_has_initial_state(const char* op, const at::Tensor& has_initial_state, int64_t count) {
  TORCH_CHECK_VALUE(has_initial_state.device().is_cpu() && has_initial_state.dim() == 1 &&
                        has_initial_state.size(0) == count && has_initial_state.scalar_type() == at::kBool &&
                        has_initial_state.is_contiguous(),
                    "cbcore ", op, ": has_initial_state must be a contiguous bool CPU tensor [requests=", count,
                    "], got ", has_initial_state.sizes(), " ", has_initial_state.scalar_type());
  return has_initial_state.const_data_ptr<bool>();
}

bool check_activation(const char* op, const std::optional<std::string>& activation) {
  if (!activation.has_value()) return false;
  // transformers' ACT2FN maps both names to SiLU.
  TORCH_CHECK_VALUE(*activation == "silu" || *activation == "swish", "cbcore ", op, ": activation must be 'silu' or ",
                    "None, got '", *activation, "'");
  return true;
}

// Requests longest first, so that the last items to finish are short ones.
std::vector<int64_t> longest_first(const std::vector<int64_t>& cu, int64_t requests) {
  std::vector<int64_t> order(static_cast<size_t>(requests));
  std::iota(order.begin(), order.end(), 0);
  if (!cu.empty())
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return cu[a + 1] - cu[a] > cu[b + 1] - cu[b]; });
  return order;
}

// ---- causal conv1d --------------------------------------------------------------------------------------------------

// Shared by both conv ops: cu_seqlens / has_initial_state absent means one token per request, each continuing its
// state (the decode step).
at::Tensor conv(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& cu_seqlens,
                at::Tensor& conv_state, const at::Tensor& slots, const std::optional<at::Tensor>& has_initial_state,
                const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                const std::optional<std::string>& activation) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "cbcore ", op,
                    ": x must be a CPU tensor [tokens, channels] with contiguous channels, got ", x.sizes(),
                    " strides ", x.strides(), " on ", x.device());
  TORCH_CHECK_VALUE(kernel_dtype(x.scalar_type()), "cbcore ", op, ": x is ", x.scalar_type(),
                    " (supported: float32, bfloat16)");
  const int64_t tokens = x.size(0), channels = x.size(1);
  TORCH_CHECK_VALUE(conv_state.device().is_cpu() && conv_state.dim() == 3 && conv_state.size(1) == channels &&
                        conv_state.is_contiguous() && conv_state.scalar_type() == x.scalar_type(),
                    "cbcore ", op, ": conv_state must be a contiguous ", x.scalar_type(), " CPU tensor [num_slots, ",
                    channels, ", width], got ", conv_state.sizes(), " ", conv_state.scalar_type());
  const int64_t width = conv_state.size(2);
  TORCH_CHECK_VALUE(weight.device().is_cpu() && weight.dim() == 2 && weight.size(0) == channels &&
                        weight.size(1) == width && weight.scalar_type() == x.scalar_type(),
                    "cbcore ", op, ": weight must be a ", x.scalar_type(), " CPU tensor [", channels, ", ", width,
                    "] (channels, the conv state's width), got ", weight.sizes(), " ", weight.scalar_type());
  TORCH_CHECK_VALUE(width >= 1, "cbcore ", op, ": the conv state's width (its last dim) must be at least 1");
  if (bias.has_value())
    TORCH_CHECK_VALUE(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == channels &&
                          bias->scalar_type() == x.scalar_type(),
                      "cbcore ", op, ": bias must be None or a ", x.scalar_type(), " CPU tensor [", channels,
                      "], got ", bias->sizes(), " ", bias->scalar_type());
  const bool silu = check_activation(op, activation);

  std::vector<int64_t> cu;
  int64_t requests = tokens;
  const bool* has_initial = nullptr;
  if (cu_seqlens.has_value()) {
    cu = check_cu_seqlens(op, *cu_seqlens, tokens);
    requests = static_cast<int64_t>(cu.size()) - 1;
    has_initial = check_has_initial_state(op, *has_initial_state, requests);
  }
  const int64_t* slot_ids = check_slots(op, slots, requests, conv_state.size(0));

  // The weight tap-major in fp32 (each tap a contiguous row over the channels) and the bias, both padded with zeros
  // to whole channel blocks: made once per call, read by every request.
  const int64_t padded_channels = (channels + kConvBlock - 1) / kConvBlock * kConvBlock;
  const at::TensorOptions fp32 = x.options().dtype(at::kFloat);
  at::Tensor taps = at::zeros({width, padded_channels}, fp32);
  taps.narrow(1, 0, channels).copy_(weight.t());
  at::Tensor bias32 = at::zeros({padded_channels}, fp32);
  if (bias.has_value()) bias32.narrow(0, 0, channels).copy_(*bias);
  at::Tensor out = at::empty({tokens, channels}, x.options());
  ConvParams p{x.const_data_ptr(), x.stride(0), conv_state.data_ptr(), conv_state.stride(0),
               taps.const_data_ptr<float>(), padded_channels, bias32.const_data_ptr<float>(), slot_ids,
               cu.empty() ? nullptr : cu.data(), has_initial, out.data_ptr(), channels, width, silu};

  std::vector<ConvItem> items;
  int64_t total_cost = 0;
  for (const int64_t r : longest_first(cu, requests)) {
    const int64_t length = cu.empty() ? 1 : cu[r + 1] - cu[r];
    for (int64_t c0 = 0; c0 < channels; c0 += kConvBlock) {
      const int64_t n = std::min(kConvBlock, channels - c0);
      items.push_back({r, c0, n});
      total_cost += (length + 2) * width * n;
    }
  }
  if (x.scalar_type() == at::kFloat) {
    CB_RUN_ISA(run_conv, float, p, items, total_cost);
  } else {
    CB_RUN_ISA(run_conv, c10::BFloat16, p, items, total_cost);
  }
  return out;
}

at::Tensor causal_conv1d_update(const at::Tensor& x, at::Tensor& conv_state, const at::Tensor& slots,
                                const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                const std::optional<std::string>& activation) {
  return conv("causal_conv1d_update", x, std::nullopt, conv_state, slots, std::nullopt, weight, bias, activation);
}

at::Tensor causal_conv1d_varlen(const at::Tensor& x, const at::Tensor& cu_seqlens, at::Tensor& conv_state,
                                const at::Tensor& slots, const at::Tensor& has_initial_state, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, const std::optional<std::string>& activation) {
  return conv("causal_conv1d_varlen", x, cu_seqlens, conv_state, slots, has_initial_state, weight, bias, activation);
}

// ---- gated delta rule -----------------------------------------------------------------------------------------------

// g / beta: [tokens, heads] of any floating dtype (Qwen3-Next computes g in fp32 and beta in the model's dtype),
// read as contiguous fp32.
at::Tensor gate_as_float(const char* op, const char* name, const at::Tensor& t, int64_t tokens, int64_t heads) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.dim() == 2 && t.size(0) == tokens && t.size(1) == heads &&
                        at::isFloatingType(t.scalar_type()),
                    "cbcore ", op, ": ", name, " must be a floating-point CPU tensor [", tokens, ", ", heads,
                    "] (tokens, value heads), got ", t.sizes(), " ", t.scalar_type());
  return t.to(at::kFloat).contiguous();
}

at::Tensor delta_rule(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, const std::optional<at::Tensor>& cu_seqlens,
                      at::Tensor& state, const at::Tensor& slots, const std::optional<at::Tensor>& has_initial_state,
                      bool use_qk_l2norm, double scale) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "cbcore ", op,
                    ": q, k and v must be CPU tensors");
  TORCH_CHECK_VALUE(q.dim() == 3 && k.sizes() == q.sizes(), "cbcore ", op,
                    ": q and k must be [tokens, key_heads, dk] of one shape, got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK_VALUE(v.dim() == 3 && v.size(0) == q.size(0), "cbcore ", op, ": v must be [tokens=", q.size(0),
                    ", heads, dv], got ", v.sizes());
  TORCH_CHECK_VALUE(kernel_dtype(q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
                        v.scalar_type() == q.scalar_type(),
                    "cbcore ", op, ": q, k and v must share one dtype, float32 or bfloat16; got ", q.scalar_type(),
                    ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK_VALUE(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "cbcore ", op,
                    ": the last dimension of q, k and v must be contiguous");
  const int64_t tokens = q.size(0), key_heads = q.size(1), dk = q.size(2), heads = v.size(1), dv = v.size(2);
  TORCH_CHECK_VALUE(key_heads >= 1 && heads % key_heads == 0, "cbcore ", op, ": ", heads,
                    " value heads are not a multiple of ", key_heads, " query/key heads");
  TORCH_CHECK_VALUE(state.device().is_cpu() && state.dim() == 4 && state.size(1) == heads && state.size(2) == dk &&
                        state.size(3) == dv && state.scalar_type() == at::kFloat && state.is_contiguous(),
                    "cbcore ", op, ": state must be a contiguous float32 CPU tensor [num_slots, ", heads, ", ", dk,
                    ", ", dv, "], got ", state.sizes(), " ", state.scalar_type());
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0.0, "cbcore ", op, ": scale must be a positive finite number, "
                    "got ", scale);
  const at::Tensor g32 = gate_as_float(op, "g", g, tokens, heads);
  const at::Tensor beta32 = gate_as_float(op, "beta", beta, tokens, heads);

  std::vector<int64_t> cu;
  int64_t requests = tokens;
  const bool* has_initial = nullptr;
  if (cu_seqlens.has_value()) {
    cu = check_cu_seqlens(op, *cu_seqlens, tokens);
    requests = static_cast<int64_t>(cu.size()) - 1;
    has_initial = check_has_initial_state(op, *has_initial_state, requests);
  }
  const int64_t* slot_ids = check_slots(op, slots, requests, state.size(0));

  at::Tensor out = at::empty({tokens, heads, dv}, v.options().memory_format(at::MemoryFormat::Contiguous));
  DeltaParams p{q.const_data_ptr(), k.const_data_ptr(), v.const_data_ptr(), q.stride(0), q.stride(1), k.stride(0),
                k.stride(1), v.stride(0), v.stride(1), g32.const_data_ptr<float>(), beta32.const_data_ptr<float>(),
                state.data_ptr<float>(), state.stride(0), slot_ids, cu.empty() ? nullptr : cu.data(), has_initial,
                out.data_ptr(), heads, heads / key_heads, dk, dv, use_qk_l2norm, static_cast<float>(scale)};

  // The value columns of a head: wide blocks, then one vector, then single columns.
  const auto [wide, lanes] = active_column_blocks();
  std::vector<std::pair<int64_t, ColumnBlock>> blocks;
  int64_t col = 0;
  for (; col + wide <= dv; col += wide) blocks.push_back({col, ColumnBlock::kWide});
  for (; col + lanes <= dv; col += lanes) blocks.push_back({col, ColumnBlock::kOne});
  for (; col < dv; ++col) blocks.push_back({col, ColumnBlock::kScalar});

  std::vector<DeltaItem> items;
  items.reserve(static_cast<size_t>(requests * heads) * blocks.size());
  int64_t total_cost = 0;
  for (const int64_t r : longest_first(cu, requests)) {
    const int64_t length = cu.empty() ? 1 : cu[r + 1] - cu[r];
    for (int64_t h = 0; h < heads; ++h) {
      for (const auto& [col0, kind] : blocks) items.push_back({r, h, col0, kind});
    }
    total_cost += (length + 1) * heads * dk * dv * 2;
  }
  if (q.scalar_type() == at::kFloat) {
    CB_RUN_ISA(run_delta, float, p, items, total_cost);
  } else {
    CB_RUN_ISA(run_delta, c10::BFloat16, p, items, total_cost);
  }
  return out;
}

at::Tensor gated_delta_rule_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                                      const at::Tensor& slots, bool use_qk_l2norm, double scale) {
  return delta_rule("gated_delta_rule_recurrent", q, k, v, g, beta, std::nullopt, state, slots, std::nullopt,
                    use_qk_l2norm, scale);
}

at::Tensor gated_delta_rule_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                   const at::Tensor& beta, const at::Tensor& cu_seqlens, at::Tensor& state,
                                   const at::Tensor& slots, const at::Tensor& has_initial_state, bool use_qk_l2norm,
                                   double scale) {
  return delta_rule("gated_delta_rule_varlen", q, k, v, g, beta, cu_seqlens, state, slots, has_initial_state,
                    use_qk_l2norm, scale);
}

// ---- Mamba's selective state spaces --------------------------------------------------------------------------------

// A per-head or per-channel parameter (A, D, dt_bias) of any floating dtype, read as contiguous fp32.
at::Tensor param_as_float(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                          const char* dims) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.sizes() == shape && at::isFloatingType(t.scalar_type()), "cbcore ", op,
                    ": ", name, " must be a floating-point CPU tensor ", shape, " (", dims, "), got ", t.sizes(), " ",
                    t.scalar_type(), " on ", t.device());
  return t.to(at::kFloat).contiguous();
}

// An input of x's dtype with the given sizes and a contiguous last dimension (B, C, z).
void check_like_x(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x, at::IntArrayRef shape,
                  const char* dims) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.sizes() == shape && t.scalar_type() == x.scalar_type() &&
                        t.stride(-1) == 1,
                    "cbcore ", op, ": ", name, " must be a ", x.scalar_type(), " CPU tensor ", shape, " (", dims,
                    ") with a contiguous last dimension, got ", t.sizes(), " ", t.scalar_type(), " strides ",
                    t.strides(), " on ", t.device());
}

// transformers' time step, with its own ops in dt's dtype (so that a bf16 dt is rounded where transformers rounds
// it): dt + dt_bias, softplus when asked, clamped to `limit` when given (Mamba-2's chunk scan clamps, the updates do
// not). Returned as contiguous fp32 [tokens, width].
at::Tensor time_step(const char* op, const at::Tensor& dt, int64_t tokens, int64_t width, const char* dims,
                     const std::optional<at::Tensor>& dt_bias, bool softplus,
                     std::optional<std::pair<double, double>> limit) {
  TORCH_CHECK_VALUE(dt.device().is_cpu() && dt.dim() == 2 && dt.size(0) == tokens && dt.size(1) == width &&
                        at::isFloatingType(dt.scalar_type()),
                    "cbcore ", op, ": dt must be a floating-point CPU tensor [", tokens, ", ", width, "] (", dims,
                    "), got ", dt.sizes(), " ", dt.scalar_type(), " on ", dt.device());
  at::Tensor step = dt;
  if (dt_bias.has_value()) {
    TORCH_CHECK_VALUE(dt_bias->device().is_cpu() && dt_bias->dim() == 1 && dt_bias->size(0) == width &&
                          at::isFloatingType(dt_bias->scalar_type()),
                      "cbcore ", op, ": dt_bias must be None or a floating-point CPU tensor [", width, "], got ",
                      dt_bias->sizes(), " ", dt_bias->scalar_type());
    step = step.add(dt_bias->to(step.scalar_type()));
  }
  if (softplus) step = at::softplus(step);
  if (limit.has_value())
    step = step.clamp(std::optional<at::Scalar>(limit->first), std::optional<at::Scalar>(limit->second));
  return step.to(at::kFloat).contiguous();
}

// state: a contiguous fp32 pool [num_slots, *inner] (dims names the inner dimensions).
void check_ssm_state(const char* op, const at::Tensor& state, const std::vector<int64_t>& inner, const char* dims) {
  std::string expected = "[num_slots";
  for (const int64_t size : inner) expected += ", " + std::to_string(size);
  TORCH_CHECK_VALUE(state.device().is_cpu() && state.dim() == static_cast<int64_t>(inner.size()) + 1 &&
                        state.sizes().slice(1) == at::IntArrayRef(inner) && state.scalar_type() == at::kFloat &&
                        state.is_contiguous(),
                    "cbcore ", op, ": state must be a contiguous float32 CPU tensor ", expected, "] (num_slots, ", dims,
                    "), got ", state.sizes(), " ", state.scalar_type(),
                    state.is_contiguous() ? "" : " (not contiguous)");
}

// Mamba-2 (state space duality): the update (one token per request, no cu_seqlens) and the varlen scan.
at::Tensor ssd(const char* op, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
               const at::Tensor& C, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& dt_bias,
               const std::optional<at::Tensor>& z, bool dt_softplus, std::optional<std::pair<double, double>> dt_limit,
               const std::optional<at::Tensor>& cu_seqlens, at::Tensor& state, const at::Tensor& slots,
               const std::optional<at::Tensor>& has_initial_state) {
  const bool update = !cu_seqlens.has_value();
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "cbcore ", op,
                    ": x must be a CPU tensor [tokens, heads, head_dim] with a contiguous last dimension, got ",
                    x.sizes(), " strides ", x.strides(), " on ", x.device());
  TORCH_CHECK_VALUE(kernel_dtype(x.scalar_type()), "cbcore ", op, ": x is ", x.scalar_type(),
                    " (supported: float32, bfloat16)");
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK_VALUE(B.dim() == 3 && B.size(0) == tokens && B.size(1) >= 1 && heads % B.size(1) == 0, "cbcore ", op,
                    ": B must be [tokens=", tokens, ", groups, state_size] with groups dividing the ", heads,
                    " heads, got ", B.sizes());
  const int64_t groups = B.size(1), state_size = B.size(2);
  check_like_x(op, "B", B, x, {tokens, groups, state_size}, "tokens, groups, state_size");
  check_like_x(op, "C", C, x, {tokens, groups, state_size}, "tokens, groups, state_size");
  if (z.has_value()) check_like_x(op, "z", *z, x, {tokens, heads, head_dim}, "tokens, heads, head_dim");
  const at::Tensor A32 = param_as_float(op, "A", A, {heads}, "heads");
  std::optional<at::Tensor> D32;
  if (D.has_value()) D32 = param_as_float(op, "D", *D, {heads}, "heads");
  const at::Tensor dt32 = time_step(op, dt, tokens, heads, "tokens, heads", dt_bias, dt_softplus, dt_limit);
  check_ssm_state(op, state, {heads, head_dim, state_size}, "heads, head_dim, state_size");

  std::vector<int64_t> cu;
  int64_t requests = tokens;
  const bool* has_initial = nullptr;
  if (!update) {
    cu = check_cu_seqlens(op, *cu_seqlens, tokens);
    requests = static_cast<int64_t>(cu.size()) - 1;
    has_initial = check_has_initial_state(op, *has_initial_state, requests);
  }
  const int64_t* slot_ids = check_slots(op, slots, requests, state.size(0));

  at::Tensor out = at::empty({tokens, heads, head_dim}, x.options().dtype(update ? x.scalar_type() : at::kFloat));
  SsdParams p{x.const_data_ptr(), x.stride(0), x.stride(1), dt32.const_data_ptr<float>(),
              A32.const_data_ptr<float>(), B.const_data_ptr(), C.const_data_ptr(), B.stride(0), B.stride(1),
              C.stride(0), C.stride(1), D32.has_value() ? D32->const_data_ptr<float>() : nullptr,
              z.has_value() ? z->const_data_ptr() : nullptr, z.has_value() ? z->stride(0) : 0,
              z.has_value() ? z->stride(1) : 0, state.data_ptr<float>(), state.stride(0), slot_ids,
              cu.empty() ? nullptr : cu.data(), has_initial, out.data_ptr(), heads, head_dim, state_size,
              heads / groups, update, D.has_value() && D->scalar_type() == x.scalar_type()};

  std::vector<SsdItem> items;
  int64_t total_cost = 0;
  for (const int64_t r : longest_first(cu, requests)) {
    const int64_t length = cu.empty() ? 1 : cu[r + 1] - cu[r];
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t row0 = 0; row0 < head_dim; row0 += kSsdRows)
        items.push_back({r, h, row0, std::min(kSsdRows, head_dim - row0)});
    total_cost += (length + 1) * heads * head_dim * state_size * 2;
  }
  if (x.scalar_type() == at::kFloat) {
    CB_RUN_ISA(run_ssd, float, p, items, total_cost);
  } else {
    CB_RUN_ISA(run_ssd, c10::BFloat16, p, items, total_cost);
  }
  return out;
}

at::Tensor mamba2_state_update(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                               const at::Tensor& C, const std::optional<at::Tensor>& D,
                               const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& z,
                               bool dt_softplus, at::Tensor& state, const at::Tensor& slots) {
  return ssd("mamba2_state_update", x, dt, A, B, C, D, dt_bias, z, dt_softplus, std::nullopt, std::nullopt, state,
             slots, std::nullopt);
}

at::Tensor mamba2_scan_varlen(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                              const at::Tensor& C, const std::optional<at::Tensor>& D,
                              const std::optional<at::Tensor>& dt_bias, bool dt_softplus, double dt_min,
                              double dt_max, const at::Tensor& cu_seqlens, at::Tensor& state, const at::Tensor& slots,
                              const at::Tensor& has_initial_state) {
  return ssd("mamba2_scan_varlen", x, dt, A, B, C, D, dt_bias, std::nullopt, dt_softplus,
             std::make_pair(dt_min, dt_max), cu_seqlens, state, slots, has_initial_state);
}

// Mamba-1: the update (one token per request, no cu_seqlens) and the varlen scan.
at::Tensor selective(const char* op, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                     const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
                     const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& z, bool dt_softplus,
                     const std::optional<at::Tensor>& cu_seqlens, at::Tensor& state, const at::Tensor& slots,
                     const std::optional<at::Tensor>& has_initial_state) {
  const bool update = !cu_seqlens.has_value();
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "cbcore ", op,
                    ": x must be a CPU tensor [tokens, channels] with contiguous channels, got ", x.sizes(),
                    " strides ", x.strides(), " on ", x.device());
  TORCH_CHECK_VALUE(kernel_dtype(x.scalar_type()), "cbcore ", op, ": x is ", x.scalar_type(),
                    " (supported: float32, bfloat16)");
  const int64_t tokens = x.size(0), channels = x.size(1);
  TORCH_CHECK_VALUE(A.dim() == 2 && A.size(0) == channels, "cbcore ", op, ": A must be [channels=", channels,
                    ", state_size], got ", A.sizes());
  const int64_t state_size = A.size(1);
  const at::Tensor A32 = param_as_float(op, "A", A, {channels, state_size}, "channels, state_size");
  check_like_x(op, "B", B, x, {tokens, state_size}, "tokens, state_size");
  check_like_x(op, "C", C, x, {tokens, state_size}, "tokens, state_size");
  if (z.has_value()) check_like_x(op, "z", *z, x, {tokens, channels}, "tokens, channels");
  std::optional<at::Tensor> D32;
  if (D.has_value()) D32 = param_as_float(op, "D", *D, {channels}, "channels");
  const at::Tensor dt32 = time_step(op, dt, tokens, channels, "tokens, channels", dt_bias, dt_softplus, std::nullopt);
  check_ssm_state(op, state, {channels, state_size}, "channels, state_size");
  // The update returns x's dtype; the scan what transformers' sum of the scan, the D skip and the gate comes to.
  at::ScalarType out_type = x.scalar_type();
  if (!update && D.has_value()) out_type = c10::promoteTypes(out_type, D->scalar_type());
  TORCH_CHECK_VALUE(kernel_dtype(out_type), "cbcore ", op, ": D is ", D.has_value() ? D->scalar_type() : out_type,
                    ", which makes the output ", out_type, " (supported: float32, bfloat16)");

  std::vector<int64_t> cu;
  int64_t requests = tokens;
  const bool* has_initial = nullptr;
  if (!update) {
    cu = check_cu_seqlens(op, *cu_seqlens, tokens);
    requests = static_cast<int64_t>(cu.size()) - 1;
    has_initial = check_has_initial_state(op, *has_initial_state, requests);
  }
  const int64_t* slot_ids = check_slots(op, slots, requests, state.size(0));

  at::Tensor out = at::empty({tokens, channels}, x.options().dtype(out_type));
  SelectiveParams p{x.const_data_ptr(), x.stride(0), dt32.const_data_ptr<float>(), A32.const_data_ptr<float>(),
                    B.const_data_ptr(), C.const_data_ptr(), B.stride(0), C.stride(0),
                    D32.has_value() ? D32->const_data_ptr<float>() : nullptr,
                    z.has_value() ? z->const_data_ptr() : nullptr, z.has_value() ? z->stride(0) : 0,
                    state.data_ptr<float>(), state.stride(0), slot_ids, cu.empty() ? nullptr : cu.data(), has_initial,
                    out.data_ptr(), channels, state_size, out_type == at::kFloat,
                    D.has_value() && D->scalar_type() == x.scalar_type()};

  std::vector<SelectiveItem> items;
  int64_t total_cost = 0;
  for (const int64_t r : longest_first(cu, requests)) {
    const int64_t length = cu.empty() ? 1 : cu[r + 1] - cu[r];
    for (int64_t c0 = 0; c0 < channels; c0 += kSelectiveBlock)
      items.push_back({r, c0, std::min(kSelectiveBlock, channels - c0)});
    // An exponential costs about ten multiply-adds.
    total_cost += (length + 1) * channels * state_size * 12;
  }
  if (x.scalar_type() == at::kFloat) {
    CB_RUN_ISA(run_selective, float, p, items, total_cost);
  } else {
    CB_RUN_ISA(run_selective, c10::BFloat16, p, items, total_cost);
  }
  return out;
}

at::Tensor mamba_state_update(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                              const at::Tensor& C, const std::optional<at::Tensor>& D,
                              const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& z,
                              bool dt_softplus, at::Tensor& state, const at::Tensor& slots) {
  return selective("mamba_state_update", x, dt, A, B, C, D, dt_bias, z, dt_softplus, std::nullopt, state, slots,
                   std::nullopt);
}

at::Tensor mamba_scan_varlen(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                             const at::Tensor& C, const std::optional<at::Tensor>& D,
                             const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& z,
                             bool dt_softplus, const at::Tensor& cu_seqlens, at::Tensor& state,
                             const at::Tensor& slots, const at::Tensor& has_initial_state) {
  return selective("mamba_scan_varlen", x, dt, A, B, C, D, dt_bias, z, dt_softplus, cu_seqlens, state, slots,
                   has_initial_state);
}

// ---- instruction-set selection ----------------------------------------------------------------------------------

std::string isa() { return isa_name(active_isa().load()); }

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (const Isa i : runnable_isas()) names.push_back(isa_name(i));
  return names;
}

void set_isa(const std::string& name) {
  const std::vector<Isa> runnable = runnable_isas();
  if (name == "auto") {
    active_isa().store(runnable.back());
    return;
  }
  for (const Isa i : runnable) {
    if (name == isa_name(i)) {
      active_isa().store(i);
      return;
    }
  }
  std::string names;
  for (const Isa i : runnable) names += std::string(names.empty() ? "" : ", ") + isa_name(i);
  TORCH_CHECK_VALUE(false, "cbcore state ops: instruction set '", name, "' is not available here (", names,
                    ", or auto)");
}

}  // namespace
}  // namespace state_ops

void register_state_ops_bindings(pybind11::module_& m) {
  namespace py = pybind11;
  using namespace state_ops;
  m.def("causal_conv1d_update", &causal_conv1d_update, py::arg("x"), py::arg("conv_state"), py::arg("slots"),
        py::arg("weight"), py::arg("bias"), py::arg("activation"), py::call_guard<py::gil_scoped_release>(),
        "One new token per request through a causal depthwise conv1d: x [batch, channels], conv_state [num_slots, "
        "channels, width] (updated in place), slots int64 [batch], weight [channels, width], bias [channels] or None, "
        "activation 'silu' or None. Returns [batch, channels]. float32 or bfloat16, all of one dtype.");
  m.def("causal_conv1d_varlen", &causal_conv1d_varlen, py::arg("x"), py::arg("cu_seqlens"), py::arg("conv_state"),
        py::arg("slots"), py::arg("has_initial_state"), py::arg("weight"), py::arg("bias"), py::arg("activation"),
        py::call_guard<py::gil_scoped_release>(),
        "Packed requests through a causal depthwise conv1d: x [tokens, channels], cu_seqlens [requests + 1]; request "
        "i's left context is its slot's state when has_initial_state[i], else zeros; its last width inputs are "
        "written back to the slot. Returns [tokens, channels].");
  m.def("gated_delta_rule_recurrent", &gated_delta_rule_recurrent, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("g"), py::arg("beta"), py::arg("state"), py::arg("slots"), py::arg("use_qk_l2norm"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>(),
        "One token per request of the gated delta rule: q, k [batch, key_heads, dk], v [batch, heads, dv], g and beta "
        "[batch, heads], state float32 [num_slots, heads, dk, dv] (updated in place). Returns [batch, heads, dv].");
  m.def("gated_delta_rule_varlen", &gated_delta_rule_varlen, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"),
        py::arg("beta"), py::arg("cu_seqlens"), py::arg("state"), py::arg("slots"), py::arg("has_initial_state"),
        py::arg("use_qk_l2norm"), py::arg("scale"), py::call_guard<py::gil_scoped_release>(),
        "Packed requests of the gated delta rule, token by token from each slot's state (zeros without "
        "has_initial_state), the final state written back. Returns [tokens, heads, dv].");
  m.def("mamba2_state_update", &mamba2_state_update, py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"),
        py::arg("C"), py::arg("D"), py::arg("dt_bias"), py::arg("z"), py::arg("dt_softplus"), py::arg("state"),
        py::arg("slots"), py::call_guard<py::gil_scoped_release>(),
        "One token per request of Mamba-2's selective state update: x [batch, heads, head_dim], dt [batch, heads], "
        "A [heads], B and C [batch, groups, state_size], D and dt_bias [heads] or None, z [batch, heads, head_dim] or "
        "None, state float32 [num_slots, heads, head_dim, state_size] (updated in place). Returns [batch, heads, "
        "head_dim] in x's dtype.");
  m.def("mamba2_scan_varlen", &mamba2_scan_varlen, py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"),
        py::arg("C"), py::arg("D"), py::arg("dt_bias"), py::arg("dt_softplus"), py::arg("dt_min"), py::arg("dt_max"),
        py::arg("cu_seqlens"), py::arg("state"), py::arg("slots"), py::arg("has_initial_state"),
        py::call_guard<py::gil_scoped_release>(),
        "Packed requests of Mamba-2's scan, token by token from each slot's state (zeros without has_initial_state), "
        "dt clamped to [dt_min, dt_max], the final state written back. Returns float32 [tokens, heads, head_dim].");
  m.def("mamba_state_update", &mamba_state_update, py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"),
        py::arg("C"), py::arg("D"), py::arg("dt_bias"), py::arg("z"), py::arg("dt_softplus"), py::arg("state"),
        py::arg("slots"), py::call_guard<py::gil_scoped_release>(),
        "One token per request of Mamba-1's selective state update: x, dt and z [batch, channels], A [channels, "
        "state_size], B and C [batch, state_size], D and dt_bias [channels] or None, state float32 [num_slots, "
        "channels, state_size] (updated in place). Returns [batch, channels] in x's dtype.");
  m.def("mamba_scan_varlen", &mamba_scan_varlen, py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"),
        py::arg("C"), py::arg("D"), py::arg("dt_bias"), py::arg("z"), py::arg("dt_softplus"), py::arg("cu_seqlens"),
        py::arg("state"), py::arg("slots"), py::arg("has_initial_state"), py::call_guard<py::gil_scoped_release>(),
        "Packed requests of Mamba-1's selective scan, from each slot's state (zeros without has_initial_state), the "
        "final state written back. Returns [tokens, channels] in x's dtype promoted with D's.");
  m.def("state_ops_isa", &state_ops::isa, "The instruction set the state-op kernels use: 'avx512', 'avx2' or 'generic'.");
  m.def("state_ops_isas", &available_isas,
        "The instruction sets this CPU and build can run the state-op kernels with, portable first.");
  m.def("_set_state_ops_isa", &set_isa, py::arg("name"),
        "Force one of state_ops_isas() (ValueError naming the available ones otherwise), or 'auto' (the best).");
}

}  // namespace cbcore
