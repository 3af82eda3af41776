// The token bitmask of structured output applied to a step's logits: for each listed row, every token whose bit is
// 0 gets -inf. xgrammar's CPU kernel tests every bit one at a time (~15 ms for 64 rows of a 49k vocabulary when the
// grammar allows few tokens, ~13% of a W1-shaped step); most 32-token words of a mask are all allowed or all not, so
// here a word of ones is skipped and a word of zeros is one vector fill, and only mixed words go bit by bit.
#include "sampling/token_bitmask.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace cbcore {
namespace {

template <typename T>
void mask_row(T* x, const int32_t* bits, int64_t vocab) {
  const T neg_inf = static_cast<T>(-std::numeric_limits<float>::infinity());
  const int64_t words = (vocab + 31) / 32;
  for (int64_t w = 0; w < words; ++w) {
    const uint32_t word = static_cast<uint32_t>(bits[w]);
    if (word == 0xFFFFFFFFu) continue;
    const int64_t start = w * 32, end = std::min(start + 32, vocab);
    if (word == 0) {
      std::fill(x + start, x + end, neg_inf);
      continue;
    }
    for (int64_t i = start; i < end; ++i)
      if (!((word >> (i - start)) & 1u)) x[i] = neg_inf;
  }
}

// logits [rows, vocab] (float32 or bfloat16, CPU, rows contiguous), bitmask [>= max(rows listed) + 1, >= vocab / 32]
// int32 (bit t of row r: token t allowed), rows: which logits rows to mask (each with the bitmask row of its index).
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const std::vector<int64_t>& rows) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.device().is_cpu() && logits.stride(1) == 1,
                    "cbcore apply_token_bitmask: logits must be [rows, vocab] on the CPU with contiguous rows");
  TORCH_CHECK_VALUE(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
                    "cbcore apply_token_bitmask: logits must be float32 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK_VALUE(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                        bitmask.device().is_cpu(),
                    "cbcore apply_token_bitmask: bitmask must be a contiguous [rows, words] int32 CPU tensor");
  const int64_t vocab = std::min<int64_t>(logits.size(1), bitmask.size(1) * 32);
  for (int64_t row : rows)
    TORCH_CHECK_VALUE(row >= 0 && row < logits.size(0) && row < bitmask.size(0),
                      "cbcore apply_token_bitmask: row ", row, " is outside the logits or the bitmask");
  const int64_t stride = logits.stride(0), words = bitmask.size(1);
  const int32_t* bits = bitmask.const_data_ptr<int32_t>();
  // A thread's share at least 256K logits: fewer cost more to hand out than they take to write.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(vocab, 1));
  auto run = [&](auto* x) {
    at::parallel_for(0, static_cast<int64_t>(rows.size()), grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) mask_row(x + rows[i] * stride, bits + rows[i] * words, vocab);
    });
  };
  if (logits.scalar_type() == at::kFloat) {
    run(logits.mutable_data_ptr<float>());
  } else {
    run(logits.mutable_data_ptr<at::BFloat16>());
  }
}

}  // namespace

void register_token_bitmask_bindings(pybind11::module_& m) {
  m.def("apply_token_bitmask", &apply_token_bitmask, pybind11::arg("logits"), pybind11::arg("bitmask"),
        pybind11::arg("rows"), pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Set to -inf, in place, the logits of listed rows whose bit in the int32 bitmask (row r of the bitmask for "
        "row r of the logits, bit t for token t) is 0: structured output's mask.");
}

}  // namespace cbcore
