// The paged decode's memory access on one core, in the read and prefetch orders bench/results/
// decode_bandwidth_probe.md compares (docs/performance_log.md, 2026-12-05 and 2026-12-07). Reads 2 x 256 MiB laid
// out as the 128-dim fp32 cache (pages of 16 tokens, or of the count given, a token's row 8 kv heads x 512 bytes =
// 4 KiB, pages shuffled). Additions only, so what is timed is the memory system. Prints GB/s for each variant
// (best of 5 passes):
//   sequential       the whole region front to back, no software prefetch (the hardware prefetchers' best case)
//   none             the decode's order (per tile of 32 keys, per kv head, that head's 512 bytes of each of the
//                    tile's 32 K rows, then of its 32 V rows), no software prefetch
//   head order       the decode's order, beside each load one prefetch of the same columns of the next tile's row
//   address          the decode's order, beside each load one prefetch of the next tile's rows in address order
//                    (the decode's order since 2026-12-05)
//   rows             each row of the tile read whole (all heads) in turn, K's then V's, no software prefetch
//   4-row groups     four rows at a time, per kv head that head's 512 bytes of each of the four (a decode that
//                    scores four keys across the heads before the next four), no software prefetch
//   4-row + starts   4-row groups, and at each group the first four lines of each row of the next group
//   rows 2 interl.   two rows at a time, their lines alternating (a weighted sum that adds two keys per store)
//   rows 4 interl.   the same with four rows
//   rows + address   rows, and beside each load one prefetch of the next tile's rows in address order
//   rows 4h interl.  rows, but within a row four heads' lines alternating (scores of four heads at once)
//   address /2, /4   address, prefetching only every second or fourth line of the stream
//   address touch    address, with a 4-byte load of each line in place of its prefetch (a demand stream the L2's
//                    own prefetcher may follow)
//
//   cc -O2 -march=x86-64-v4 bench/decode_prefetch_order_probe.c -o /tmp/probe && /tmp/probe [huge] [page tokens]
//
// `huge` maps the region on transparent huge pages (madvise); `small` (or anything else) 4 KiB pages, as the engine
// maps its cache. The page size defaults to 16 tokens (the kernel bench's); 256 is the engine's default.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { kRow = 4096, kHeads = 8, kHeadBytes = 512, kTile = 32, kGroup = 4 };
static const long kRegion = 256L << 20;  // bytes each for K and V
static long page_tokens = 16, pages;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static char *K, *V;
static long* perm;
static const char* row(const char* base, long t) {
  return base + perm[t / page_tokens] * (page_tokens * kRow) + (t % page_tokens) * kRow;
}

static __m512 add_line(__m512 acc, const char* p) { return _mm512_add_ps(acc, _mm512_loadu_ps((const float*)p)); }

// The decode's order (variants 1-3, 11-13): per tile, per kv head, the head's bytes of the tile's K rows, then its
// V rows.
static __m512 head_by_head(int variant, __m512 acc, long keys) {
  for (long t0 = 0; t0 < keys; t0 += kTile) {
    const long next = t0 + kTile < keys ? t0 + kTile : 0;
    long line = 0;  // the address-order stream: the next tile's K rows, then its V rows
    for (int h = 0; h < kHeads; ++h) {
      for (int kv = 0; kv < 2; ++kv) {
        const char* base = kv ? V : K;
        for (int t = 0; t < kTile; ++t) {
          const char* r = row(base, t0 + t) + h * kHeadBytes;
          for (int c = 0; c < kHeadBytes; c += 64) {
            acc = add_line(acc, r + c);
            if (variant == 2) _mm_prefetch(row(base, next + t) + h * kHeadBytes + c, _MM_HINT_T1);
            if (variant == 3 || variant >= 11) {
              const int every = variant == 11 ? 2 : variant == 12 ? 4 : 1;
              if (line % every == 0) {
                const long r_ = line / (kRow / 64), l_ = line % (kRow / 64);
                const char* ahead = row(r_ < kTile ? K : V, next + r_ % kTile) + l_ * 64;
                if (variant == 13) {
                  acc = _mm512_add_ps(acc, _mm512_castps128_ps512(_mm_load_ss((const float*)ahead)));
                } else {
                  _mm_prefetch(ahead, _MM_HINT_T1);
                }
              }
              ++line;
            }
          }
        }
      }
    }
  }
  return acc;
}

