// The kernel of the CUDA swap copies: every block of every tensor in one launch (host side: cuda_copy_blocks.cpp).
#include "swap/cuda_copy_blocks.h"

namespace cbcore {
namespace cuda {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;

template <typename Unit>
__global__ void __launch_bounds__(kCopyThreads)
    copy_blocks_kernel(const int64_t* __restrict__ table, const int64_t* __restrict__ src_ids,
                       const int64_t* __restrict__ dst_ids, int64_t units_per_block) {
  const int64_t pair = blockIdx.x;
  const int t = blockIdx.y;
  const Unit* src = reinterpret_cast<const Unit*>(table[2 * t]) + src_ids[pair] * units_per_block;
  Unit* dst = reinterpret_cast<Unit*>(table[2 * t + 1]) + dst_ids[pair] * units_per_block;
  constexpr int64_t kStride = static_cast<int64_t>(kCopyThreads) * kCopyUnroll;
  int64_t i = threadIdx.x;
  for (; i + (kCopyUnroll - 1) * kCopyThreads < units_per_block; i += kStride) {
    Unit v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) v[u] = src[i + u * kCopyThreads];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) dst[i + u * kCopyThreads] = v[u];
  }
  for (; i < units_per_block; i += kCopyThreads) dst[i] = src[i];
}

}  // namespace

cudaError_t launch_copy_blocks(const int64_t* table, const int64_t* src_ids, const int64_t* dst_ids,
                               int64_t num_pairs, int64_t num_tensors, int64_t block_bytes, bool vec16,
                               cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(num_tensors));
  if (vec16) {
    copy_blocks_kernel<uint4><<<grid, kCopyThreads, 0, stream>>>(table, src_ids, dst_ids, block_bytes / 16);
  } else {
    copy_blocks_kernel<uint8_t><<<grid, kCopyThreads, 0, stream>>>(table, src_ids, dst_ids, block_bytes);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace cbcore
