"""Microbenchmarks behind the CPU choices of the engine (cbcore/linear.py and the loop thread's thread count):

1. Linear layers: `F.linear` (MKL in torch's x86 builds) against the oneDNN matmul on a weight reordered once
   (`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`) and cbcore's skinny matmul on its panels
   (`_C.skinny_pack` + `_C.skinny_matmul`, csrc/linear/skinny_gemm.cpp, in the best instruction set the CPU has:
   AVX-512 or AVX2; `PackedLinears` runs it where the CPU has AVX2 and FMA at least, else oneDNN's), on the shapes
   of a step of the bench's 32M Llama: M = rows of the step (16: a W3 decode step; 64: a W1 decode step; 512: a
   prefill chunk), K x N = the model's projections
   (512x512 q/o, 512x256 k/v, 512x1408 gate/up, 1408x512 down, 512x8192 lm_head). The weight is the same every call,
   so it stays in cache where it fits. GFLOP/s = 2 M K N / time. fp32 and bf16.
2. A W4 decode step's linears, weights cold: the default model's (SmolLM2-135M) 30 layers of merged q/k/v
   (576x960), o (576x576), merged gate/up (576x3072) and down (1536x576), then its 576x49152 LM head, one call each
   in that order (538 MB of fp32 weights, 269 MB of bf16: none stays in the 32 MB L3 between steps), at 16 rows
   (W4's average decode batch) and 64. oneDNN and the skinny matmul alternate, 9 rounds, medians; GB/s = the
   weights' bytes / time, to set against the machine's read bandwidth (~25-30 GB/s,
   bench/results/kernels_cpu.md).
3. Threads: the same small op mix (a 64x512x1408 linear and a SiLU-multiply) timed in the main thread, in a freshly
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

from cbcore.linear_backends import onednn_packs, packing_available
from cbcore.benchmarks.machine import cpu_model

try:
    from cbcore import _C
except ImportError:  # pragma: no cover - the package is built before the bench runs
    _C = None

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")

THREADS = int(os.environ.get("CBCORE_BENCH_THREADS", os.cpu_count() or 1))
RESULTS_DIR = Path(os.environ.get("CBCORE_BENCH_RESULTS", Path(__file__).resolve().parent / "results"))
COMMAND = "python -m pytest bench/test_bench_linear.py --benchmark-only -q"
PROJECTIONS = [(512, 512), (512, 256), (512, 1408), (1408, 512), (512, 8192)]  # (K, N)
ROWS = [16, 64, 512]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLEMENTATIONS = ["F.linear", "oneDNN packed", "skinny"]
W4_PROJECTIONS = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N) per layer, 30 layers
W4_LM_HEAD = (576, 49152)
LINEAR_RESULTS: dict[tuple, dict[str, float]] = {}
STEP_RESULTS: dict[tuple, dict[str, tuple[float, float, float]]] = {}  # (dtype, rows) -> impl -> (ms, GFLOP/s, GB/s)
THREAD_RESULTS: dict[str, float] = {}


def _skinny_available(dtype: torch.dtype) -> bool:
    return _C is not None and hasattr(_C, "skinny_available") and _C.skinny_available(dtype)


@pytest.fixture(autouse=True)
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k, n", PROJECTIONS)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_linear(benchmark, implementation, k, n, rows, dtype) -> None:
    if implementation == "skinny" and not _skinny_available(DTYPES[dtype]):
        pytest.skip(f"this CPU has no skinny matmul for {dtype}")
    if implementation == "oneDNN packed" and not onednn_packs(DTYPES[dtype]):
        pytest.skip(f"oneDNN packs no {dtype} weight on this CPU")
    torch.manual_seed(0)
    x = torch.randn(rows, k, dtype=DTYPES[dtype])
    w = torch.randn(n, k, dtype=DTYPES[dtype]) / k**0.5
    if implementation == "F.linear":
        run = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
    elif implementation == "skinny":
        panels = _C.skinny_pack(w)
        run = lambda: _C.skinny_matmul(x, panels, n)  # noqa: E731
    else:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        run = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
    out = benchmark(run)
    tolerance = 1e-4 if dtype == "fp32" else 3e-2
    assert torch.allclose(out.float(), torch.nn.functional.linear(x, w).float(), rtol=tolerance, atol=tolerance)
    gflops = 2 * rows * k * n / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["gflops"] = gflops
    LINEAR_RESULTS.setdefault((dtype, rows, k, n), {})[implementation] = gflops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [16, 64])
def test_w4_decode_step_linears(benchmark, rows, dtype) -> None:
    if not _skinny_available(DTYPES[dtype]):
        pytest.skip(f"this CPU has no skinny matmul for {dtype}")
    torch.manual_seed(0)
    shapes = W4_PROJECTIONS * 30 + [W4_LM_HEAD]
    weights = [torch.randn(n, k, dtype=DTYPES[dtype]) / k**0.5 for k, n in shapes]
    inputs = {k: torch.randn(rows, k, dtype=DTYPES[dtype]) for k, _ in shapes}
    panels = [_C.skinny_pack(w) for w in weights]
    if onednn_packs(DTYPES[dtype]):
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        baseline = lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")  # noqa
                            for w, p in zip(weights, onednn)]
    else:  # what cbcore would run without the skinny matmul
        baseline = lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights]  # noqa: E731
    runs = {
        "baseline": baseline,
        "skinny": lambda: [_C.skinny_matmul(inputs[w.shape[1]], p, w.shape[0]) for w, p in zip(weights, panels)],
    }
    tolerance = 1e-4 if dtype == "fp32" else 3e-2
    for name, run in runs.items():  # also the warm-up
        out = run()
        for i in (0, 3, len(weights) - 1):
            expected = torch.nn.functional.linear(inputs[weights[i].shape[1]], weights[i])
            assert torch.allclose(out[i].float(), expected.float(), rtol=tolerance, atol=tolerance), (name, i)

    def measure() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(9):  # interleaved: the machine drifts between runs
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        return times

    times = benchmark.pedantic(measure, rounds=1, iterations=1)
    flops = sum(2 * rows * w.numel() for w in weights)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    for name, found in times.items():
        median = sorted(found)[len(found) // 2]
        STEP_RESULTS.setdefault((dtype, rows), {})[name] = (median * 1e3, flops / median / 1e9, nbytes / median / 1e9)


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
    isas = ", ".join(f"{name} {_C.skinny_isa(dtype)}" for name, dtype in DTYPES.items()) if _C is not None else "-"
    onednn_dtypes = [name for name, dtype in DTYPES.items() if onednn_packs(dtype)]
    lines = [
        "# Linear layers and threads (CPU)",
        "",
        f"`{COMMAND}`, {THREADS} threads, torch {torch.__version__}, {cpu_model()}; skinny matmul: {isas}; oneDNN "
        f"packs: {', '.join(onednn_dtypes) or 'nothing'}. See the module docstring for the shapes.",
        "",
        "| dtype | M | K x N | F.linear GFLOP/s | oneDNN packed GFLOP/s | skinny GFLOP/s | oneDNN / F.linear | "
        "skinny / oneDNN (/ F.linear where no oneDNN) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (dtype, rows, k, n), found in sorted(LINEAR_RESULTS.items()):
        if "F.linear" in found:
            plain, packed, skinny = found["F.linear"], found.get("oneDNN packed"), found.get("skinny")
            base = packed or plain
            skinny_gflops, skinny_ratio = (f"{skinny:.0f}", f"{skinny / base:.2f}") if skinny else ("-", "-")
            packed_gflops, packed_ratio = (f"{packed:.0f}", f"{packed / plain:.2f}") if packed else ("-", "-")
            lines.append(f"| {dtype} | {rows} | {k}x{n} | {plain:.0f} | {packed_gflops} | {skinny_gflops} | "
                         f"{packed_ratio} | {skinny_ratio} |")
    if STEP_RESULTS:
        lines += ["", "A W4 decode step's linears, weights cold (median of 9 interleaved rounds; the baseline is "
                  "oneDNN's packed matmul, F.linear where oneDNN packs no weight of the dtype):", "",
                  "| dtype | M | baseline | ms | GFLOP/s | GB/s | skinny ms | skinny GFLOP/s | skinny GB/s | "
                  "baseline / skinny time |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for (dtype, rows), found in sorted(STEP_RESULTS.items()):
            (a_ms, a_gf, a_gb), (b_ms, b_gf, b_gb) = found["baseline"], found["skinny"]
            name = "oneDNN" if dtype in onednn_dtypes else "F.linear"
            lines.append(f"| {dtype} | {rows} | {name} | {a_ms:.1f} | {a_gf:.0f} | {a_gb:.1f} | {b_ms:.1f} | "
                         f"{b_gf:.0f} | {b_gb:.1f} | {a_ms / b_ms:.2f}x |")
    base = THREAD_RESULTS.get("main thread")
    lines += ["", "| where the op mix runs | seconds | vs main thread |", "|---|---:|---:|"]
    for where, seconds in THREAD_RESULTS.items():
        lines.append(f"| {where} | {seconds:.2f} | {seconds / base:.2f}x |" if base else f"| {where} | {seconds:.2f} | |")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "linear_cpu.md").write_text("\n".join(lines) + "\n")
