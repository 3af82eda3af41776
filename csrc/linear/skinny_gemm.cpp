// The skinny matmul: x[M, K] @ W[N, K].T (+ b) for the few rows of a decode step, with W packed once into panels.
//
// Why: a decode step's linear layers multiply a handful of rows (16 on average in W4) by every weight of the model.
// oneDNN's blocked fp32 matmul reaches 90-150 GFLOP/s on those shapes here and reads its weights at 11-18 GB/s
// (bench/results/linear_cpu.md), short of both the FMA rate (~220 GFLOP/s on two cores) and the memory (~25-30
// GB/s): at 16 rows the two bounds are about equal, and its small-M kernels reach neither. This kernel streams each
// weight exactly once per call, in the order it lies in memory, with every row of x riding on each load, and
// prefetches the weights 8 KB ahead into L2. It also serves a prefill's hundreds of rows, in passes of 128 rows, at
// 0.9-1.04x oneDNN's rate in fp32 on wide projections and 0.7-0.95x in bf16 (csrc/linear/packed_linear.cpp says
// which calls take it).
//
// Layout. W is cut into panels of 16 output columns (the last one zero-padded):
//   fp32: panels[p][k][j]    = W[16p + j][k]                    ([P, K, 16] floats)
//   bf16: panels[p][k2][j][e] = W[16p + j][2 k2 + e]            ([P, ceil(K/2), 16, 2] bf16, K padded with zeros)
// so one 64-byte load gives 16 columns of one k (fp32) or of a pair of k (bf16, the operand layout of vdpbf16ps).
// x is copied into blocks of 16 rows, k-major ([K][16] floats, or [K/2][16] bf16 pairs), so the value a row
// multiplies at k is a broadcast from one cache line.
//
// Compute. A tile is MR rows x NB panels (<= 4) of accumulators in registers, over the whole K: per k, NB weight
// loads and MR broadcasts feed MR x NB FMAs. Few rows take more panels at once so that enough independent
// accumulators hide the FMA latency. Each thread takes a contiguous range of panels; per group of four panels it
// runs every row block, so the weights come from memory once and from L1/L2 for the other row blocks. The bias is
// added after the sum, as F.linear's addmm does; bf16 outputs are rounded to nearest even once, at the end.
//
// Three instruction sets, one layout (so a packed weight serves any, and the choice is made per call):
// - AMX (bf16, K a multiple of 32, where Linux grants the tile state): a bf16 panel is the right operand of AMX's
//   tile product as it lies; x's rows are the left one; see "AMX's bf16 tiles" below.
// - AVX-512 (fp32: AVX-512F; bf16: AVX512-BF16): 16-lane accumulators, MR <= 16 rows, so a row block is one tile;
//   bf16 with vdpbf16ps (two k per instruction, their products summed in fp32).
// - AVX2 + FMA (every x86-64 CPU since 2013-2015; Zen 2/3 among them): a panel is two 8-lane halves and the
//   16 registers hold at most MR = 6 rows (fp32) or 4 (bf16) of them, so a row block is cut into 2-4 tiles
//   (the group of panels stays in L2 between them). bf16 weights are widened in registers (a pair of k per 32 bits:
//   one shift or one mask each) and x is copied widened to fp32; products of two bf16 are exact in fp32, so the
//   sums are the fp32 FMA's, in order over k.
// Zen 3 and Zen 4 both issue two 256-bit FMAs a cycle (Zen 4 splits a 512-bit one), so on these CPUs AVX2's tiles
// have the same FMA rate; AVX-512's are larger (fewer reloads of the weights from L2) and bf16's dot products
// take half the instructions.
// A server or desktop Zen 5 issues two full 512-bit FMAs a cycle: AVX-512's tiles run at up to twice Zen 4's rate
// there (fp32: 350-390 GFLOP/s on two cores at 32-2048 rows of W2's step), where oneDNN's larger register tiles
// overtake them past ~80 rows (bench/results/linear_crossover_zen5.md).
#include "linear/skinny_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#if defined(__x86_64__)
#define CBCORE_SKINNY_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define CBCORE_SKINNY_X86 0
#endif
// AVX512-BF16's types and intrinsics came with GCC 10 and Clang 9; older compilers build the AVX2 tiles only.
#if CBCORE_SKINNY_X86 && ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10))
#define CBCORE_SKINNY_AVX512 1
#else
#define CBCORE_SKINNY_AVX512 0
#endif
// AMX's tiles: GCC 11 and Clang 12 have their intrinsics; Linux grants their state to a process that asks
// (cpu::amx_tiles(), csrc/attention/cpu_attention.cpp, asks once).
#if CBCORE_SKINNY_AVX512 && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define CBCORE_SKINNY_AMX 1
#include "attention/cpu_attention.h"
#else
#define CBCORE_SKINNY_AMX 0
#endif

