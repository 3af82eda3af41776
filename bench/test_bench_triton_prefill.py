"""Microbenchmark: the Triton prefill kernel against the plain-torch reference, on one CUDA device.

Workload: bf16, 32 query heads over 8 kv heads (GQA 4), head_dim 128, page size 16, every request's pages scattered
in shuffled block order; each case is `batch` requests of `q_len` new queries at the end of `context` keys (q_len ==
context: whole prompts; q_len < context: chunks after a cached prefix).

FLOPs are the useful work of causal attention: 4 * head_dim per (query, key) pair that the mask admits, per query
head (2 * head_dim for the row of Q K^T, 2 * head_dim for the row of P V; softmax not counted). Query j of q_len
(0-based) sits at key position context - q_len + j and sees context - q_len + j + 1 keys, so a request has
q_len * (context - q_len) + q_len * (q_len + 1) / 2 pairs. Work a kernel spends on masked-out pairs (tile padding
along the diagonal) is not counted, so GFLOP/s compare implementations on equal terms.

Run on a GPU machine (skipped elsewhere):

    python -m pytest bench/test_bench_triton_prefill.py -m gpu --benchmark-columns=median,rounds \\
        --benchmark-sort=name

Each case stores its GFLOP/s in the benchmark's `extra_info` (shown with --benchmark-json), and prints a line.
"""

from __future__ import annotations

import os

import pytest
import torch

from cbcore import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="benchmarks the compiled kernel"),
]

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
# (batch, q_len, context)
SHAPES = [
    (1, 4096, 4096),  # one long prompt
    (8, 512, 512),  # several short prompts
    (4, 512, 4096),  # chunked prefill after long cached prefixes
    (16, 128, 2048),  # small chunks
    (64, 16, 2048),  # speculative-decoding-sized queries
]


def causal_flops(batch: int, q_len: int, context: int) -> float:
    pairs = q_len * (context - q_len) + q_len * (q_len + 1) / 2
    return 4.0 * HEAD_DIM * HEADS * batch * pairs


def make_inputs(batch: int, q_len: int, context: int):
    """`batch` identical-length requests over shuffled pages, bf16, on the GPU."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_request = -(-context // PAGE_SIZE)
    num_blocks = batch * blocks_per_request
    k_cache = torch.randn(num_blocks, PAGE_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                          generator=generator)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks, device="cuda", generator=generator)
    block_table = order.view(batch, blocks_per_request).to(torch.int32)
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    cu_seqlens_q = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
    seq_lens_k = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k


def run_and_report(benchmark, fn, shape, label):
    def call():
        fn()
        torch.cuda.synchronize()

    call()  # compile / warm up outside the timed rounds
    benchmark.pedantic(call, rounds=20, warmup_rounds=3, iterations=1)
    seconds = benchmark.stats.stats.median
    gflops = causal_flops(*shape) / seconds / 1e9
    benchmark.extra_info.update({"gflops": round(gflops, 1), "shape(batch,q_len,context)": shape,
                                 "device": torch.cuda.get_device_name()})
    print(f"\n{label} batch={shape[0]} q_len={shape[1]} context={shape[2]}: {seconds * 1e3:.3f} ms, "
          f"{gflops:.0f} GFLOP/s")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"b{s[0]}-q{s[1]}-ctx{s[2]}")
@pytest.mark.parametrize("implementation", ["triton", "reference"])
def test_bench_prefill_attention(benchmark, implementation, shape) -> None:
    from cbcore.triton_kernels.prefill import prefill_attention

    args = make_inputs(*shape)
    scale = HEAD_DIM**-0.5
    kernel = prefill_attention if implementation == "triton" else ops.prefill_attention_reference
    benchmark.group = f"prefill b{shape[0]} q{shape[1]} ctx{shape[2]}"
    run_and_report(benchmark, lambda: kernel(*args, scale), shape, implementation)


# Tile shapes to tune choose_tiles() with (BLOCK_M, BLOCK_N, warps, stages); the first is what it picks today for
# large prompts at head_dim 128 in bf16.
TILES = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2)]


@pytest.mark.parametrize("shape", [(1, 4096, 4096), (4, 512, 4096)], ids=lambda s: f"b{s[0]}-q{s[1]}-ctx{s[2]}")
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "m{}n{}w{}s{}".format(*t))
def test_bench_prefill_tile_shapes(benchmark, tiles, shape) -> None:
    from cbcore.triton_kernels.prefill import PrefillTiles, prefill_attention

    args = make_inputs(*shape)
    scale = HEAD_DIM**-0.5
    tile_config = PrefillTiles(*tiles)
    benchmark.group = f"tiles b{shape[0]} q{shape[1]} ctx{shape[2]}"
    run_and_report(benchmark, lambda: prefill_attention(*args, scale, tiles=tile_config), shape, f"tiles {tiles}")
