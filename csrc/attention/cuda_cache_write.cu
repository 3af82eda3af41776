// Writing new K/V rows into their page slots on CUDA (the kernel of cache_write; the host side is in cuda_ops.cpp).
//
// Each CTA copies whole tokens (K and V rows of every kv head); a token's units are spread over the threads. A unit
// is one 16-byte load and store when the row size, strides and pointers allow it (always for fp16/bf16/fp32 with
// head_dim % 8 == 0 and 16-byte aligned inputs), else element-sized.
#include "attention/cuda_cache_write.h"

namespace cbcore {
namespace cuda {
namespace {

template <typename Unit>
__global__ void cache_write_kernel(const CacheWriteParams p) {
  // Tokens over CTAs, a token's units over the threads: no 64-bit division per unit.
  const int half = static_cast<int>(p.num_kv_heads * p.row_units);
  const int row_units = static_cast<int>(p.row_units);
  for (int64_t token = blockIdx.x; token < p.num_tokens; token += gridDim.x) {
    const int64_t slot = p.slots[token];
    if (slot < 0 || slot >= p.num_slots) continue;  // padding (negative) or out of range: skipped
    for (int r = threadIdx.x; r < 2 * half; r += blockDim.x) {
      const bool is_v = r >= half;
      const int rest = is_v ? r - half : r;
      const int head = rest / row_units;
      const int unit = rest - head * row_units;
      const Unit* src = reinterpret_cast<const Unit*>(is_v ? p.v : p.k) + token * (is_v ? p.v_stride_t : p.k_stride_t) +
                        head * (is_v ? p.v_stride_h : p.k_stride_h);
      Unit* dst = reinterpret_cast<Unit*>(is_v ? p.v_cache : p.k_cache);
      dst[(slot * p.num_kv_heads + head) * p.row_units + unit] = src[unit];
    }
  }
}

}  // namespace

cudaError_t launch_cache_write(const CacheWriteParams& p, int unit_bytes, int64_t num_ctas, int threads,
                               cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_ctas));
  switch (unit_bytes) {
    case 16: cache_write_kernel<uint4><<<grid, threads, 0, stream>>>(p); break;
    case 8: cache_write_kernel<uint2><<<grid, threads, 0, stream>>>(p); break;
    case 4: cache_write_kernel<uint32_t><<<grid, threads, 0, stream>>>(p); break;
    case 2: cache_write_kernel<uint16_t><<<grid, threads, 0, stream>>>(p); break;
    case 1: cache_write_kernel<uint8_t><<<grid, threads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace cbcore