namespace cbcore {
namespace skinny {
namespace {

constexpr int64_t kPanel = 16;      // output columns per panel
constexpr int64_t kRowBlock = 16;   // rows of x per block
constexpr int64_t kPanelGroup = 4;  // panels a thread's loop takes together (every row block runs over them)
// Rows a pass over a thread's panels takes: the row blocks of one pass stay in L2 while the weights stream past
// them (at 128 rows and K = 1536 fp32, 768 KB); more rows take more passes.
constexpr int64_t kRowChunk = 128;
// How far ahead of its loads a tile prefetches the weights, into L2: one prefetch per 64-byte line, 8 KB (128
// lines) ahead. Without it the weights came at 15 GB/s; 2 KB into L1 gave 18-20, 8 KB into L2 20-22 (a W4-shaped
// step of linears, bench/test_bench_linear.py, AVX-512).
constexpr int64_t kPrefetchBytes = 8192;
// AVX-512's tiles, at 16 rows, run one weight line and one line of x per 8 cycles of FMAs, and neither stays in L1
// (at K = 512 a tile's weights and x block are 32 KB each, L1 48 KB): both were L1 misses waited on, the tile at
// ~60% of the FMA rate. They also prefetch the weights 1 KB ahead into L1 and x's line 16 k ahead: a W2-shaped
// step's fp32 linears at 64 rows ran 1.13-1.17x faster, W4's 1.16x (bench/linear_crossover.py).
constexpr int64_t kPrefetchL1Bytes = 1024;
constexpr int64_t kPrefetchXSteps = 16;
// Below this many FLOPs per thread, and this many bytes of weights per thread, a call stays on fewer threads: waking
// a thread costs ~10 us. The bytes count for calls of one or two rows, which the weights' streaming bounds: one row
// of a 512 x 1024 fp32 weight is 1 MFLOP but 2 MB, ~130 us on one core, and one core's loads in flight read about
// half what two cores' do (a W2 step's linears at one row ran 1.36x slower than oneDNN's on one thread).
constexpr int64_t kMinFlopsPerThread = 2'000'000;
constexpr int64_t kMinWeightBytesPerThread = 256 * 1024;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

uint16_t bf16_bits(const at::BFloat16 v) { return v.x; }

// The threads a call runs on: enough work for each (kMinFlopsPerThread, kMinWeightBytesPerThread), at most torch's.
int64_t threads_for(int64_t flops, int64_t weight_bytes) {
  const int64_t by_work = std::max(flops / kMinFlopsPerThread, weight_bytes / kMinWeightBytesPerThread);
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), by_work));
}

// x's rows as blocks of 16, k-major: out[b][k][lane] = value(16 b + lane, k), 0 for rows past M. Blocks in parallel
// when there are several: for a prefill's hundreds of rows the copy is ~10% of the matmul's time on one thread.
template <typename Word, typename F>
std::unique_ptr<Word[]> row_blocks(int64_t M, int64_t depth, const F& value) {
  const int64_t blocks = ceil_div(M, kRowBlock);
  std::unique_ptr<Word[]> out(new Word[static_cast<size_t>(blocks * depth * kRowBlock)]);
  at::parallel_for(0, blocks, M >= 4 * kRowBlock ? 1 : blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      Word* block = out.get() + b * depth * kRowBlock;
      const int64_t rows = std::min(kRowBlock, M - b * kRowBlock);
      for (int64_t lane = 0; lane < kRowBlock; ++lane) {
        if (lane < rows) {
          for (int64_t k = 0; k < depth; ++k) block[k * kRowBlock + lane] = value(b * kRowBlock + lane, k);
        } else {
          for (int64_t k = 0; k < depth; ++k) block[k * kRowBlock + lane] = Word{};
        }
      }
    }
  });
  return out;
}

// A tile: MR rows x NB panels over all of the depth. xb: the tile's first row in its row block (row m's value at k
// is xb[k * 16 + m]); w: the first panel, the others `panel_stride` words apart; out: the tile's first output,
// rows `ldo` apart, `cols` of its NB x 16 columns stored.
template <typename Scalar, typename XWord, typename WWord>
using TileFn = void (*)(const XWord* xb, const WWord* w, int64_t panel_stride, int64_t depth, Scalar* out,
                        int64_t ldo, int64_t cols, const Scalar* bias);

// table[rows - 1][log2(panels)]: every (rows, panels) a call can take for one instruction set's tiles (`Tile`) and
// register budget (`Shape`: kMaxRows rows a tile at most, panels(rows) the panels it takes), the narrower tiles of a
// group's last panels included; the others stay null.
template <typename Scalar, typename XWord, typename WWord, template <int, int> class Tile, class Shape>
struct TileTable {
  TileFn<Scalar, XWord, WWord> fn[kRowBlock][3];
  template <int MR>
  constexpr void fill() {
    fn[MR - 1][0] = &Tile<MR, 1>::run;
    if constexpr (Shape::panels(MR) >= 2) fn[MR - 1][1] = &Tile<MR, 2>::run;
    if constexpr (Shape::panels(MR) >= 4) fn[MR - 1][2] = &Tile<MR, 4>::run;
    if constexpr (MR < Shape::kMaxRows) fill<MR + 1>();
  }
  constexpr TileTable() : fn{} { fill<1>(); }
};

