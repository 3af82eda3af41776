// cache_write's kernel interface: plain C++ and the CUDA runtime (the host side is in cuda_ops.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace cbcore {
namespace cuda {

struct CacheWriteParams {
  const char* k;
  const char* v;
  char* k_cache;
  char* v_cache;
  const int64_t* slots;
  int64_t num_tokens;
  int64_t num_slots;        // num_blocks * page_size
  int64_t num_kv_heads;
  int64_t row_units;        // units per head row
  int64_t k_stride_t;       // source strides, in units
  int64_t k_stride_h;
  int64_t v_stride_t;
  int64_t v_stride_h;
};

// Copies every token's K and V rows to its slot in units of `unit_bytes` (16, 8, 4, 2 or 1); returns the launch status.
cudaError_t launch_cache_write(const CacheWriteParams& p, int unit_bytes, int64_t num_ctas, int threads,
                               cudaStream_t stream);

}  // namespace cuda
}  // namespace cbcore
