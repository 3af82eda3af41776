// Small host helpers of the CUDA ops. Only c10/cuda and the CUDA runtime: ATen/cuda/CUDAContext.h would pull in the
// cuSPARSE/cuBLAS headers, which a bare CUDA toolkit (nvcc and the runtime only) does not have.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>

namespace cbcore {
namespace cuda {

// Multiprocessors of a device, read once per device.
inline int multiprocessor_count(int device) {
  static std::array<std::atomic<int>, 64> counts{};
  if (device < 0 || device >= static_cast<int>(counts.size())) device = 0;
  int n = counts[device].load(std::memory_order_relaxed);
  if (n == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    counts[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

inline cudaStream_t current_stream(int device) { return c10::cuda::getCurrentCUDAStream(device).stream(); }

}  // namespace cuda
}  // namespace cbcore