// Runs every tile: threads over contiguous panel ranges, per group of kPanelGroup panels every row block, each
// row block in as few tiles of at most Shape::kMaxRows rows as it takes, of balanced sizes (16 rows: 16 on
// AVX-512, 6 + 5 + 5 in AVX2's fp32). xblocks: row blocks `x_block_stride` words apart; panels: [P][depth][16]
// words; out [M, N].
template <class Shape, typename Scalar, typename XWord, typename WWord>
void run_tiles(const TileFn<Scalar, XWord, WWord> (&table)[kRowBlock][3], const XWord* xblocks,
               int64_t x_block_stride, const WWord* panels, int64_t depth, int64_t M, int64_t N, Scalar* out,
               const Scalar* bias, int64_t flops) {
  const int64_t P = ceil_div(N, kPanel);
  const int64_t panel_stride = depth * kPanel;
  const int64_t threads = threads_for(flops, P * panel_stride * static_cast<int64_t>(sizeof(WWord)));
  const int64_t grain = ceil_div(P, threads);
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
      const int64_t c_end = std::min(M, c0 + kRowChunk);
      for (int64_t g = p0; g < p1; g += kPanelGroup) {
        const int64_t g_end = std::min(g + kPanelGroup, p1);
        for (int64_t r0 = c0; r0 < c_end; r0 += kRowBlock) {
          const int64_t block_rows = std::min(kRowBlock, M - r0);
          const int64_t tiles = ceil_div(block_rows, Shape::kMaxRows);
          const XWord* xblock = xblocks + (r0 / kRowBlock) * x_block_stride;
          for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
            const int64_t rows = ceil_div(block_rows - m0, tiles - t);
            const int want = Shape::panels(static_cast<int>(rows));
            for (int64_t p = g; p < g_end;) {
              int nb = want;
              while (nb > g_end - p) nb /= 2;  // the group's last panels: a narrower tile
              const int64_t col0 = p * kPanel;
              const int64_t cols = std::min<int64_t>(nb * kPanel, N - col0);
              table[rows - 1][nb == 4 ? 2 : nb - 1](xblock + m0, panels + p * panel_stride, panel_stride, depth,
                                                     out + (r0 + m0) * N + col0, N, cols,
                                                     bias ? bias + col0 : nullptr);
              p += nb;
            }
            m0 += rows;
          }
        }
      }
    }
  });
}

}  // namespace

#if CBCORE_SKINNY_AVX512
#define CB_SKINNY_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
// GCC 12 warns inside its own AVX-512 headers (the "undefined" pass-through source of unmasked intrinsics).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace {

// The lanes of a panel's 16 columns that exist when `left` columns are left (all of them from 16 on).
inline __mmask16 column_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// The accumulators of a tile, stored: bias added, columns past `cols` left alone; fp32 out.
template <int MR, int NB>
CB_SKINNY_TARGET inline void store_tile(const __m512 (&acc)[MR][NB], float* out, int64_t ldo, int64_t cols,
                                        const float* bias) {
  for (int n = 0; n < NB; ++n) {
    const int64_t left = cols - n * kPanel;
    if (left <= 0) break;
    const __mmask16 mask = column_mask(left);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n * kPanel) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(out + m * ldo + n * kPanel, mask, _mm512_add_ps(acc[m][n], b));
  }
}

// The same for bf16 out: bias (bf16, widened) added in fp32, then one rounding to nearest even.
template <int MR, int NB>
CB_SKINNY_TARGET inline void store_tile(const __m512 (&acc)[MR][NB], uint16_t* out, int64_t ldo, int64_t cols,
                                        const uint16_t* bias) {
  for (int n = 0; n < NB; ++n) {
    const int64_t left = cols - n * kPanel;
    if (left <= 0) break;
    const __mmask16 mask = column_mask(left);
    __m512 b = _mm512_setzero_ps();
    if (bias) {
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + n * kPanel);
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int m = 0; m < MR; ++m) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][n], b));
      _mm256_mask_storeu_epi16(out + m * ldo + n * kPanel, mask, reinterpret_cast<const __m256i&>(rounded));
    }
  }
}

// fp32: xb is the row block ([K][16] floats), w the panels ([K][16] floats each). A struct so that TileTable can
// take it as a template.
template <int MR, int NB>
struct TileF32 {
  CB_SKINNY_TARGET static void run(const float* xb, const float* w, int64_t panel_stride, int64_t K, float* out,
                                   int64_t ldo, int64_t cols, const float* bias) {
    __m512 acc[MR][NB];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      __m512 wv[NB];
      for (int n = 0; n < NB; ++n) {
        const float* line = w + n * panel_stride + k * kPanel;
        wv[n] = _mm512_loadu_ps(line);
        _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchL1Bytes, _MM_HINT_T0);
      }
      _mm_prefetch(reinterpret_cast<const char*>(xb + (k + kPrefetchXSteps) * kRowBlock), _MM_HINT_T0);
      for (int m = 0; m < MR; ++m) {
        const __m512 xv = _mm512_set1_ps(xb[k * kRowBlock + m]);
        for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
      }
    }
    store_tile<MR, NB>(acc, out, ldo, cols, bias);
  }
};

