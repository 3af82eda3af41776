"""Where the CPU decode's bandwidth stops: per core or shared, page layout, cache-resident or not.

The kernel microbenchmark (bench/test_bench_kernels.py) reports the fp32 decode at 50-60% of the machine's read
bandwidth for 32/8x128 heads. This probe separates the suspects, in one process, medians of 10 calls:
  - threads: 1 and 2 torch threads (per-core limit if the rate doubles with the threads; the shared bus if not),
    next to torch's `sum` over 256 MiB with the same threads;
  - layout: 8 KV heads interleaved in each page (cbcore's layout: a head's token rows 4 KB apart) against 1 KV head
    per page over 8x the requests (the same bytes, each head's tokens contiguous);
  - residency: 4 requests x 256 tokens (8 MiB of K/V: stays in the L3 between calls) against 32 x 1024 (268 MiB).

    python bench/decode_bandwidth_probe.py [--isa auto|avx2|avx512|avx512_bf16|avx512_amx]
"""

from __future__ import annotations

import argparse
import time

import torch

from cbcore import _C

PAGE = 16


def paged(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Queries, K/V pages shuffled through the cache, the block table, the lengths."""
    generator = torch.Generator().manual_seed(0)
    blocks = batch * (-(-context // PAGE))
    k = torch.randn((blocks, PAGE, kv_heads, head_dim), generator=generator).to(dtype)
    v = torch.randn((blocks, PAGE, kv_heads, head_dim), generator=generator).to(dtype)
    table = torch.randperm(blocks, generator=generator).view(batch, -1).to(torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=generator).to(dtype)
    return q, k, v, table, torch.full((batch,), context, dtype=torch.int32)


def median_seconds(fn, calls: int = 10) -> float:
    fn()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def decode_gb_per_s(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> float:
    q, k, v, table, lens = paged(batch, context, heads, kv_heads, head_dim, dtype)
    seconds = median_seconds(lambda: _C.decode_attention(q, k, v, table, lens, head_dim**-0.5, -1))
    return 2 * batch * context * kv_heads * head_dim * k.element_size() / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", default="auto")
    args = parser.parse_args()
    _C._set_cpu_attention_isa(args.isa)
    data = torch.randn(64 * 1024 * 1024)
    print(f"isa {args.isa}; GB/s, medians of 10 calls")
    print("| threads | sum | fp32 8 kv heads 32x1024 | fp32 1 kv head 256x1024 | fp32 cached 4x256 | "
          "bf16 8 kv heads 32x1024 | fp32 9/3x64 32x1024 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        total = 256 * 2**20 / median_seconds(lambda: data.sum()) / 1e9
        cells = [
            decode_gb_per_s(32, 1024, 32, 8, 128, torch.float32),
            decode_gb_per_s(256, 1024, 4, 1, 128, torch.float32),
            decode_gb_per_s(4, 256, 32, 8, 128, torch.float32),
            decode_gb_per_s(32, 1024, 32, 8, 128, torch.bfloat16),
            decode_gb_per_s(32, 1024, 9, 3, 64, torch.float32),
        ]
        print(f"| {threads} | {total:.1f} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
