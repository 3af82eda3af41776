// Decode attention kernels for __nv_bfloat16 (see cuda_decode_attention.cuh).
#include "attention/cuda_decode_attention_launch.cuh"

namespace cbcore {
namespace cuda {

cudaError_t launch_decode_attention_bf16(const DecodeParams& p, int head_dim, int v_head_dim, int gpad, dim3 grid,
                                         int smem_bytes, cudaStream_t stream) {
  return launch_decode_attention<__nv_bfloat16>(p, head_dim, v_head_dim, gpad, grid, smem_bytes, stream);
}

}  // namespace cuda
}  // namespace cbcore
