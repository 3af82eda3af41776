// Greedy decoding picks, per row of the scores, the index of the first maximum: torch.argmax's answer (a NaN counts
// as the maximum, the first NaN wins). torch's CPU argmax carries an index through a scalar reduction: for 16 rows
// of a 49k vocabulary it took ~0.4 ms of a ~40 ms decode step, where a vector max takes ~0.03 ms. Here each row is
// read twice, both times in vectors: its maximum (noting NaNs), then the first position holding it (the row is in
// L2 by then). Rows run in parallel when there are enough of them.
#include "sampling/greedy.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

// The vector rows are x86-64 only (GCC or Clang target attributes); elsewhere torch's argmax runs.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CBCORE_GREEDY_X86 1
#include <immintrin.h>
#else
#define CBCORE_GREEDY_X86 0
#endif

namespace cbcore {
namespace {

#if CBCORE_GREEDY_X86
// A score as fp32: bf16 widens exactly (its bits are an fp32's upper half), so the argmax is the same as over the
// widened row, which a bf16 model's logits no longer need to be copied into (~40-70 us of a W3 bf16 step).
inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

// The first NaN of the row (there is one: the vector pass saw it).
template <typename T>
int64_t first_nan(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(widen(x[i]))) return i;
  return 0;
}

// 16 scores from x as fp32 (k: the lanes loaded; the others -inf).
__attribute__((target("avx512f"))) inline __m512 load16(const float* x, __mmask16 k, __m512 fill) {
  return _mm512_mask_loadu_ps(fill, k, x);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const at::BFloat16* x, __mmask16 k,
                                                                          __m512 fill) {
  const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, x)), 16);
  return _mm512_mask_mov_ps(fill, k, _mm512_castsi512_ps(wide));
}
__attribute__((target("avx2"))) inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
__attribute__((target("avx2"))) inline __m256 load8(const at::BFloat16* x) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) int64_t row_argmax_avx512(const T* x, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = neg_inf, m1 = neg_inf;
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = load16(x + i, 0xFFFF, neg_inf), b = load16(x + i + 16, 0xFFFF, neg_inf);
    nan |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);  // true where either is NaN
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
  }
  for (; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 a = load16(x + i, k, neg_inf);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(m0, a);
  }
  if (nan) return first_nan(x, n);
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(m0, m1)));
  for (i = 0; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load16(x + i, 0xFFFF, m), m, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (widen(x[i]) == _mm512_cvtss_f32(m)) return i;
  return 0;  // every element -inf: the first
}

template <typename T>
__attribute__((target("avx2"))) int64_t row_argmax_avx2(const T* x, int64_t n) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m0 = neg_inf, m1 = neg_inf, nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = load8(x + i), b = load8(x + i + 8);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
  }
  float best = -std::numeric_limits<float>::infinity();
  for (; i < n; ++i) {
    if (std::isnan(widen(x[i]))) return first_nan(x, n);
    best = std::max(best, widen(x[i]));
  }
  if (_mm256_movemask_ps(nan)) return first_nan(x, n);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  for (float v : lanes) best = std::max(best, v);
  const __m256 m = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + i), m, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (widen(x[i]) == best) return i;
  return 0;
}

#endif  // CBCORE_GREEDY_X86

// The lanes of the vector rows this CPU runs: 16 (AVX-512), 8 (AVX2), 0 (none: torch's argmax runs).
int vector_width() {
#if CBCORE_GREEDY_X86
  static const int width = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
      return 16;
    if (__builtin_cpu_supports("avx2")) return 8;
    return 0;
  }();
  return width;
#else
  return 0;
#endif
}

// [rows, vocab] scores -> [rows] int64 token ids, torch.argmax(scores, dim=-1)'s answer. isa: "auto" (the widest
// this CPU runs), or "avx2" / "avx512" forced (tests run both; ValueError where the CPU lacks it).
at::Tensor greedy_tokens(const at::Tensor& scores, const std::string& isa) {
  TORCH_CHECK_VALUE(scores.dim() == 2 && scores.size(1) > 0, "cbcore greedy_tokens: scores must be [rows, vocab] "
                    "with vocab > 0, got ", scores.sizes());
  int width = vector_width();
  if (isa != "auto") {
    const int wanted = isa == "avx512" ? 16 : isa == "avx2" ? 8 : -1;
    TORCH_CHECK_VALUE(wanted > 0, "cbcore greedy_tokens: isa must be auto, avx2 or avx512, got '", isa, "'");
    TORCH_CHECK_VALUE(wanted <= width, "cbcore greedy_tokens: this CPU has no ", isa);
    width = wanted;
  }
  const bool vector_dtype = scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kBFloat16;
  if (!scores.device().is_cpu() || !vector_dtype || scores.stride(1) != 1 || width == 0) return at::argmax(scores, 1);
#if CBCORE_GREEDY_X86
  const int64_t rows = scores.size(0), vocab = scores.size(1), stride = scores.stride(0);
  at::Tensor tokens = at::empty({rows}, scores.options().dtype(at::kLong));
  int64_t* out = tokens.data_ptr<int64_t>();
  // A thread's share at least 256K scores: fewer cost more to hand out than they take to read.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / vocab);
  auto run = [&](const auto* x) {
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        out[r] = width == 16 ? row_argmax_avx512(x + r * stride, vocab) : row_argmax_avx2(x + r * stride, vocab);
    });
  };
  if (scores.scalar_type() == at::kFloat) {
    run(scores.const_data_ptr<float>());
  } else {
    run(scores.const_data_ptr<at::BFloat16>());
  }
  return tokens;
#else
  return at::argmax(scores, 1);  // not reached: width is 0 here
#endif
}

}  // namespace

void register_greedy_bindings(pybind11::module_& m) {
  m.def("greedy_tokens", &greedy_tokens, pybind11::arg("scores"), pybind11::arg("isa") = "auto",
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "torch.argmax(scores, dim=-1) for [rows, vocab] scores (the first maximum of each row; a NaN counts as the "
        "maximum), in vectors for contiguous float32 or bfloat16 CPU rows on CPUs with AVX2 or AVX-512, else torch's "
        "argmax.");
}

}  // namespace cbcore
