// The skinny matmul's fp32 inner loop (csrc/linear/skinny_gemm.cpp, TileF32) alone, on one core: what its
// instruction mix reaches from L1 and from L2, for the tile shapes a call can take. Per k a tile of
// MR rows x NB panels loads NB 64-byte weight lines and broadcasts MR values of x, feeding MR x NB 512-bit FMAs; the
// kernel's own tiles add software prefetches. No prefetch here, so the L2 rows show what the hardware alone gives.
// Prints GFLOP/s per shape, for K = 64 (x's block and the panels stay in L1) and K = 512 (they do not: a decode
// step's hidden size in W2's model).
//
//   c++ -O3 -march=native bench/skinny_tile_probe.cpp -o /tmp/tile_probe && /tmp/tile_probe
//
// What it gave on a Xeon with AMX, against a register-only loop of FMAs and the kernel itself:
// docs/performance_log.md, 2026-12-05 ("the step attention in C++").
#include <immintrin.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <initializer_list>

static double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// reps passes of one tile over K steps: x as the kernel stages it ([K][16] floats), NB panels of [K][16] floats.
template <int MR, int NB>
__attribute__((noinline)) float run(const float* x, const float* w, int K, long reps) {
  float sink = 0;
  for (long r = 0; r < reps; r++) {
    __m512 acc[MR][NB];
    for (int m = 0; m < MR; m++)
      for (int n = 0; n < NB; n++) acc[m][n] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
      __m512 wv[NB];
      for (int n = 0; n < NB; n++) wv[n] = _mm512_load_ps(w + (n * K + k) * 16);
      for (int m = 0; m < MR; m++) {
        const __m512 xv = _mm512_set1_ps(x[k * 16 + m]);
        for (int n = 0; n < NB; n++) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
      }
    }
    __m512 s = _mm512_setzero_ps();
    for (int m = 0; m < MR; m++)
      for (int n = 0; n < NB; n++) s = _mm512_add_ps(s, acc[m][n]);
    sink += _mm512_reduce_add_ps(s);  // keeps the sums live
  }
  return sink;
}

template <int MR, int NB>
void bench(int K) {
  float* x = static_cast<float*>(aligned_alloc(64, K * 64));
  float* w = static_cast<float*>(aligned_alloc(64, K * 64 * NB));
  for (int i = 0; i < K * 16; i++) x[i] = 1e-3f * (i % 7);
  for (int i = 0; i < K * 16 * NB; i++) w[i] = 1e-3f * (i % 5);
  const long reps = 4000000000L / (K * 32L * MR * NB);
  const double t0 = now();
  const float s = run<MR, NB>(x, w, K, reps);
  const double dt = now() - t0;
  std::printf("MR=%2d NB=%d K=%4d: %4.0f GFLOP/s  (%g)\n", MR, NB, K, 2.0 * 16 * MR * NB * K * reps / dt / 1e9, s);
  free(x);
  free(w);
}

int main() {
  for (int K : {64, 512}) {
    bench<16, 1>(K);
    bench<8, 2>(K);
    bench<4, 4>(K);
    bench<6, 4>(K);
    bench<12, 2>(K);
    bench<14, 2>(K);
  }
  return 0;
}