// Rows in address order (variants 4-10): per tile, K's rows then V's, whole rows or groups of rows or heads.
static __m512 row_major(int variant, __m512 acc, long keys) {
  for (long t0 = 0; t0 < keys; t0 += kTile) {
    for (int kv = 0; kv < 2; ++kv) {
      const char* base = kv ? V : K;
      if (variant == 4 || variant == 9) {
        const long next = t0 + kTile < keys ? t0 + kTile : 0;
        for (int t = 0; t < kTile; ++t)
          for (int c = 0; c < kRow; c += 64) {
            acc = add_line(acc, row(base, t0 + t) + c);
            if (variant == 9) _mm_prefetch(row(base, next + t) + c, _MM_HINT_T1);
          }
        continue;
      }
      if (variant == 7 || variant == 8) {
        const int n = variant == 7 ? 2 : 4;
        for (int t = 0; t < kTile; t += n)
          for (int c = 0; c < kRow; c += 64)
            for (int j = 0; j < n; ++j) acc = add_line(acc, row(base, t0 + t + j) + c);
        continue;
      }
      if (variant == 10) {
        for (int t = 0; t < kTile; ++t)
          for (int h0 = 0; h0 < kHeads; h0 += 4)
            for (int c = 0; c < kHeadBytes; c += 64)
              for (int hh = 0; hh < 4; ++hh) acc = add_line(acc, row(base, t0 + t) + (h0 + hh) * kHeadBytes + c);
        continue;
      }
      for (int t = 0; t < kTile; t += kGroup) {
        if (variant == 6) {
          const long next = t0 + t + kGroup < keys ? t0 + t + kGroup : 0;
          for (int j = 0; j < kGroup; ++j)
            for (int c = 0; c < 256; c += 64) _mm_prefetch(row(base, next + j) + c, _MM_HINT_T1);
        }
        for (int h = 0; h < kHeads; ++h)
          for (int j = 0; j < kGroup; ++j)
            for (int c = 0; c < kHeadBytes; c += 64) acc = add_line(acc, row(base, t0 + t + j) + h * kHeadBytes + c);
      }
    }
  }
  return acc;
}

static __m512 pass(int variant, __m512 acc) {
  const long keys = pages * page_tokens;
  if (variant == 0) {
    for (long c = 0; c < kRegion; c += 64) acc = add_line(acc, K + c);
    for (long c = 0; c < kRegion; c += 64) acc = add_line(acc, V + c);
    return acc;
  }
  return variant <= 3 || variant >= 11 ? head_by_head(variant, acc, keys) : row_major(variant, acc, keys);
}

int main(int argc, char** argv) {
  const int huge = argc > 1 && strcmp(argv[1], "huge") == 0;
  if (argc > 2) page_tokens = atol(argv[2]);
  if (page_tokens <= 0 || (kRegion / kRow) % page_tokens != 0) {
    fprintf(stderr, "page tokens must divide %ld (a power of two)\n", kRegion / kRow);
    return 2;
  }
  pages = kRegion / (page_tokens * kRow);
  K = mmap(0, kRegion, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  V = mmap(0, kRegion, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (huge) {
    madvise(K, kRegion, MADV_HUGEPAGE);
    madvise(V, kRegion, MADV_HUGEPAGE);
  }
  memset(K, 0, kRegion);
  memset(V, 0, kRegion);
  perm = malloc(pages * sizeof(long));
  for (long i = 0; i < pages; ++i) perm[i] = i;
  srand(1);
  for (long i = pages - 1; i > 0; --i) {
    const long j = rand() % (i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  const char* names[] = {"sequential",     "none",          "head order",      "address",    "rows",
                         "4-row groups",   "4-row + starts", "rows 2 interl.", "rows 4 interl.", "rows + address",
                         "rows 4h interl.", "address /2",    "address /4",     "address touch"};
  __m512 acc = _mm512_setzero_ps();
  for (int variant = 0; variant < 14; ++variant) {
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      const double t = now();
      acc = pass(variant, acc);
      const double seconds = now() - t;
      if (seconds < best) best = seconds;
    }
    printf("%-15s %5.1f GB/s\n", names[variant], 2.0 * kRegion / best / 1e9);
  }
  float sink[16];
  _mm512_storeu_ps(sink, acc);
  return sink[0] != 0.0f;  // keeps the additions
}