// bf16: xb is the row block as pairs ([K2][16] x 32 bits), w the panels as [K2][16][2] bf16 (32 bits a column).
template <int MR, int NB>
struct TileBf16 {
  CB_SKINNY_TARGET static void run(const uint32_t* xb, const uint32_t* w, int64_t panel_stride, int64_t K2,
                                   uint16_t* out, int64_t ldo, int64_t cols, const uint16_t* bias) {
    __m512 acc[MR][NB];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K2; ++k) {
      __m512bh wv[NB];
      for (int n = 0; n < NB; ++n) {
        const uint32_t* line = w + n * panel_stride + k * kPanel;
        const __m512i raw = _mm512_loadu_si512(line);
        wv[n] = reinterpret_cast<const __m512bh&>(raw);
        _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchL1Bytes, _MM_HINT_T0);
      }
      _mm_prefetch(reinterpret_cast<const char*>(xb + (k + kPrefetchXSteps) * kRowBlock), _MM_HINT_T0);
      for (int m = 0; m < MR; ++m) {
        const __m512i pair = _mm512_set1_epi32(static_cast<int>(xb[k * kRowBlock + m]));
        const __m512bh xv = reinterpret_cast<const __m512bh&>(pair);
        for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
      }
    }
    store_tile<MR, NB>(acc, out, ldo, cols, bias);
  }
};

// A row block is one tile; few rows take more panels: enough accumulators (>= 8) for the FMA latency, at most 16
// of them (24 at 12 rows) plus the weights and a broadcast in 32 registers.
struct Avx512Shape {
  static constexpr int kMaxRows = 16;
  static constexpr int panels(int rows) { return rows >= 8 ? (rows >= 13 ? 1 : 2) : (rows >= 4 ? 2 : 4); }
};

constexpr TileTable<float, float, float, TileF32, Avx512Shape> kTilesF32{};
constexpr TileTable<uint16_t, uint32_t, uint32_t, TileBf16, Avx512Shape> kTilesBf16{};

}  // namespace
#pragma GCC diagnostic pop
#endif  // CBCORE_SKINNY_AVX512

#if CBCORE_SKINNY_AMX
// AMX's bf16 tiles: one tile product multiplies 16 rows by 32 k by 16 columns (8192 multiply-adds, 256x what one
// vdpbf16ps does), and the bf16 panels are already its right operand's layout: a panel's 16 consecutive pairs of k
// are one 1 KB tile (16 pairs x 16 columns x 2). The left operand is x, 16 rows x 32 k a tile, staged so that each
// tile is one contiguous KB, rows padded to whole tiles. Blocks of two row tiles by two panels keep their four fp32
// sums in tile registers over all of K. Products of two bf16 are exact in fp32, as with vdpbf16ps; the sums run in
// another order; one rounding to bf16 at the end. Takes K a multiple of 32 (the tiles' depth; other K run AVX-512's
// tiles).
#define CB_SKINNY_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
namespace {

constexpr int64_t kAmxDepth = 32;      // k per tile product
constexpr int64_t kAmxTileFloats = 256;  // 16 x 16

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A block of RT row tiles by PT panels (each 1 or 2) over all of K, AMX's usual 2 x 2 blocking: tiles 0-3 the sums
// (row tile r, panel j in tile 2r + j), 4 and 5 x's row tiles, 6 and 7 the panels' weight tiles; per 32 k, RT + PT
// tile loads feed RT x PT products. xs: the block's first row tile as staged (its tile at k at xs + 16 k, the next
// row tile's 16 K words on); panel: the first panel, the second `panel_words` after it; sums: tile 2r + j at
// sums + (2r + j) * 256. Per 32 k it asks for `ahead_lines` lines (64 bytes) into L2, from `ahead` on: the caller
// spreads the next pair of panels over its blocks.
// Before, a block was up to four row tiles by one panel: at 64 rows four loads of x, which at K >= 384 is past L1,
// per weight tile, and the calls ran at 0.9x oneDNN's time (bench/results/linear_crossover_xeon_amx.md).
template <int RT, int PT>
CB_SKINNY_AMX_TARGET void amx_block(const uint16_t* xs, int64_t K, const uint32_t* panel, int64_t panel_words,
                                    const char* ahead, int64_t ahead_lines, float* sums) {
  _tile_zero(0);
  if constexpr (PT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && PT > 1) _tile_zero(3);
  for (int64_t k = 0; k < K; k += kAmxDepth) {
    const uint32_t* w = panel + (k / 2) * kPanel;
    for (int64_t line = 0; line < ahead_lines; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
    ahead += ahead_lines * 64;
    _tile_loadd(6, w, 64);
    if constexpr (PT > 1) _tile_loadd(7, w + panel_words, 64);
    _tile_loadd(4, xs + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT > 1) {
      _tile_loadd(5, xs + 16 * K + k * 16, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (PT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 64);
  if constexpr (PT > 1) _tile_stored(1, sums + kAmxTileFloats, 64);
  if constexpr (RT > 1) _tile_stored(2, sums + 2 * kAmxTileFloats, 64);
  if constexpr (RT > 1 && PT > 1) _tile_stored(3, sums + 3 * kAmxTileFloats, 64);
}

// A tile's sums (16 x 16 floats) into `rows` rows of out, `cols` columns, bias added, rounded to bf16.
CB_SKINNY_AMX_TARGET void store_amx_tile(const float* sums, int64_t rows, uint16_t* out, int64_t ldo, int64_t cols,
                                         const uint16_t* bias) {
  const __mmask16 mask = cols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  __m512 b = _mm512_setzero_ps();
  if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias)), 16));
  for (int64_t m = 0; m < rows; ++m) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(sums + m * 16), b));
    _mm256_mask_storeu_epi16(out + m * ldo, mask, reinterpret_cast<const __m256i&>(rounded));
  }
}

