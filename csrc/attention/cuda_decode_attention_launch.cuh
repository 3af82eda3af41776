// Launch of the decode kernels for one element type; each cuda_decode_attention_<dtype>.cu instantiates it, so the
// three element types compile in parallel. No torch headers: nvcc parses this once per GPU architecture.
#pragma once

#include <cuda_runtime.h>

#include "attention/cuda_decode_attention.cuh"

namespace cbcore {
namespace cuda {

template <typename T, int D, int DV>
cudaError_t launch_decode_split(const DecodeParams& p, int gpad, dim3 grid, int smem_bytes, cudaStream_t stream) {
  constexpr int kThreads = kDecodeWarps * 32;
  switch (gpad) {
    case 1: decode_split_kernel<T, D, DV, 1><<<grid, kThreads, smem_bytes, stream>>>(p); break;
    case 2: decode_split_kernel<T, D, DV, 2><<<grid, kThreads, smem_bytes, stream>>>(p); break;
    case 4: decode_split_kernel<T, D, DV, 4><<<grid, kThreads, smem_bytes, stream>>>(p); break;
    case 8: decode_split_kernel<T, D, DV, 8><<<grid, kThreads, smem_bytes, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_decode_attention(const DecodeParams& p, int head_dim, int v_head_dim, int gpad, dim3 grid,
                                    int smem_bytes, cudaStream_t stream) {
  if (!decode_head_dims_supported(head_dim, v_head_dim)) return cudaErrorInvalidValue;
  cudaError_t status;
  switch (head_dim) {
    case 64: status = launch_decode_split<T, 64, 64>(p, gpad, grid, smem_bytes, stream); break;
    case 128: status = launch_decode_split<T, 128, 128>(p, gpad, grid, smem_bytes, stream); break;
    case 192: status = launch_decode_split<T, 192, 128>(p, gpad, grid, smem_bytes, stream); break;
    case 256: status = launch_decode_split<T, 256, 256>(p, gpad, grid, smem_bytes, stream); break;
    default: return cudaErrorInvalidValue;
  }
  if (status != cudaSuccess || p.max_splits <= 1) return status;
  decode_merge_kernel<T><<<dim3(p.num_heads, grid.y), kMergeThreads, 0, stream>>>(p, v_head_dim);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace cbcore
