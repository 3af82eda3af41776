// Paged decode attention on CUDA: the kernels (templates) and the launch plan they share.
//
// One query token per request attends over that request's pages, found through its block table. The work of one
// request is cut into splits of `split_tokens` consecutive keys (split-K, "flash-decoding"); each CTA computes one
// (request, KV head, split) for every query head of that KV head at once (GQA head grouping: K/V are read once for
// the whole group). A split's result is its softmax-normalised output with its max and sum; a second small kernel
// merges the splits of each request with a log-sum-exp weighting, in split order. A request that fits in one split
// is written directly by the first kernel and the merge skips it.
//
// Inside a CTA (NW warps), three phases over the split's keys:
//   1. scores: each key row is read by a group of GS lanes, one 16-byte vector per lane (coalesced: the GS lanes
//      cover the row's D elements contiguously); the partial dot products of all GPAD heads are reduced across the
//      group with a reduce-scatter butterfly (G - 1 + log2(GS / G) shuffles instead of G * log2(GS)); scores go to
//      shared memory, already scaled by scale * log2(e).
//   2. softmax statistics: per-head max and sum of exp2(score - max) over the split, in a fixed order.
//   3. values: the same lane mapping reads V rows and accumulates probability * V in registers; partial sums of the
//      token groups and warps are added in a fixed order.
// Soft-capping (Gemma-2) bends each score as it is written in phase 1, before anything masks or sums it. A sink
// (GPT-OSS) is one more softmax term e^sink with no value: it joins the denominator once per request, where the
// request's output is normalised (the direct write of a one-split request, or the merge), never in a split's
// partial state, so split-K cannot count it twice.
// V may have its own head dim DV (multi-head latent attention: DeepSeek-V3's K 192, V 128): phase 3 then has a lane
// mapping of its own, and everything written after it (the reduction area, outputs, partials) has DV columns.
// Each lane keeps U loads of 16 bytes in flight per phase (unrolled), and the many CTAs of split-K keep the memory
// system busy. Every reduction has a fixed shape, so results are reproducible run to run; with a fixed split size
// (deterministic mode) they are also independent of what else is in the batch.
#pragma once

#include <cstdint>

#include "attention/cuda_decode_params.h"
#include "attention/cuda_vec.cuh"

