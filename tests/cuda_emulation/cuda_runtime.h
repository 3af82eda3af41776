// A stand-in for the CUDA runtime, to run cbcore's CUDA kernels on the CPU (tests/test_kernels_cuda_emulated.py):
// one std::thread per CUDA thread, one CTA at a time, __syncthreads as a barrier of the CTA's threads and
// __shfl_xor_sync as an exchange through memory between two barriers of the warp's 32 threads. It checks the
// kernels' logic (indexing, head grouping, split-K and its merge, windows, reduction order), not their performance
// or the GPU's memory model; every shuffle must be reached by all 32 lanes, as on the GPU.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct dim3 { unsigned x = 1, y = 1, z = 1; dim3() = default; dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
using cudaError_t = int;
using cudaStream_t = void*;
constexpr int cudaSuccess = 0, cudaErrorInvalidValue = 1;
inline int cudaGetLastError() { return 0; }
struct uint4 { uint32_t x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
using std::min; using std::max;
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline std::barrier<>* emu_cta_barrier = nullptr;
inline std::barrier<>* emu_warp_barrier[32] = {};
inline float emu_shfl[32][32];
inline void __syncthreads() { emu_cta_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
  const int tid = threadIdx.x, w = tid / 32, l = tid % 32;
  emu_shfl[w][l] = v;
  emu_warp_barrier[w]->arrive_and_wait();
  const float r = emu_shfl[w][l ^ offset];
  emu_warp_barrier[w]->arrive_and_wait();
  return r;
}
