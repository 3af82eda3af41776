// The paged decode's memory access on one core, with its prefetch in the two orders bench/results/
// decode_bandwidth_probe.md compares (stop 35). Reads 2 x 256 MiB laid out as the 128-dim fp32 cache (pages of 16
// tokens, a token's row 8 kv heads x 512 bytes = 4 KiB, pages shuffled), in the decode's order: per tile of 32 keys,
// per kv head, that head's 512 bytes of each of the tile's 32 K rows, then of its 32 V rows. Additions only, so
// what is timed is the memory system. Prints GB/s for each prefetch variant (best of 5 passes):
//   sequential   the whole region front to back, no software prefetch (the hardware prefetchers' best case)
//   none         the decode's order, no software prefetch
//   head order   the decode's order, beside each load one prefetch of the same columns of the next tile's row
//   address      the decode's order, beside each load one prefetch of the next tile's rows in address order
//
//   cc -O2 -march=x86-64-v4 bench/decode_prefetch_order_probe.c -o /tmp/probe && /tmp/probe [huge]
//
// `huge` maps the region on transparent huge pages (madvise); without it 4 KiB pages, as the engine maps its cache.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { kRow = 4096, kHeads = 8, kHeadBytes = 512, kPageTokens = 16, kTile = 32 };
static const long kPages = 4096;  // x 16 tokens x 4 KiB = 256 MiB each for K and V

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static char *K, *V;
static long* perm;
static const char* row(const char* base, long t) {
  return base + perm[t / kPageTokens] * (kPageTokens * kRow) + (t % kPageTokens) * kRow;
}

static __m512 pass(int variant, __m512 acc) {
  const long keys = kPages * kPageTokens, bytes = keys * kRow;
  if (variant == 0) {
    for (long c = 0; c < bytes; c += 64) acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float*)(K + c)));
    for (long c = 0; c < bytes; c += 64) acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float*)(V + c)));
    return acc;
  }
  for (long t0 = 0; t0 < keys; t0 += kTile) {
    const long next = t0 + kTile < keys ? t0 + kTile : 0;
    long line = 0;  // the address-order stream: the next tile's K rows, then its V rows
    for (int h = 0; h < kHeads; ++h) {
      for (int kv = 0; kv < 2; ++kv) {
        const char* base = kv ? V : K;
        for (int t = 0; t < kTile; ++t) {
          const char* r = row(base, t0 + t) + h * kHeadBytes;
          for (int c = 0; c < kHeadBytes; c += 64) {
            acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float*)(r + c)));
            if (variant == 2) _mm_prefetch(row(base, next + t) + h * kHeadBytes + c, _MM_HINT_T1);
            if (variant == 3) {
              const long r_ = line / (kRow / 64), l_ = line % (kRow / 64);
              _mm_prefetch(row(r_ < kTile ? K : V, next + r_ % kTile) + l_ * 64, _MM_HINT_T1);
              ++line;
            }
          }
        }
      }
    }
  }
  return acc;
}

int main(int argc, char** argv) {
  const int huge = argc > 1 && strcmp(argv[1], "huge") == 0;
  const long bytes = kPages * kPageTokens * kRow;
  K = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  V = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (huge) {
    madvise(K, bytes, MADV_HUGEPAGE);
    madvise(V, bytes, MADV_HUGEPAGE);
  }
  memset(K, 0, bytes);
  memset(V, 0, bytes);
  perm = malloc(kPages * sizeof(long));
  for (long i = 0; i < kPages; ++i) perm[i] = i;
  srand(1);
  for (long i = kPages - 1; i > 0; --i) {
    const long j = rand() % (i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  const char* names[] = {"sequential", "none", "head order", "address"};
  __m512 acc = _mm512_setzero_ps();
  for (int variant = 0; variant < 4; ++variant) {
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      const double t = now();
      acc = pass(variant, acc);
      const double seconds = now() - t;
      if (seconds < best) best = seconds;
    }
    printf("%-11s %5.1f GB/s\n", names[variant], 2.0 * bytes / best / 1e9);
  }
  float sink[16];
  _mm512_storeu_ps(sink, acc);
  return sink[0] != 0.0f;  // keeps the additions
}