namespace cbcore {
namespace cuda {

// Sum of v[0..G) over the GS lanes of a token group, scattered: afterwards lane `lig` of the group holds the total
// of head lig / (GS / G). Each halving step trades half of the heads with the partner lane, so the group needs
// G - 1 + log2(GS / G) shuffles in all.
template <int G, int GS>
__device__ __forceinline__ float reduce_scatter_heads(float (&v)[G], int lig) {
  static_assert(G <= GS, "a token group must have at least as many lanes as heads");
#pragma unroll
  for (int step = 0; (G >> step) > 1; ++step) {
    const int half = (G >> step) / 2;
    const int offset = GS >> (step + 1);
    const bool upper = (lig & offset) != 0;
#pragma unroll
    for (int j = 0; j < half; ++j) {
      const float send = upper ? v[j] : v[j + half];
      const float keep = upper ? v[j + half] : v[j];
      v[j] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
  }
  float s = v[0];
#pragma unroll
  for (int offset = GS / (2 * G); offset >= 1; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
  return s;
}

// Lanes that read one row of `row_vecs` 16-byte vectors: the largest power of two <= 32 dividing it (so a row of 48
// vectors, fp32 D = 192, is read by 16 lanes, three vectors each).
__host__ __device__ constexpr int lanes_per_row(int row_vecs) {
  int lanes = 32;
  while (lanes > 1 && row_vecs % lanes != 0) lanes /= 2;
  return lanes;
}

template <typename T, int D, int DV, int GPAD>
__global__ void __launch_bounds__(kDecodeWarps * 32) decode_split_kernel(const DecodeParams p) {
  constexpr int NW = kDecodeWarps;
  constexpr int NT = NW * 32;
  constexpr int VE = Vec16<T>::kElems;    // elements per 16-byte vector
  constexpr int ROW_VECS = D / VE;        // vectors per K row of one head
  constexpr int GS = lanes_per_row(ROW_VECS);  // lanes per token
  constexpr int NV = ROW_VECS / GS;       // vectors per lane per row
  constexpr int EPL = NV * VE;            // elements per lane
  constexpr int TPW = 32 / GS;            // tokens per warp step
  constexpr int U = NV == 1 ? 4 : 2;      // warp steps whose loads are issued together
  constexpr int STEP = NW * U * TPW;      // tokens per CTA iteration
  // The same for V rows (phase 3), which have DV elements.
  constexpr int ROW_VECS_V = DV / VE;
  constexpr int GSV = lanes_per_row(ROW_VECS_V);
  constexpr int NVV = ROW_VECS_V / GSV;
  constexpr int EPLV = NVV * VE;
  constexpr int TPWV = 32 / GSV;
  constexpr int UV = NVV == 1 ? 4 : 2;
  constexpr int STEPV = NW * UV * TPWV;
  static_assert(D % VE == 0 && DV % VE == 0, "unsupported head_dim for this dtype");
  static_assert(GPAD <= GS && (GPAD & (GPAD - 1)) == 0, "GPAD must be a power of two <= GS");

  extern __shared__ __align__(16) float smem[];
  const int score_floats = decode_score_floats(p.split_tokens, GPAD, DV);
  float* scores = smem;                         // [split_tokens][GPAD], later [NW][GPAD][DV]
  float* red = smem + score_floats;             // [NW][GPAD]
  float* stat_max = red + NW * GPAD;            // [GPAD]
  float* stat_sum = stat_max + GPAD;            // [GPAD]
  int* page_blocks = reinterpret_cast<int*>(stat_sum + GPAD);  // [max_pages_per_split]

  const int chunk = blockIdx.x % p.num_head_chunks;
  const int kv_head = blockIdx.x / p.num_head_chunks;
  const int b = blockIdx.y;
  const int split = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int sub = lane / GS;  // which token of the warp step
  const int lig = lane % GS;  // lane in the token group
  const int subv = lane / GSV;  // the same for V rows
  const int ligv = lane % GSV;

  const KeyRange range = key_range(p.seq_lens[b], p.table_width, p.log2_page, p.window, p.split_tokens);
  if (split >= range.num_splits) return;
  const int tok0 = range.first + split * p.split_tokens;
  int n = range.count - split * p.split_tokens;
  n = n < 0 ? 0 : (n > p.split_tokens ? p.split_tokens : n);
  const int head0 = kv_head * p.group + chunk * GPAD;
  const int heads = min(GPAD, p.group - chunk * GPAD);
  const int page_mask = (1 << p.log2_page) - 1;

  // Stage the split's block ids: every key row address below needs one, and shared memory is closer than the table.
  const int page0 = tok0 >> p.log2_page;
  const int num_pages = n > 0 ? ((tok0 + n - 1) >> p.log2_page) - page0 + 1 : 0;
  const int32_t* table_row = p.block_table + static_cast<int64_t>(b) * p.bt_stride;
  for (int i = tid; i < num_pages; i += NT) {
    const int block = table_row[page0 + i];
    // A bad id must not fault the kernel: it is clamped (the result is then garbage, as with any bad table).
    page_blocks[i] = (static_cast<unsigned>(block) < static_cast<unsigned>(p.num_cache_blocks)) ? block : 0;
  }

  // This lane's slice of every head's query, pre-scaled so that scores are in the log2 domain.
  float q[GPAD][EPL];
  {
    const T* qb = static_cast<const T*>(p.q) + static_cast<int64_t>(b) * p.q_stride_b;
#pragma unroll
    for (int g = 0; g < GPAD; ++g) {
#pragma unroll
      for (int v = 0; v < NV; ++v) {
#pragma unroll
        for (int e = 0; e < VE; ++e) {
          const int d = (v * GS + lig) * VE + e;
          q[g][v * VE + e] = g < heads ? to_float(qb[(head0 + g) * p.q_stride_h + d]) * p.scale_log2 : 0.f;
        }
      }
    }
  }
  __syncthreads();

  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * D;  // elements between tokens of a page
  auto slot_of = [&](int i) -> int64_t {
    const int tok = tok0 + i;
    return (static_cast<int64_t>(page_blocks[(tok >> p.log2_page) - page0]) << p.log2_page) | (tok & page_mask);
  };
  auto row_offset = [&](int i) -> int64_t { return slot_of(i) * token_stride + static_cast<int64_t>(kv_head) * D; };
  const int64_t v_token_stride = static_cast<int64_t>(p.num_kv_heads) * DV;
  auto v_row_offset = [&](int i) -> int64_t {
    return slot_of(i) * v_token_stride + static_cast<int64_t>(kv_head) * DV;
  };

  // ---- phase 1: scores ----------------------------------------------------------------------------------------
  constexpr int LANES_PER_HEAD = GS / GPAD;
  const T* k_cache = static_cast<const T*>(p.k_cache);
  for (int base = warp * U * TPW; base < n; base += STEP) {
    uint4 kv[U][NV];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * TPW + sub;
      if (i < n) {
        const T* row = k_cache + row_offset(i);
#pragma unroll
        for (int v = 0; v < NV; ++v) kv[u][v] = load_stream16(row + (v * GS + lig) * VE);
      } else {
#pragma unroll
        for (int v = 0; v < NV; ++v) kv[u][v] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float k[EPL];
#pragma unroll
      for (int v = 0; v < NV; ++v) Vec16<T>::to_float(kv[u][v], k + v * VE);
      float dot[GPAD];
#pragma unroll
      for (int g = 0; g < GPAD; ++g) {
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc = fmaf(q[g][e], k[e], acc);
        dot[g] = acc;
      }
      float s = reduce_scatter_heads<GPAD, GS>(dot, lig);
      // softcap * tanh(x / softcap) on the natural-log score x, written in the log2 domain (both sides times log2 e).
      if (p.softcap_log2 > 0.f) s = p.softcap_log2 * tanhf(s / p.softcap_log2);
      const int i = base + u * TPW + sub;
      if (i < n && lig % LANES_PER_HEAD == 0) scores[i * GPAD + lig / LANES_PER_HEAD] = s;
    }
  }
  __syncthreads();

  // ---- phase 2: per-head max and sum of exp2(score - max) -------------------------------------------------------
  {
    const int g = tid % GPAD;
    float mx = -INFINITY;
    for (int i = tid / GPAD; i < n; i += NT / GPAD) mx = fmaxf(mx, scores[i * GPAD + g]);
#pragma unroll
    for (int offset = 16; offset >= GPAD; offset /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
    if (lane < GPAD) red[warp * GPAD + lane] = mx;
    __syncthreads();
    if (tid < GPAD) {
      float m = red[tid];
#pragma unroll
      for (int w = 1; w < NW; ++w) m = fmaxf(m, red[w * GPAD + tid]);
      stat_max[tid] = m;
    }
    __syncthreads();
    const float m = stat_max[g];
    float sum = 0.f;
    for (int i = tid / GPAD; i < n; i += NT / GPAD) {
      const float e = exp2f(scores[i * GPAD + g] - m);
      scores[i * GPAD + g] = e;
      sum += e;
    }
#pragma unroll
    for (int offset = 16; offset >= GPAD; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane < GPAD) red[warp * GPAD + lane] = sum;
    __syncthreads();
    if (tid < GPAD) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) total += red[w * GPAD + tid];
      stat_sum[tid] = total;
    }
  }

  // ---- phase 3: probabilities times V ---------------------------------------------------------------------------
  float acc[GPAD][EPLV];
#pragma unroll
  for (int g = 0; g < GPAD; ++g)
#pragma unroll
    for (int e = 0; e < EPLV; ++e) acc[g][e] = 0.f;

  const T* v_cache = static_cast<const T*>(p.v_cache);
  for (int base = warp * UV * TPWV; base < n; base += STEPV) {
    uint4 vv[UV][NVV];
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const int i = base + u * TPWV + subv;
      if (i < n) {
        const T* row = v_cache + v_row_offset(i);
#pragma unroll
        for (int v = 0; v < NVV; ++v) vv[u][v] = load_stream16(row + (v * GSV + ligv) * VE);
      }
    }
#pragma unroll
    for (int u = 0; u < UV; ++u) {
      const int i = base + u * TPWV + subv;
      if (i < n) {
        float val[EPLV];
#pragma unroll
        for (int v = 0; v < NVV; ++v) Vec16<T>::to_float(vv[u][v], val + v * VE);
        float prob[GPAD];
        if constexpr (GPAD % 4 == 0) {
#pragma unroll
          for (int g = 0; g < GPAD; g += 4) {
            const float4 p4 = *reinterpret_cast<const float4*>(scores + i * GPAD + g);
            prob[g] = p4.x;
            prob[g + 1] = p4.y;
            prob[g + 2] = p4.z;
            prob[g + 3] = p4.w;
          }
        } else {
#pragma unroll
          for (int g = 0; g < GPAD; ++g) prob[g] = scores[i * GPAD + g];
        }
#pragma unroll
        for (int g = 0; g < GPAD; ++g)
#pragma unroll
          for (int e = 0; e < EPLV; ++e) acc[g][e] = fmaf(prob[g], val[e], acc[g][e]);
      }
    }
  }

  // Add the token groups of each warp, then the warps, in a fixed order.
#pragma unroll
  for (int offset = GSV; offset < 32; offset *= 2)
#pragma unroll
    for (int g = 0; g < GPAD; ++g)
#pragma unroll
      for (int e = 0; e < EPLV; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], offset);
  __syncthreads();  // every warp is done reading probabilities: the score area becomes the reduction area
  float* red_acc = scores;  // [NW][GPAD][DV]
  if (subv == 0) {
#pragma unroll
    for (int g = 0; g < GPAD; ++g)
#pragma unroll
      for (int v = 0; v < NVV; ++v)
#pragma unroll
        for (int e = 0; e < VE; ++e)
          red_acc[(warp * GPAD + g) * DV + (v * GSV + ligv) * VE + e] = acc[g][v * VE + e];
  }
  __syncthreads();