// Panels [p0, p1) of x (staged in xs as [Mp / 16][K / 32][16][32] bf16 tiles, rows past M zero) @ W into out
// [M, N]: per chunk of up to kRowChunk rows (x's chunk stays in L2), per pair of panels, every pair of row tiles.
// One thread's share (the tile configuration is the thread's own); p0 even, so pairs do not straddle threads.
CB_SKINNY_AMX_TARGET void amx_panels(const uint16_t* xs, int64_t Mp, int64_t M, int64_t K, const uint32_t* panels,
                                     int64_t p0, int64_t p1, int64_t N, uint16_t* out, const uint16_t* bias) {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
  const int64_t panel_words = (K / 2) * kPanel, pair_bytes = 2 * panel_words * static_cast<int64_t>(sizeof(uint32_t));
  alignas(64) float sums[4 * kAmxTileFloats];
  for (int64_t chunk = 0; chunk < Mp; chunk += kRowChunk) {
    const int64_t chunk_tiles = std::min(kRowChunk, Mp - chunk) / 16, blocks = ceil_div(chunk_tiles, 2);
    // The weights stream from memory one pair of panels ahead, spread evenly over the pair's row blocks: asked for
    // only in the first block, the memory idled while the others ran (64 rows: half of the time).
    const int64_t ahead_lines = ceil_div(pair_bytes / 64, blocks * (K / kAmxDepth));
    const char* first = reinterpret_cast<const char*>(panels + p0 * panel_words);
    for (int64_t at = 0; at < pair_bytes; at += 64) _mm_prefetch(first + at, _MM_HINT_T1);
    for (int64_t p = p0; p < p1; p += 2) {
      const uint32_t* panel = panels + p * panel_words;
      const int64_t pt = std::min<int64_t>(2, p1 - p);
      const char* ahead = reinterpret_cast<const char*>(panel) + pair_bytes;  // the next pair (past p1: harmless)
      for (int64_t t0 = 0; t0 < chunk_tiles; t0 += 2) {
        const int64_t rt = std::min<int64_t>(2, chunk_tiles - t0);
        const uint16_t* xr = xs + (chunk + 16 * t0) * K;
        const char* block_ahead = ahead + (t0 / 2) * ahead_lines * (K / kAmxDepth) * 64;
        if (rt == 2 && pt == 2) amx_block<2, 2>(xr, K, panel, panel_words, block_ahead, ahead_lines, sums);
        else if (rt == 2) amx_block<2, 1>(xr, K, panel, panel_words, block_ahead, ahead_lines, sums);
        else if (pt == 2) amx_block<1, 2>(xr, K, panel, panel_words, block_ahead, ahead_lines, sums);
        else amx_block<1, 1>(xr, K, panel, panel_words, block_ahead, ahead_lines, sums);
        for (int64_t r = 0; r < rt; ++r) {
          const int64_t row = chunk + 16 * (t0 + r);
          for (int64_t j = 0; j < pt; ++j) {
            const int64_t col0 = (p + j) * kPanel;
            store_amx_tile(sums + (2 * r + j) * kAmxTileFloats, std::min<int64_t>(16, M - row), out + row * N + col0,
                           N, std::min<int64_t>(kPanel, N - col0), bias ? bias + col0 : nullptr);
          }
        }
      }
    }
  }
  _tile_release();
}

// The whole call: threads over contiguous ranges of whole pairs of panels, as run_tiles.
void run_amx(const uint16_t* xs, int64_t Mp, int64_t M, int64_t K, const uint32_t* panels, int64_t N, uint16_t* out,
             const uint16_t* bias, int64_t threads) {
  const int64_t P = ceil_div(N, kPanel);
  at::parallel_for(0, P, 2 * ceil_div(ceil_div(P, threads), 2), [&](int64_t p0, int64_t p1) {
    amx_panels(xs, Mp, M, K, panels, p0, p1, N, out, bias);
  });
}

}  // namespace
#endif  // CBCORE_SKINNY_AMX

