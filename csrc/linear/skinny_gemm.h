// A matmul for few rows (a decode step's linear layers): x[M, K] @ W[N, K].T (+ b) with W packed once into column
// panels, AVX-512 (fp32 FMA; bf16 with AVX512-BF16's vdpbf16ps). csrc/linear/skinny_gemm.cpp says why and how.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace cbcore {
namespace skinny {

// Whether this CPU (and this build) runs the skinny matmul for weights of `dtype` (float32: AVX-512F; bfloat16:
// AVX-512F and AVX512-BF16). False for every other dtype.
bool available(at::ScalarType dtype);

// The panels of `weight` [N, K] (float32 or bfloat16, on the CPU): see skinny_gemm.cpp for the layout.
at::Tensor pack(const at::Tensor& weight);

// x [M, K] (rows contiguous in K, any row stride) @ W.T (+ bias [N]) into a new [M, N] tensor of x's dtype, where
// `panels` = pack(W) and W had `out_features` = N rows. Only where available(x's dtype).
at::Tensor matmul(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                  const std::optional<at::Tensor>& bias);

}  // namespace skinny
}  // namespace cbcore
