// A matmul for few rows (a decode step's linear layers): x[M, K] @ W[N, K].T (+ b) with W packed once into column
// panels, in AVX-512 (bf16 with AVX512-BF16's vdpbf16ps) or AVX2 + FMA. csrc/linear/skinny_gemm.cpp says why and
// how.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace cbcore {
namespace skinny {

// Whether this CPU (and this build) runs the skinny matmul for weights of `dtype`: float32 or bfloat16 on a CPU
// with AVX2 and FMA at least. False for every other dtype.
bool available(at::ScalarType dtype);

// Whether this CPU runs AVX-512 on two full 512-bit FMA units a core (a Xeon with AMX; AMD's desktop and server
// Zen 5), rather than splitting a 512-bit FMA in two (Zen 4, mobile Zen 5) or having no AVX-512: oneDNN's larger
// register tiles then beat the skinny matmul's on many rows in fp32 too (cbcore/linear.py, linear_backends).
bool full_width_avx512();

// The instruction set a call for `dtype` runs now: "amx" (bfloat16: AMX's bf16 tiles where K is a multiple of 32,
// AVX-512's otherwise), "avx512" (float32: AVX-512F/BW/VL/DQ; bfloat16: and AVX512-BF16), "avx2" (AVX2 and FMA),
// or "none".
std::string isa(at::ScalarType dtype);

// "avx512": AVX-512's tiles from now on, even where AMX's would run; "avx2": AVX2's, even where AVX-512's would;
// "auto": the best this CPU has. ValueError for another name or a CPU without the set. Packed weights serve every
// set (one layout).
void set_isa(const std::string& name);

// The panels of `weight` [N, K] (float32 or bfloat16, on the CPU): see skinny_gemm.cpp for the layout.
at::Tensor pack(const at::Tensor& weight);

// x [M, K] (rows contiguous in K, any row stride) @ W.T (+ bias [N]) into a new [M, N] tensor of x's dtype, where
// `panels` = pack(W) and W had `out_features` = N rows. Only where available(x's dtype).
at::Tensor matmul(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                  const std::optional<at::Tensor>& bias);

}  // namespace skinny
}  // namespace cbcore
