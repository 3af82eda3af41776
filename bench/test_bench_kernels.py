"""Microbenchmarks: the C++ CPU attention kernels (cbcore._C) against the plain-torch references, in one run, with
this machine's memory bandwidth measured alongside as the ceiling for decode.

Workload: a small-model attention shape, 16 query heads over 4 kv heads (GQA 4), head_dim 64, page size 16, fp32
and bf16 caches. Every request's pages are scattered in shuffled block order (as a long-running cache leaves them).
- decode: `batch` requests of `context` keys each, one query token per request.
    GB/s = bytes of K and V the op must read / time = batch x context x kv_heads x head_dim x 2 (K, V) x bytes per
    element. The query, block table and output are negligible beside them.
- prefill: `batch` whole prompts of `context` tokens each, packed (cu_seqlens), causal.
    GFLOP/s = 4 x heads x head_dim x (visible (query, key) pairs) / time, where a prompt of L tokens has L(L+1)/2
    visible pairs under the causal mask (2 flops per multiply-add, once for QK^T and once for PV; masked pairs and
    the softmax are not counted).
- machine: `x.sum()` over a 256 MiB fp32 tensor (bytes read / time) and `y.copy_(x)` (bytes read + written / time),
    both with torch's own vectorised kernels on all threads: the practical read-bandwidth ceiling for decode.

Implementations: "cpp" is what cbcore/ops runs on the CPU (the AVX2 copy where the CPU has AVX2+FMA+F16C), "cpp-generic"
the portable copy (what older CPUs run), "reference" the plain-torch specification (cbcore.ops.*_reference).

Threads: all cores (torch.set_num_threads(os.cpu_count())), or $CBCORE_BENCH_THREADS. Run it (`bench/` is not in the
default test paths) and keep the JSON; the module also writes bench/results/kernels_cpu.md:

    python -m pytest bench/test_bench_kernels.py --benchmark-only --benchmark-json bench/results/kernels_cpu.json
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cbcore import ops
from cbcore.benchmarks.machine import cpu_model

_C = ops._cpu_kernels()
pytestmark = pytest.mark.skipif(_C is None, reason="cbcore._C was built without the CPU attention kernels")

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 16, 4, 64, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DECODE_SHAPES = [(8, 512), (32, 1024), (64, 2048)]  # (batch, context)
PREFILL_SHAPES = [(1, 512), (4, 1024), (2, 2048)]  # (batch, prompt length)
IMPLEMENTATIONS = ["cpp", "cpp-generic", "reference"]
THREADS = int(os.environ.get("CBCORE_BENCH_THREADS", os.cpu_count() or 1))
RESULTS_DIR = Path(os.environ.get("CBCORE_BENCH_RESULTS", Path(__file__).resolve().parent / "results"))
COMMAND = "python -m pytest bench/test_bench_kernels.py --benchmark-only --benchmark-json bench/results/kernels_cpu.json"

ROWS: list[dict] = []


@pytest.fixture(autouse=True)
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(previous)


def paged_inputs(batch: int, context: int, dtype: torch.dtype, num_queries: int, seed: int = 0):
    """Caches with each request's blocks shuffled through the whole cache, the block table, and queries."""
    generator = torch.Generator().manual_seed(seed)
    blocks = batch * (-(-context // PAGE_SIZE))
    shape = (blocks, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    table = torch.randperm(blocks, generator=generator).view(batch, -1).to(torch.int32)
    q = torch.randn(num_queries, HEADS, HEAD_DIM, generator=generator).to(dtype)
    return q, k_cache, v_cache, table


def run_and_time(benchmark, fn, slow: bool) -> float:
    """Median seconds per call; the reference gets fewer rounds (it is 10-100x slower)."""
    rounds, iterations = (3, 1) if slow else (10, 3)
    benchmark.pedantic(fn, rounds=rounds, iterations=iterations, warmup_rounds=1)
    return benchmark.stats.stats.median


def with_isa(implementation: str, fn):
    """fn, run with the kernels' generic copy for "cpp-generic"."""
    if implementation != "cpp-generic":
        return fn

    def generic():
        _C._set_cpu_attention_isa("generic")
        try:
            return fn()
        finally:
            _C._set_cpu_attention_isa("auto")
    return generic


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("batch", "context"), DECODE_SHAPES, ids=[f"{b}x{c}" for b, c in DECODE_SHAPES])
def test_decode(benchmark, batch, context, dtype, implementation) -> None:
    q, k_cache, v_cache, table = paged_inputs(batch, context, DTYPES[dtype], batch)
    lens = torch.full((batch,), context, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    if implementation == "reference":
        fn = lambda: ops.decode_attention_reference(q, k_cache, v_cache, table, lens, scale)  # noqa: E731
    else:
        fn = with_isa(implementation, lambda: _C.decode_attention(q, k_cache, v_cache, table, lens, scale, -1))
    seconds = run_and_time(benchmark, fn, slow=implementation == "reference")
    bytes_read = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    benchmark.extra_info.update(op="decode", batch=batch, context=context, dtype=dtype, implementation=implementation,
                                threads=THREADS, bytes_read=bytes_read, gb_per_s=bytes_read / seconds / 1e9)
    ROWS.append(dict(benchmark.extra_info, ms=seconds * 1e3))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("batch", "context"), PREFILL_SHAPES, ids=[f"{b}x{c}" for b, c in PREFILL_SHAPES])
def test_prefill(benchmark, batch, context, dtype, implementation) -> None:
    q, k_cache, v_cache, table = paged_inputs(batch, context, DTYPES[dtype], batch * context)
    lens = torch.full((batch,), context, dtype=torch.int32)
    cu = torch.arange(0, batch * context + 1, context, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    if implementation == "reference":
        fn = lambda: ops.prefill_attention_reference(q, k_cache, v_cache, table, cu, lens, scale)  # noqa: E731
    else:
        fn = with_isa(implementation, lambda: _C.prefill_attention(q, k_cache, v_cache, table, cu, lens, scale, -1))
    seconds = run_and_time(benchmark, fn, slow=implementation == "reference")
    flops = 4 * HEADS * HEAD_DIM * batch * context * (context + 1) // 2
    benchmark.extra_info.update(op="prefill", batch=batch, context=context, dtype=dtype, implementation=implementation,
                                threads=THREADS, flops=flops, gflop_per_s=flops / seconds / 1e9)
    ROWS.append(dict(benchmark.extra_info, ms=seconds * 1e3))


@pytest.mark.parametrize("operation", ["sum", "copy"])
def test_machine_memory_bandwidth(benchmark, operation) -> None:
    """The read ceiling decode is judged against: torch's own sum / copy over 256 MiB, all threads."""
    x = torch.ones(64 * 2**20)
    y = torch.empty_like(x)
    fn = x.sum if operation == "sum" else (lambda: y.copy_(x))
    seconds = run_and_time(benchmark, fn, slow=False)
    moved = x.numel() * 4 * (1 if operation == "sum" else 2)
    benchmark.extra_info.update(op=f"memory {operation}", bytes=moved, threads=THREADS, gb_per_s=moved / seconds / 1e9)
    ROWS.append(dict(benchmark.extra_info, ms=seconds * 1e3))


def hardware() -> str:
    model = cpu_model()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (f"{model}, {os.cpu_count()} cores, {THREADS} torch threads, kernels: {ops.available_backends()['cpu']}; "
            f"load average at the end of the run {load} (other work on the machine shows up as noise)")


@pytest.fixture(scope="module", autouse=True)
def _write_report():
    yield
    if not ROWS:
        return
    lines = [
        "# CPU attention kernels: C++ against the reference",
        "",
        f"- hardware: {hardware()}",
        f"- shapes: heads {HEADS}, kv heads {KV_HEADS} (GQA {HEADS // KV_HEADS}), head_dim {HEAD_DIM}, page size "
        f"{PAGE_SIZE}, pages shuffled; decode batch x context {', '.join(f'{b}x{c}' for b, c in DECODE_SHAPES)}; "
        f"prefill batch x prompt {', '.join(f'{b}x{c}' for b, c in PREFILL_SHAPES)}",
        "- counts: decode GB/s = K+V bytes read / median time; prefill GFLOP/s = 4 x heads x head_dim x causal "
        "(query, key) pairs / median time; memory = torch sum (read) and copy (read + write) of 256 MiB",
        f"- command: `{COMMAND}`",
        "",
        "| op | batch x context | dtype | implementation | ms | GB/s | GFLOP/s | vs reference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    reference_ms = {(r["op"], r["batch"], r["context"], r["dtype"]): r["ms"]
                    for r in ROWS if r.get("implementation") == "reference"}
    order = {name: i for i, name in enumerate(IMPLEMENTATIONS)}
    rows = sorted(ROWS, key=lambda r: (r["op"].startswith("memory"), r["op"], r.get("batch", 0) * r.get("context", 0),
                                       r.get("context", 0), r.get("dtype", ""), order.get(r.get("implementation"), 0)))
    for r in rows:
        if r["op"].startswith("memory"):
            lines.append(f"| {r['op']} | 256 MiB | fp32 | torch | {r['ms']:.2f} | {r['gb_per_s']:.1f} | | |")
            continue
        ref = reference_ms.get((r["op"], r["batch"], r["context"], r["dtype"]))
        speedup = f"{ref / r['ms']:.1f}x" if ref else ""
        gbs = f"{r['gb_per_s']:.1f}" if "gb_per_s" in r else ""
        gflops = f"{r['gflop_per_s']:.1f}" if "gflop_per_s" in r else ""
        lines.append(f"| {r['op']} | {r['batch']}x{r['context']} | {r['dtype']} | {r['implementation']} | "
                     f"{r['ms']:.2f} | {gbs} | {gflops} | {speedup} |")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "kernels_cpu.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
