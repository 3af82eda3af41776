// The kernel interface of the CUDA swap copies: plain C++ and the CUDA runtime (host side: cuda_copy_blocks.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace cbcore {
namespace cuda {

// For every tensor t < num_tensors and block pair i < num_pairs: copies block_bytes bytes from
// table[2t] + src_ids[i] * block_bytes to table[2t + 1] + dst_ids[i] * block_bytes. The table (device-reachable
// addresses) and the ids are in device memory. vec16: every address and block_bytes are multiples of 16.
cudaError_t launch_copy_blocks(const int64_t* table, const int64_t* src_ids, const int64_t* dst_ids,
                               int64_t num_pairs, int64_t num_tensors, int64_t block_bytes, bool vec16,
                               cudaStream_t stream);

}  // namespace cuda
}  // namespace cbcore
