// Stand-in for csrc/attention/cuda_vec.cuh on the CPU: the same interface; bf16 held as its bits, converted exactly
// as on the GPU (widening by a shift, narrowing to nearest even). No fp16 here.
#pragma once
#include <cuda_runtime.h>
struct __nv_bfloat16 { uint16_t bits; };
namespace cbcore { namespace cuda {
template <typename T> struct Vec16;
template <> struct Vec16<float> { static constexpr int kElems = 4;
  static void to_float(const uint4& v, float* o) { o[0] = __uint_as_float(v.x); o[1] = __uint_as_float(v.y); o[2] = __uint_as_float(v.z); o[3] = __uint_as_float(v.w); } };
template <> struct Vec16<__nv_bfloat16> { static constexpr int kElems = 8;
  static void to_float(const uint4& v, float* out) { const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; ++i) { out[2 * i] = __uint_as_float(w[i] << 16); out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u); } } };
inline float to_float(float x) { return x; }
inline float to_float(__nv_bfloat16 x) { return __uint_as_float(uint32_t(x.bits) << 16); }
template <typename T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {  // round to nearest even
  uint32_t u; std::memcpy(&u, &x, 4); u += 0x7fffu + ((u >> 16) & 1u); return {uint16_t(u >> 16)}; }
inline uint4 load_stream16(const void* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
}}