#if CBCORE_SKINNY_X86
#define CB_SKINNY_AVX2_TARGET __attribute__((target("avx2,fma")))
namespace {

// A finished tile, stored: `done` holds its accumulators as MR rows of 2 NB halves of 8 floats (columns
// 16 n + 8 h .. + 8 of row m at (m * 2 NB + 2 n + h) * 8); `cols` columns of each row are stored, bias added.
template <int MR, int NB>
CB_SKINNY_AVX2_TARGET inline void store_done(const float* done, float* out, int64_t ldo, int64_t cols,
                                             const float* bias) {
  for (int m = 0; m < MR; ++m)
    for (int64_t c = 0; c < cols; ++c) out[m * ldo + c] = done[m * 16 * NB + c] + (bias ? bias[c] : 0.0f);
}

// The same for bf16 out: bias (bf16) added in fp32, one rounding to nearest even (c10::BFloat16's, as
// vcvtneps2bf16's). Element by element, as the fp32 store: the stores are ~1/K of the tile's work.
template <int MR, int NB>
CB_SKINNY_AVX2_TARGET inline void store_done(const float* done, uint16_t* out, int64_t ldo, int64_t cols,
                                             const uint16_t* bias) {
  for (int m = 0; m < MR; ++m)
    for (int64_t c = 0; c < cols; ++c) {
      const float b = bias ? static_cast<float>(c10::BFloat16(bias[c], c10::BFloat16::from_bits())) : 0.0f;
      out[m * ldo + c] = c10::BFloat16(done[m * 16 * NB + c] + b).x;
    }
}

// A tile's accumulators acc[m][2 n + h] (columns 16 n + 8 h .. + 8 of row m), stored through `done`.
template <int MR, int NB, typename Scalar>
CB_SKINNY_AVX2_TARGET inline void store_halves(const __m256 (&acc)[MR][2 * NB], Scalar* out, int64_t ldo,
                                               int64_t cols, const Scalar* bias) {
  alignas(32) float done[MR * 16 * NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 2 * NB; ++j) _mm256_store_ps(done + (m * 2 * NB + j) * 8, acc[m][j]);
  store_done<MR, NB>(done, out, ldo, cols, bias);
}

// fp32 in AVX2: the layout of TileF32 (xb [K][16], panels [K][16]), each 64-byte line of a panel two halves.
template <int MR, int NB>
struct TileF32Avx2 {
  CB_SKINNY_AVX2_TARGET static void run(const float* xb, const float* w, int64_t panel_stride, int64_t K,
                                        float* out, int64_t ldo, int64_t cols, const float* bias) {
    __m256 acc[MR][2 * NB];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 2 * NB; ++j) acc[m][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      __m256 wv[2 * NB];
      for (int n = 0; n < NB; ++n) {
        const float* line = w + n * panel_stride + k * kPanel;
        wv[2 * n] = _mm256_loadu_ps(line);
        wv[2 * n + 1] = _mm256_loadu_ps(line + 8);
        _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchBytes, _MM_HINT_T1);
      }
      for (int m = 0; m < MR; ++m) {
        // set1 of the value, not _mm256_broadcast_ss of its address (the same vbroadcastss): with the address GCC
        // kept the accumulators in memory and stored all of them on every k, at half the FMA rate.
        const __m256 xv = _mm256_set1_ps(xb[k * kRowBlock + m]);
        for (int j = 0; j < 2 * NB; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
      }
    }
    store_halves<MR, NB>(acc, out, ldo, cols, bias);
  }
};

// bf16 in AVX2: w the panels as TileBf16's ([K2][16] pairs of bf16, the first k in the low half), xb the row block
// widened to fp32 ([2 K2][16] floats). A pair's first k is the low half shifted up, its second the high half
// masked: bf16 is the top half of an fp32.
template <int MR, int NB>
struct TileBf16Avx2 {
  CB_SKINNY_AVX2_TARGET static void run(const float* xb, const uint32_t* w, int64_t panel_stride, int64_t K2,
                                        uint16_t* out, int64_t ldo, int64_t cols, const uint16_t* bias) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m256 acc[MR][2 * NB];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 2 * NB; ++j) acc[m][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K2; ++k) {
      __m256 first[2 * NB], second[2 * NB];
      for (int n = 0; n < NB; ++n) {
        const uint32_t* line = w + n * panel_stride + k * kPanel;
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 8 * h));
          first[2 * n + h] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
          second[2 * n + h] = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
        }
        _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchBytes, _MM_HINT_T1);
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 x0 = _mm256_set1_ps(xb[2 * k * kRowBlock + m]);
        const __m256 x1 = _mm256_set1_ps(xb[(2 * k + 1) * kRowBlock + m]);
        for (int j = 0; j < 2 * NB; ++j)
          acc[m][j] = _mm256_fmadd_ps(x1, second[j], _mm256_fmadd_ps(x0, first[j], acc[m][j]));
      }
    }
    store_halves<MR, NB>(acc, out, ldo, cols, bias);
  }
};

// 16 ymm registers: fp32 tiles of up to 6 rows x one panel (12 accumulators, the panel's two halves and a
// broadcast), more panels for fewer rows so that >= 8 accumulators hide the FMA latency (3 rows x 2 panels: 12, the
// weights then read as FMA operands from L1).
struct Avx2F32Shape {
  static constexpr int kMaxRows = 6;
  static constexpr int panels(int rows) { return rows >= 4 ? 1 : (rows >= 2 ? 2 : 4); }
};

// bf16 holds each panel's halves widened twice (both k of a pair): 4 rows x one panel (8 accumulators, each taking
// two FMAs a pair: as many in flight as 16 FMAs of a step need), 2 rows x 2 panels, 1 row x 4.
struct Avx2Bf16Shape {
  static constexpr int kMaxRows = 4;
  static constexpr int panels(int rows) { return rows >= 3 ? 1 : (rows == 2 ? 2 : 4); }
};

constexpr TileTable<float, float, float, TileF32Avx2, Avx2F32Shape> kTilesF32Avx2{};
constexpr TileTable<uint16_t, float, uint32_t, TileBf16Avx2, Avx2Bf16Shape> kTilesBf16Avx2{};

}  // namespace
#endif  // CBCORE_SKINNY_X86

