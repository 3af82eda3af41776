"""Microbenchmarks behind two CPU choices of the engine (cbcore/linear.py and the loop thread's thread count):

1. Linear layers: `F.linear` (MKL in torch's x86 builds) against the oneDNN matmul on a weight reordered once
   (`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`, what `PackedLinears` runs), on the shapes of a
   step of the bench's 32M Llama: M = rows of the step (64: a decode step of W1; 512: a prefill chunk), K x N = the
   model's projections (512x512 q/o, 512x256 k/v, 512x1408 gate/up, 1408x512 down, 512x8192 lm_head).
   GFLOP/s = 2 M K N / time. fp32 and bf16.
2. Threads: the same small op mix (a 64x512x1408 linear and a SiLU-multiply) timed in the main thread, in a freshly
   started Python thread, and in a fresh thread that first calls `torch.set_num_threads` with the caller's count (what
   the manager's loop thread does).

    python -m pytest bench/test_bench_linear.py --benchmark-only -q

It writes bench/results/linear_cpu.md (or under $CBCORE_BENCH_RESULTS). Threads: all cores, or $CBCORE_BENCH_THREADS.
Every case checks its result against F.linear, so the file also fails on a wrong packed matmul.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from cbcore.linear import packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")

THREADS = int(os.environ.get("CBCORE_BENCH_THREADS", os.cpu_count() or 1))
RESULTS_DIR = Path(os.environ.get("CBCORE_BENCH_RESULTS", Path(__file__).resolve().parent / "results"))
COMMAND = "python -m pytest bench/test_bench_linear.py --benchmark-only -q"
PROJECTIONS = [(512, 512), (512, 256), (512, 1408), (1408, 512), (512, 8192)]  # (K, N)
ROWS = [64, 512]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LINEAR_RESULTS: dict[tuple, dict[str, float]] = {}
THREAD_RESULTS: dict[str, float] = {}


@pytest.fixture(autouse=True)
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k, n", PROJECTIONS)
@pytest.mark.parametrize("implementation", ["F.linear", "oneDNN packed"])
def test_linear(benchmark, implementation, k, n, rows, dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(rows, k, dtype=DTYPES[dtype])
    w = torch.randn(n, k, dtype=DTYPES[dtype]) / k**0.5
    if implementation == "F.linear":
        run = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
    else:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        run = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
    out = benchmark(run)
    tolerance = 1e-4 if dtype == "fp32" else 3e-2
    assert torch.allclose(out.float(), torch.nn.functional.linear(x, w).float(), rtol=tolerance, atol=tolerance)
    gflops = 2 * rows * k * n / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["gflops"] = gflops
    LINEAR_RESULTS.setdefault((dtype, rows, k, n), {})[implementation] = gflops


def _op_mix_seconds(iterations: int = 1500) -> float:
    x, w, a = torch.randn(64, 512), torch.randn(1408, 512), torch.randn(64, 1408)
    for _ in range(20):
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(iterations):
        torch.nn.functional.linear(x, w)
        torch.nn.functional.silu(a) * a
    return time.perf_counter() - start


@pytest.mark.parametrize("where", ["main thread", "new thread", "new thread, set_num_threads again"])
def test_threads(benchmark, where) -> None:
    count = torch.get_num_threads()

    def measure() -> float:
        if where == "main thread":
            return min(_op_mix_seconds() for _ in range(3))
        found: list[float] = []

        def body() -> None:
            if where.endswith("again"):
                torch.set_num_threads(count)
            found.append(min(_op_mix_seconds() for _ in range(3)))

        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        return found[0]

    seconds = benchmark.pedantic(measure, rounds=1, iterations=1)
    assert seconds > 0
    THREAD_RESULTS[where] = seconds


@pytest.fixture(scope="module", autouse=True)
def _write_report():
    yield
    if not LINEAR_RESULTS or not THREAD_RESULTS:
        return
    lines = [
        "# Linear layers and threads (CPU)",
        "",
        f"`{COMMAND}`, {THREADS} threads, torch {torch.__version__}. See the module docstring for the shapes.",
        "",
        "| dtype | M | K x N | F.linear GFLOP/s | oneDNN packed GFLOP/s | packed / F.linear |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for (dtype, rows, k, n), found in sorted(LINEAR_RESULTS.items()):
        if len(found) == 2:
            plain, packed = found["F.linear"], found["oneDNN packed"]
            lines.append(f"| {dtype} | {rows} | {k}x{n} | {plain:.0f} | {packed:.0f} | {packed / plain:.2f} |")
    base = THREAD_RESULTS.get("main thread")
    lines += ["", "| where the op mix runs | seconds | vs main thread |", "|---|---:|---:|"]
    for where, seconds in THREAD_RESULTS.items():
        lines.append(f"| {where} | {seconds:.2f} | {seconds / base:.2f}x |" if base else f"| {where} | {seconds:.2f} | |")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "linear_cpu.md").write_text("\n".join(lines) + "\n")