  const bool direct = range.num_splits == 1;
  for (int idx = tid; idx < heads * DV; idx += NT) {
    const int g = idx / DV;
    const int d = idx % DV;
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) a += red_acc[(w * GPAD + g) * DV + d];
    float l = stat_sum[g];
    // The sink's term relative to this split's max; a sink far above every score gives inf here and the output 0,
    // its limit. Only the request's normalisation adds it: here for a one-split request, else in the merge.
    if (direct && p.sinks != nullptr) l += exp2f(p.sinks[head0 + g] * kLog2e - stat_max[g]);
    const float o = l > 0.f ? a / l : 0.f;
    const int64_t bh = static_cast<int64_t>(b) * p.num_heads + head0 + g;
    if (direct) {
      static_cast<T*>(p.out)[bh * DV + d] = from_float<T>(o);
    } else {
      const int64_t at = bh * p.max_splits + split;
      p.partial_out[at * DV + d] = o;
      if (d == 0) {
        p.partial_max[at] = stat_max[g];
        p.partial_sum[at] = l;
      }
    }
  }
}

// Merges the splits of every request with more than one: out = sum_s w_s o_s / (sum_s w_s [+ exp2(sink - max)]) with
// w_s = sum_s * exp2(max_s - max), summed in split order by every thread (no order depends on the launch).
template <typename T>
__global__ void __launch_bounds__(kMergeThreads) decode_merge_kernel(const DecodeParams p, int head_dim) {
  // head_dim: V's (the outputs' and partials' columns).
  __shared__ float weights[kMergeChunk];
  __shared__ float warp_max[kMergeThreads / 32];
  const int head = blockIdx.x;
  const int b = blockIdx.y;
  const int tid = threadIdx.x;
  const KeyRange range = key_range(p.seq_lens[b], p.table_width, p.log2_page, p.window, p.split_tokens);
  const int num_splits = range.num_splits;
  if (num_splits <= 1) return;  // written by the split kernel

  const int64_t bh = static_cast<int64_t>(b) * p.num_heads + head;
  const float* pmax = p.partial_max + bh * p.max_splits;
  const float* psum = p.partial_sum + bh * p.max_splits;
  const float* pout = p.partial_out + bh * p.max_splits * head_dim;

  float m = -INFINITY;
  for (int s = tid; s < num_splits; s += kMergeThreads) m = fmaxf(m, pmax[s]);
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (tid % 32 == 0) warp_max[tid / 32] = m;
  __syncthreads();
  m = warp_max[0];
#pragma unroll
  for (int w = 1; w < kMergeThreads / 32; ++w) m = fmaxf(m, warp_max[w]);

  constexpr int kMaxPerThread = 2;  // head_dim <= 256 = kMaxPerThread * kMergeThreads
  float acc[kMaxPerThread] = {0.f, 0.f};
  float total = 0.f;
  for (int c0 = 0; c0 < num_splits; c0 += kMergeChunk) {
    const int cn = min(kMergeChunk, num_splits - c0);
    __syncthreads();
    for (int s = tid; s < cn; s += kMergeThreads) weights[s] = psum[c0 + s] * exp2f(pmax[c0 + s] - m);
    __syncthreads();
    for (int s = 0; s < cn; ++s) total += weights[s];
#pragma unroll
    for (int k = 0; k < kMaxPerThread; ++k) {
      const int d = tid + k * kMergeThreads;
      if (d < head_dim) {
        float a = acc[k];
        for (int s = 0; s < cn; ++s) a = fmaf(weights[s], pout[static_cast<int64_t>(c0 + s) * head_dim + d], a);
        acc[k] = a;
      }
    }
  }
  if (p.sinks != nullptr) total += exp2f(p.sinks[head] * kLog2e - m);
  T* out = static_cast<T*>(p.out) + bh * head_dim;
#pragma unroll
  for (int k = 0; k < kMaxPerThread; ++k) {
    const int d = tid + k * kMergeThreads;
    if (d < head_dim) out[d] = from_float<T>(total > 0.f ? acc[k] / total : 0.f);
  }
}

}  // namespace cuda
}  // namespace cbcore