namespace {

// What this CPU (and build) has, read once: asked on every matmul.
struct Cpu {
  bool avx2 = false;        // AVX2 and FMA
  bool avx512 = false;      // AVX-512 F/BW/VL/DQ
  bool avx512bf16 = false;  // and AVX512-BF16
  bool amx = false;         // and AMX's bf16 tiles, their state granted to this process
  bool full_width = false;  // AVX-512 on two 512-bit FMA units a core (full_width_avx512() says which CPUs)
};

#if CBCORE_SKINNY_X86
// AMD's full-width Zen 5 parts, from CPUID's family and model: family 1Ah, models 00h-1Fh (EPYC 9005, Zen 5 and
// Zen 5c) and 40h-4Fh (Ryzen 9000). The mobile Zen 5 parts (models 20h-2Fh, 60h-6Fh) split a 512-bit FMA in two
// like Zen 4, and CPUID has no bit for the width: a part not listed here counts as split, which only leaves its
// large fp32 calls on the skinny matmul, as on Zen 4.
bool amd_full_width_zen5() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amd = ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
  if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  const unsigned base_family = (eax >> 8) & 0xf;
  const unsigned family = base_family == 0xf ? base_family + ((eax >> 20) & 0xff) : base_family;
  const unsigned model = ((eax >> 4) & 0xf) | (base_family == 0xf ? ((eax >> 16) & 0xf) << 4 : 0);
  return family == 0x1a && (model < 0x20 || (model >= 0x40 && model < 0x50));
}
#endif

const Cpu& cpu() {
  static const Cpu detected = [] {
    Cpu c;
#if CBCORE_SKINNY_X86
    __builtin_cpu_init();
    c.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#if CBCORE_SKINNY_AVX512
    c.avx512 = c.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    c.avx512bf16 = c.avx512 && __builtin_cpu_supports("avx512bf16");
#endif
#if CBCORE_SKINNY_AMX
    c.amx = c.avx512bf16 && cpu::amx_tiles();
#endif
    // Every Xeon with AMX has two 512-bit FMA units a core.
    c.full_width = c.avx512 && (c.amx || amd_full_width_zen5());
#endif
    return c;
  }();
  return detected;
}

enum class Isa { none, avx2, avx512, amx };

// set_isa: the best instruction set calls may run (tests and benchmarks of each on one CPU); amx: no limit.
std::atomic<Isa> isa_limit{Isa::amx};

Isa isa_for(at::ScalarType dtype) {
  const Cpu& c = cpu();
  Isa best = Isa::none;
  if (dtype == at::kFloat) best = c.avx512 ? Isa::avx512 : (c.avx2 ? Isa::avx2 : Isa::none);
  if (dtype == at::kBFloat16) best = c.amx ? Isa::amx : c.avx512bf16 ? Isa::avx512 : (c.avx2 ? Isa::avx2 : Isa::none);
  return std::min(best, isa_limit.load(std::memory_order_relaxed));
}

}  // namespace

bool available(at::ScalarType dtype) { return isa_for(dtype) != Isa::none; }

bool full_width_avx512() { return cpu().full_width; }

std::string isa(at::ScalarType dtype) {
  switch (isa_for(dtype)) {
    case Isa::amx: return "amx";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "none";
  }
}

void set_isa(const std::string& name) {
  if (name == "auto") {
    isa_limit = Isa::amx;
  } else if (name == "avx512") {
    TORCH_CHECK_VALUE(cpu().avx512, "skinny matmul: this CPU has no AVX-512");
    isa_limit = Isa::avx512;
  } else if (name == "avx2") {
    TORCH_CHECK_VALUE(cpu().avx2, "skinny matmul: this CPU has no AVX2 and FMA");
    isa_limit = Isa::avx2;
  } else {
    TORCH_CHECK_VALUE(false, "skinny matmul: unknown instruction set '", name, "' (auto, avx512 or avx2)");
  }
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.device().is_cpu(),
                    "skinny_gemm.pack: the weight must be a 2-D CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = ceil_div(N, kPanel);
  if (w.scalar_type() == at::kFloat) {
    at::Tensor panels = at::zeros({P, K, kPanel}, w.options());
    const float* src = w.const_data_ptr<float>();
    float* dst = panels.mutable_data_ptr<float>();
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
          for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = src[(p * kPanel + j) * K + k];
    });
    return panels;
  }
  TORCH_CHECK_VALUE(w.scalar_type() == at::kBFloat16, "skinny_gemm.pack: float32 or bfloat16 weights only, got ",
                    w.scalar_type());
  const int64_t K2 = ceil_div(K, 2);
  at::Tensor panels = at::zeros({P, K2, kPanel, 2}, w.options());
  const at::BFloat16* src = w.const_data_ptr<at::BFloat16>();
  at::BFloat16* dst = panels.mutable_data_ptr<at::BFloat16>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
        for (int64_t k = 0; k < K; ++k)
          dst[((p * K2 + k / 2) * kPanel + j) * 2 + k % 2] = src[(p * kPanel + j) * K + k];
  });
  return panels;
}

