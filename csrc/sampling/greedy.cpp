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
// The first NaN of the row (there is one: the vector pass saw it).
int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return 0;
}

__attribute__((target("avx512f"))) int64_t row_argmax_avx512(const float* x, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = neg_inf, m1 = neg_inf;
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    nan |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);  // true where either is NaN
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
  }
  for (; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 a = _mm512_mask_loadu_ps(neg_inf, k, x + i);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(m0, a);
  }
  if (nan) return first_nan(x, n);
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(m0, m1)));
  for (i = 0; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), m, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (x[i] == _mm512_cvtss_f32(m)) return i;
  return 0;  // every element -inf: the first
}

__attribute__((target("avx2"))) int64_t row_argmax_avx2(const float* x, int64_t n) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m0 = neg_inf, m1 = neg_inf, nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
  }
  float best = -std::numeric_limits<float>::infinity();
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return first_nan(x, n);
    best = std::max(best, x[i]);
  }
  if (_mm256_movemask_ps(nan)) return first_nan(x, n);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  for (float v : lanes) best = std::max(best, v);
  const __m256 m = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), m, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (x[i] == best) return i;
  return 0;
}

#endif  // CBCORE_GREEDY_X86

// The lanes of the vector rows this CPU runs: 16 (AVX-512), 8 (AVX2), 0 (none: torch's argmax runs).
int vector_width() {
#if CBCORE_GREEDY_X86
  static const int width = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 16;
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
  if (!scores.device().is_cpu() || scores.scalar_type() != at::kFloat || scores.stride(1) != 1 || width == 0)
    return at::argmax(scores, 1);
#if CBCORE_GREEDY_X86
  const int64_t rows = scores.size(0), vocab = scores.size(1), stride = scores.stride(0);
  at::Tensor tokens = at::empty({rows}, scores.options().dtype(at::kLong));
  const float* x = scores.const_data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  // A thread's share at least 256K scores (1 MB): fewer cost more to hand out than they take to read.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / vocab);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      out[r] = width == 16 ? row_argmax_avx512(x + r * stride, vocab) : row_argmax_avx2(x + r * stride, vocab);
  });
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
        "maximum), in vectors for contiguous float32 CPU rows on CPUs with AVX2 or AVX-512, else torch's argmax.");
}

}  // namespace cbcore