at::Tensor matmul(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, "skinny_gemm.matmul: x must be [M, K] with contiguous rows");
  TORCH_CHECK_VALUE(x.scalar_type() == panels.scalar_type(), "skinny_gemm.matmul: x is ", x.scalar_type(),
                    ", the panels ", panels.scalar_type());
  const Isa chosen = isa_for(x.scalar_type());
  TORCH_CHECK(chosen != Isa::none, "skinny_gemm.matmul: this CPU has no skinny matmul for ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if CBCORE_SKINNY_X86
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK_VALUE(!b.defined() || (b.numel() == N && b.scalar_type() == x.scalar_type()),
                    "skinny_gemm.matmul: the bias must have ", N, " values of ", x.scalar_type());
  const int64_t flops = 2 * M * K * N;
  const int64_t ldx = x.stride(0);
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK_VALUE(panels.dim() == 3 && panels.size(1) == K && panels.size(0) == ceil_div(N, kPanel),
                      "skinny_gemm.matmul: panels ", panels.sizes(), " do not fit x ", x.sizes(), " and N ", N);
    // [blocks][K][16], rows past M zero: the same for both instruction sets.
    const float* src = x.const_data_ptr<float>();
    const std::unique_ptr<float[]> xblocks =
        row_blocks<float>(M, K, [&](int64_t r, int64_t k) { return src[r * ldx + k]; });
    const float* w = panels.const_data_ptr<float>();
    float* y = out.mutable_data_ptr<float>();
    const float* bias_f = b.defined() ? b.const_data_ptr<float>() : nullptr;
#if CBCORE_SKINNY_AVX512
    if (chosen >= Isa::avx512) {
      run_tiles<Avx512Shape>(kTilesF32.fn, xblocks.get(), K * kRowBlock, w, K, M, N, y, bias_f, flops);
      return out;
    }
#endif
    run_tiles<Avx2F32Shape>(kTilesF32Avx2.fn, xblocks.get(), K * kRowBlock, w, K, M, N, y, bias_f, flops);
    return out;
  }
  const int64_t K2 = ceil_div(K, 2);
  TORCH_CHECK_VALUE(panels.dim() == 4 && panels.size(1) == K2 && panels.size(0) == ceil_div(N, kPanel),
                    "skinny_gemm.matmul: panels ", panels.sizes(), " do not fit x ", x.sizes(), " and N ", N);
  const at::BFloat16* src = x.const_data_ptr<at::BFloat16>();
  const uint32_t* w = reinterpret_cast<const uint32_t*>(panels.const_data_ptr<at::BFloat16>());
  uint16_t* y = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
  const uint16_t* bias_bits =
      b.defined() ? reinterpret_cast<const uint16_t*>(b.const_data_ptr<at::BFloat16>()) : nullptr;
#if CBCORE_SKINNY_AMX
  if (chosen == Isa::amx && K % kAmxDepth == 0) {
    // x as the tiles' left operands, each 16 rows x 32 k tile one contiguous KB ([Mp/16][K/32][16][32]; rows
    // past M zero): a tile load reads 16 consecutive lines, which the L1's prefetchers follow (with x's rows K
    // apart, the tile loads at 64 rows ran ~50 cycles each, against the 16 of a tile product).
    const int64_t Mp = ceil_div(M, 16) * 16;
    const std::unique_ptr<uint16_t[]> xs(new uint16_t[static_cast<size_t>(Mp * K)]);
    for (int64_t r = 0; r < Mp; ++r) {
      uint16_t* tile_row = xs.get() + (r / 16) * 16 * K + (r % 16) * kAmxDepth;
      for (int64_t k = 0; k < K; k += kAmxDepth) {
        uint16_t* dst = tile_row + k * 16;
        if (r < M) std::memcpy(dst, src + r * ldx + k, sizeof(uint16_t) * kAmxDepth);
        else std::memset(dst, 0, sizeof(uint16_t) * kAmxDepth);
      }
    }
    run_amx(xs.get(), Mp, M, K, w, N, y, bias_bits, threads_for(flops, ceil_div(N, kPanel) * K * kPanel * 2));
    return out;
  }
#endif
#if CBCORE_SKINNY_AVX512
  if (chosen >= Isa::avx512) {
    // [blocks][K2][16] pairs of bf16 (the first k in the low half), an odd K's last pair and rows past M zero.
    const std::unique_ptr<uint32_t[]> xblocks = row_blocks<uint32_t>(M, K2, [&](int64_t r, int64_t k2) {
      const at::BFloat16* row = src + r * ldx;
      const uint32_t high = 2 * k2 + 1 < K ? static_cast<uint32_t>(bf16_bits(row[2 * k2 + 1])) << 16 : 0u;
      return static_cast<uint32_t>(bf16_bits(row[2 * k2])) | high;
    });
    run_tiles<Avx512Shape>(kTilesBf16.fn, xblocks.get(), K2 * kRowBlock, w, K2, M, N, y, bias_bits, flops);
    return out;
  }
#endif
  // AVX2: [blocks][2 K2][16] floats, x widened (an odd K's padding k and rows past M zero).
  const std::unique_ptr<float[]> xblocks = row_blocks<float>(M, 2 * K2, [&](int64_t r, int64_t k) {
    return k < K ? static_cast<float>(src[r * ldx + k]) : 0.0f;
  });
  run_tiles<Avx2Bf16Shape>(kTilesBf16Avx2.fn, xblocks.get(), 2 * K2 * kRowBlock, w, K2, M, N, y, bias_bits, flops);
  return out;
#else
  (void)bias;
  (void)chosen;
  TORCH_CHECK(false, "skinny_gemm.matmul: not built for this CPU");
#endif
}

}  // namespace skinny
}  // namespace cbcore
