"""Microbenchmarks: the C++ CPU attention kernels (cbcore._C), per instruction set, against the plain-torch references
and this machine's memory bandwidth measured in the same run.

Shapes (every request's pages scattered in shuffled block order, as a long-running cache leaves them; the caches
mapped as the engine maps its own):
- decode: head shapes `9/3x64` (SmolLM2-135M: 9 query heads over 3 kv heads, head_dim 64) and `32/8x128` (a 7-8B
  Llama: 32 over 8, head_dim 128); batch x context 32x1024 and 64x2048; page size 16; fp32 and bf16.
    GB/s = bytes of K and V the op must read / time = batch x context x kv_heads x head_dim x 2 (K, V) x bytes per
    element; tokens/s = batch / time (one layer's decode of the step). The query, block table and output are
    negligible beside them.
- cascade: W2's step shape (`python -m cbcore bench --workload W2`'s random Llama: 8 query heads over 4 kv heads,
  head_dim 64, the default page size 256): 64 requests sharing a 512-token prefix (the same two physical pages in
  every block table, as prefix sharing leaves them) plus 16..64 own prompt tokens and 0..63 generated ones. One
  layer's decode attention with the step's plan built beforehand (as every layer but the first reuses it):
  `cascade` (the plan groups the 64) against `plain` (`plan_decode(..., cascade=False)`); with the layer's pages
  left in the L3 between calls (`cached`) and flushed before each (`flushed`, as the step's other layers leave
  them). And the decode of the requests' own keys alone, flushed: many short requests read from DRAM.
- prefill: 9/3x64, whole prompts packed (cu_seqlens), causal: batch x prompt 1x512, 4x1024, 2x2048; and W2's
  prefill after its prefix hit (8/4x64): 16 requests x 40 own tokens after 512 cached keys.
    GFLOP/s = 4 x heads x head_dim x (visible (query, key) pairs) / time; a prompt of L tokens has L(L+1)/2 visible
    pairs, a chunk of q queries after p cached keys q p + q(q+1)/2 (2 flops per multiply-add, once for QK^T and once
    for PV; masked pairs and the softmax are not counted).
- machine: `x.sum()` over 256 MiB fp32 (bytes read / time) and `y.copy_(x)` (bytes read + written / time), torch's own
    vectorised kernels on all threads: the practical read-bandwidth ceiling for decode. The fp32 decode's share of it
    is also timed with the two alternating (`test_decode_share_interleaved`): what two cores of these VMs read moves
    by up to 2x from minute to minute.

Implementations: `cpp-<isa>` for every instruction set this CPU runs (`cbcore.ops.cpu_isas()`: generic, avx2, avx512,
avx512_bf16, avx512_amx; the last is what cbcore.ops uses on the machine), `reference` the plain-torch specification
(cbcore.ops.*_reference; on the smaller shapes only, it is 10-100x slower).

Threads: all cores (torch.set_num_threads(os.cpu_count())), or $CBCORE_BENCH_THREADS. On a busy machine,
`CBCORE_BENCH_THREADS=1 ... --benchmark-timer time.thread_time` times the calling thread's CPU time, on which the
kernels then run alone (the report says which timer ran). Run it (`bench/` is not in the
default test paths) and keep the JSON; the module also writes bench/results/kernels_cpu.md:

    python -m pytest bench/test_bench_kernels.py --benchmark-only --benchmark-json bench/results/kernels_cpu.json
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from cbcore import ContinuousBatchingConfig, ops
from cbcore.benchmarks.machine import cpu_model, last_level_cache_bytes
from cbcore.cache import zeroed_pages

_C = ops.cpu_kernels()
pytestmark = pytest.mark.skipif(_C is None, reason="cbcore._C was built without the CPU attention kernels")

PAGE_SIZE = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEAD_SHAPES = {"9/3x64": (9, 3, 64), "32/8x128": (32, 8, 128)}  # heads, kv heads, head dim
DECODE_SHAPES = [(32, 1024), (64, 2048)]  # (batch, context)
PREFILL_SHAPES = [(1, 512), (4, 1024), (2, 2048)]  # (batch, prompt length)
W2_PREFILL_BATCH, W2_PREFILL_QUERIES = 16, 40  # W2's prefill after its prefix hit: 40 own tokens after W2_PREFIX
ISAS = ops.cpu_isas()
IMPLEMENTATIONS = [f"cpp-{isa}" for isa in ISAS] + ["reference"]
PREFILL_IMPLEMENTATIONS = [f"cpp-{isa}" for isa in ISAS if isa != "generic"] + ["reference"]
THREADS = int(os.environ.get("CBCORE_BENCH_THREADS", os.cpu_count() or 1))
RESULTS_DIR = Path(os.environ.get("CBCORE_BENCH_RESULTS", Path(__file__).resolve().parent / "results"))
COMMAND = "python -m pytest bench/test_bench_kernels.py --benchmark-only --benchmark-json bench/results/kernels_cpu.json"
# W2 (cbcore/benchmarks/workloads.py and models.py): the random Llama's attention and the shared prefix.
W2_HEADS, W2_KV_HEADS, W2_HEAD_DIM, W2_PAGE, W2_BATCH, W2_PREFIX = 8, 4, 64, 256, 64, 512

ROWS: list[dict] = []


@pytest.fixture(autouse=True)
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(previous)
    _C._set_cpu_attention_isa("auto")


def engine_cache(values: torch.Tensor) -> torch.Tensor:
    """`values` in memory mapped as the engine maps its cache (cbcore.cache.zeroed_pages), so that the kernels meet
    the page sizes (TLB behaviour) they meet in a step."""
    pages = zeroed_pages(tuple(values.shape), values.dtype, values.device)
    pages.copy_(values)
    return pages


def paged_inputs(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 num_queries: int, seed: int = 0, page_size: int = PAGE_SIZE):
    """Caches with each request's blocks shuffled through the whole cache, the block table, and queries."""
    generator = torch.Generator().manual_seed(seed)
    blocks = batch * (-(-context // page_size))
    shape = (blocks, page_size, kv_heads, head_dim)
    k_cache, v_cache = engine_cache(torch.randn(shape, generator=generator).to(dtype)), engine_cache(
        torch.randn(shape, generator=generator).to(dtype))
    table = torch.randperm(blocks, generator=generator).view(batch, -1).to(torch.int32)
    q = torch.randn(num_queries, heads, head_dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, table


def run_and_time(benchmark, fn, slow: bool) -> float:
    """Median seconds per call; the reference gets fewer rounds."""
    rounds, iterations = (3, 1) if slow else (10, 3)
    benchmark.pedantic(fn, rounds=rounds, iterations=iterations, warmup_rounds=1)
    return benchmark.stats.stats.median


# Bytes flush_caches() writes: twice the last-level cache, at least 64 MiB, at most 2 GiB. A fixed 64 MiB (twice
# a Zen 4's 32 MiB L3) left W2's layer mostly in the 480 MiB L3 of a Xeon this ran on: its plain decode took 1.04 ms
# after 64 MiB, 1.21 after 256 and 1.39 after 1 GiB (1.00 with nothing written).
FLUSH_BYTES = min(max(2 * (last_level_cache_bytes() or 0), 64 * 2**20), 2 * 2**30)
_FLUSH: list[torch.Tensor] = []


def flush_caches() -> None:
    """Writes FLUSH_BYTES: what the other layers' weights and pages do to a layer's pages between its steps. Each
    layer's K/V then comes from DRAM, as in a real decode step."""
    if not _FLUSH:
        _FLUSH.append(torch.ones(FLUSH_BYTES // 4))
    _FLUSH[0].add_(1.0)


def run_and_time_flushed(benchmark, fn) -> float:
    """Median seconds per call, each call after flush_caches() (not timed)."""
    benchmark.pedantic(fn, setup=flush_caches, rounds=15, iterations=1, warmup_rounds=1)
    return benchmark.stats.stats.median


def on_isa(implementation: str, fn):
    """fn, run with the kernels' copy for `cpp-<isa>`."""
    isa = implementation.removeprefix("cpp-")

    def run():
        _C._set_cpu_attention_isa(isa)
        return fn()
    return run


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("batch", "context"), DECODE_SHAPES, ids=[f"{b}x{c}" for b, c in DECODE_SHAPES])
@pytest.mark.parametrize("head_shape", list(HEAD_SHAPES))
def test_decode(benchmark, head_shape, batch, context, dtype, implementation) -> None:
    heads, kv_heads, head_dim = HEAD_SHAPES[head_shape]
    if implementation == "reference" and (batch, context, head_shape) != (32, 1024, "9/3x64"):
        pytest.skip("the reference runs on the smallest shape only (seconds per call beyond it)")
    q, k_cache, v_cache, table = paged_inputs(batch, context, heads, kv_heads, head_dim, DTYPES[dtype], batch)
    lens = torch.full((batch,), context, dtype=torch.int32)
    scale = head_dim**-0.5
    if implementation == "reference":
        fn = lambda: ops.decode_attention_reference(q, k_cache, v_cache, table, lens, scale)  # noqa: E731
    else:
        fn = on_isa(implementation, lambda: _C.decode_attention(q, k_cache, v_cache, table, lens, scale, -1))
    seconds = run_and_time(benchmark, fn, slow=implementation == "reference")
    bytes_read = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
    benchmark.extra_info.update(op="decode", heads=head_shape, batch=batch, context=context, dtype=dtype,
                                implementation=implementation, threads=THREADS, bytes_read=bytes_read,
                                gb_per_s=bytes_read / seconds / 1e9, tokens_per_s=batch / seconds)
    ROWS.append(dict(benchmark.extra_info, ms=seconds * 1e3))


SHARE_ROUNDS, SHARE_CALLS = 15, 5
ENGINE_PAGE_SIZE = ContinuousBatchingConfig().page_size  # the engine's default (256)


@pytest.mark.parametrize("page_size", [PAGE_SIZE, ENGINE_PAGE_SIZE])
@pytest.mark.parametrize(("batch", "context"), DECODE_SHAPES, ids=[f"{b}x{c}" for b, c in DECODE_SHAPES])
@pytest.mark.parametrize("head_shape", list(HEAD_SHAPES))
def test_decode_share_interleaved(benchmark, head_shape, batch, context, page_size) -> None:
    """The fp32 decode's share of `sum`'s read bandwidth with the two alternating, on the kernels cbcore uses here:
    each round times SHARE_CALLS decode calls, then as many `sum`s over 256 MiB, and takes the ratio of their GB/s
    (medians). On the 2-vCPU VMs this runs on, what two cores can read moved between ~40 and ~85 GB/s from minute to
    minute (one core's stayed ~41), so a share against a `sum` timed minutes away says more about the machine than
    about the kernel. At the bench's pages of 16 tokens and at the engine's default of 256 (longer runs of each
    request's rows between jumps)."""
    heads, kv_heads, head_dim = HEAD_SHAPES[head_shape]
    q, k_cache, v_cache, table = paged_inputs(batch, context, heads, kv_heads, head_dim, torch.float32, batch,
                                              page_size=page_size)
    lens = torch.full((batch,), context, dtype=torch.int32)
    bytes_read = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
    x = torch.ones(64 * 2**20)
    decode = lambda: _C.decode_attention(q, k_cache, v_cache, table, lens, head_dim**-0.5, -1)  # noqa: E731

    def median_gb_per_s(fn, nbytes: int) -> float:
        times = []
        for _ in range(SHARE_CALLS):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return nbytes / statistics.median(times) / 1e9

    rounds: list[tuple[float, float]] = []

    def one_round() -> None:
        rounds.append((median_gb_per_s(decode, bytes_read), median_gb_per_s(x.sum, x.numel() * 4)))

    one_round()  # warm-up
    rounds.clear()
    benchmark.pedantic(one_round, rounds=SHARE_ROUNDS, iterations=1)
    shares = [d / m for d, m in rounds]
    benchmark.extra_info.update(op="decode share interleaved", heads=head_shape, batch=batch, context=context,
                                page_size=page_size, dtype="fp32", implementation=f"cpp-{ISAS[-1]}", threads=THREADS,
                                share_median=statistics.median(shares), share_min=min(shares),
                                share_max=max(shares), decode_gb_per_s=statistics.median(d for d, _ in rounds),
                                sum_gb_min=min(m for _, m in rounds), sum_gb_max=max(m for _, m in rounds))
    ROWS.append(dict(benchmark.extra_info))


def w2_step(dtype: torch.dtype, seed: int = 0):
    """W2's decode step: 64 requests, blocks 0 and 1 (the 512-token prefix) shared by all, their own blocks after."""
    generator = torch.Generator().manual_seed(seed)
    own = torch.randint(16, 65, (W2_BATCH,), generator=generator) + torch.randint(0, 64, (W2_BATCH,),
                                                                                  generator=generator)
    lens = (W2_PREFIX + own).to(torch.int32)
    shared = W2_PREFIX // W2_PAGE
    per_request = [-(-int(n) // W2_PAGE) - shared for n in lens]
    num_blocks = shared + sum(per_request) + 1
    order = torch.randperm(num_blocks, generator=generator)
    width = shared + max(per_request)
    table = torch.zeros(W2_BATCH, width, dtype=torch.int32)
    next_block = shared
    for i, count in enumerate(per_request):
        ids = list(range(shared)) + list(range(next_block, next_block + count))
        next_block += count
        table[i, :len(ids)] = order[torch.tensor(ids)].to(torch.int32)
    shape = (num_blocks, W2_PAGE, W2_KV_HEADS, W2_HEAD_DIM)
    k_cache, v_cache = engine_cache(torch.randn(shape, generator=generator).to(dtype)), engine_cache(
        torch.randn(shape, generator=generator).to(dtype))
    q = torch.randn(W2_BATCH, W2_HEADS, W2_HEAD_DIM, generator=generator).to(dtype)
    return q, k_cache, v_cache, table, lens


@pytest.mark.parametrize("residency", ["cached", "flushed"])
@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != "generic"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", ["plain", "cascade"])
def test_cascade_w2(benchmark, variant, dtype, isa, residency) -> None:
    """cached: the same layer called again and again, its ~10 MB of pages (fp32) staying in the L3; flushed: the
    caches flushed before each call, as the step's other layers leave them."""
    q, k_cache, v_cache, table, lens = w2_step(DTYPES[dtype])
    plan = _C.plan_decode(table, lens, k_cache.shape[0], W2_PAGE, W2_KV_HEADS, W2_HEADS, -1, variant == "cascade")
    assert (len(plan.cascade_groups) == 1) == (variant == "cascade")
    out = torch.empty(W2_BATCH, W2_HEADS, W2_HEAD_DIM, dtype=DTYPES[dtype])
    scale = W2_HEAD_DIM**-0.5
    fn = on_isa(f"cpp-{isa}", lambda: _C.decode_attention_planned(plan, q, k_cache, v_cache, scale, 0.0, None, out))
    seconds = run_and_time(benchmark, fn, slow=False) if residency == "cached" else run_and_time_flushed(benchmark, fn)
    benchmark.extra_info.update(op="cascade", variant=variant, dtype=dtype, implementation=f"cpp-{isa}",
                                residency=residency, threads=THREADS, keys=int(lens.sum()))
    ROWS.append(dict(benchmark.extra_info, ms=seconds * 1e3))


INTERLEAVED_ROUNDS, INTERLEAVED_CALLS = 15, 10


@pytest.mark.parametrize("residency", ["cached", "flushed"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cascade_w2_interleaved(benchmark, dtype, residency) -> None:
    """cascade / plain on W2's step with the two alternating, on the kernels cbcore uses here (the best ISA): each
    round times INTERLEAVED_CALLS calls of the plain decode, then as many of the cascade, and takes the ratio of their
    medians; the report gives the median, min and max over INTERLEAVED_ROUNDS rounds. test_cascade_w2's rows run
    seconds apart on a machine whose speed moves by ±15% in that time, so their ratio moves with it."""
    q, k_cache, v_cache, table, lens = w2_step(DTYPES[dtype])
    plans = {variant: _C.plan_decode(table, lens, k_cache.shape[0], W2_PAGE, W2_KV_HEADS, W2_HEADS, -1,
                                     variant == "cascade") for variant in ("plain", "cascade")}
    out = torch.empty(W2_BATCH, W2_HEADS, W2_HEAD_DIM, dtype=DTYPES[dtype])
    scale = W2_HEAD_DIM**-0.5
    ratios: list[float] = []

    def median_call(variant: str) -> float:
        times = []
        for _ in range(INTERLEAVED_CALLS):
            if residency == "flushed":
                flush_caches()
            start = time.perf_counter()
            _C.decode_attention_planned(plans[variant], q, k_cache, v_cache, scale, 0.0, None, out)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def one_round() -> None:
        plain = median_call("plain")
        ratios.append(median_call("cascade") / plain)

    one_round()  # warm-up: the pages, the kernels' scratch
    ratios.clear()
    benchmark.pedantic(one_round, rounds=INTERLEAVED_ROUNDS, iterations=1)
    benchmark.extra_info.update(op="cascade interleaved", dtype=dtype, implementation=f"cpp-{ISAS[-1]}",
                                residency=residency, threads=THREADS, ratio_median=statistics.median(ratios),
                                ratio_min=min(ratios), ratio_max=max(ratios))
    ROWS.append(dict(benchmark.extra_info))


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != "generic"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decode_w2_own_keys(benchmark, dtype, isa) -> None:
    """The decode of W2's requests' own keys alone (16..127 a request, after the prefix the cascade attends), the
    caches flushed before each call: many short requests, read from DRAM."""
    q, k_cache, v_cache, table, lens = w2_step(DTYPES[dtype])
    shared = W2_PREFIX // W2_PAGE
    table, lens = table[:, shared:].contiguous(), (lens - W2_PREFIX).to(torch.int32)
    plan = _C.plan_decode(table, lens, k_cache.shape[0], W2_PAGE, W2_KV_HEADS, W2_HEADS, -1, False)
    out = torch.empty(W2_BATCH, W2_HEADS, W2_HEAD_DIM, dtype=DTYPES[dtype])
    scale = W2_HEAD_DIM**-0.5
    fn = on_isa(f"cpp-{isa}", lambda: _C.decode_attention_planned(plan, q, k_cache, v_cache, scale, 0.0, None, out))
    seconds = run_and_time_flushed(benchmark, fn)
    bytes_read = int(lens.sum()) * W2_KV_HEADS * W2_HEAD_DIM * 2 * k_cache.element_size()
    benchmark.extra_info.update(op="decode own keys", dtype=dtype, implementation=f"cpp-{isa}", threads=THREADS,
                                bytes_read=bytes_read, gb_per_s=bytes_read / seconds / 1e9)
    ROWS.append(dict(benchmark.extra_info, ms=seconds * 1e3))


def time_prefill(benchmark, head_shape: tuple[int, int, int], batch: int, queries: int, context: int, dtype: str,
                 implementation: str) -> None:
    """One prefill call of `batch` requests, each `queries` new tokens ending a context of `context` keys (a whole
    prompt when the two are equal); records its time and GFLOP/s over the visible (query, key) pairs in ROWS."""
    heads, kv_heads, head_dim = head_shape
    q, k_cache, v_cache, table = paged_inputs(batch, context, heads, kv_heads, head_dim, DTYPES[dtype],
                                              batch * queries)
    lens = torch.full((batch,), context, dtype=torch.int32)
    cu = torch.arange(0, batch * queries + 1, queries, dtype=torch.int32)
    scale = head_dim**-0.5
    if implementation == "reference":
        fn = lambda: ops.prefill_attention_reference(q, k_cache, v_cache, table, cu, lens, scale)  # noqa: E731
    else:
        fn = on_isa(implementation, lambda: _C.prefill_attention(q, k_cache, v_cache, table, cu, lens, scale, -1))
    seconds = run_and_time(benchmark, fn, slow=True)
    cached = context - queries
    flops = 4 * heads * head_dim * batch * (queries * cached + queries * (queries + 1) // 2)
    benchmark.extra_info.update(op="prefill", heads=f"{heads}/{kv_heads}x{head_dim}", batch=batch, context=context,
                                queries=queries, dtype=dtype, implementation=implementation, threads=THREADS,
                                flops=flops, gflop_per_s=flops / seconds / 1e9)
    ROWS.append(dict(benchmark.extra_info, ms=seconds * 1e3))


@pytest.mark.parametrize("implementation", PREFILL_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("batch", "context"), PREFILL_SHAPES, ids=[f"{b}x{c}" for b, c in PREFILL_SHAPES])
def test_prefill(benchmark, batch, context, dtype, implementation) -> None:
    if implementation == "reference" and context > 1024:
        pytest.skip("the reference runs on the smaller shapes only")
    time_prefill(benchmark, HEAD_SHAPES["9/3x64"], batch, context, context, dtype, implementation)


@pytest.mark.parametrize("implementation", PREFILL_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_after_prefix_w2(benchmark, dtype, implementation) -> None:
    """W2's prefill once its prefix is cached: each request's own tokens against the prefix and themselves."""
    time_prefill(benchmark, (W2_HEADS, W2_KV_HEADS, W2_HEAD_DIM), W2_PREFILL_BATCH, W2_PREFILL_QUERIES,
                 W2_PREFIX + W2_PREFILL_QUERIES, dtype, implementation)


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


def _targets(rows: list[dict], bandwidth: float | None) -> list[str]:
    """The issue's targets and how far each is, from this run's rows."""
    best = f"cpp-{ISAS[-1]}"
    lines = ["## Targets (this run)", ""]
    decode = {(r["heads"], r["batch"], r["context"], r["dtype"], r["implementation"]): r for r in rows
              if r["op"] == "decode"}
    if bandwidth:
        for (heads, batch, context, dtype, implementation), r in sorted(decode.items()):
            if implementation == best and dtype == "fp32":
                lines.append(f"- fp32 decode >= 90% of the read bandwidth, {heads} {batch}x{context}: "
                             f"{r['gb_per_s']:.1f} GB/s = {100 * r['gb_per_s'] / bandwidth:.0f}% of {bandwidth:.1f} "
                             f"({'met' if r['gb_per_s'] >= 0.9 * bandwidth else 'not met'})")
    for (heads, batch, context, dtype, implementation), r in sorted(decode.items()):
        if implementation == best and dtype == "bf16":
            fp32 = decode.get((heads, batch, context, "fp32", implementation))
            if fp32:
                ratio = r["tokens_per_s"] / fp32["tokens_per_s"]
                lines.append(f"- bf16 decode tokens/s >= fp32's, {heads} {batch}x{context}: {ratio:.2f}x "
                             f"({'met' if ratio >= 1 else 'not met'})")
    for r in rows:
        if r["op"] == "decode share interleaved":
            shape = f"{r['heads']} {r['batch']}x{r['context']}, pages of {r['page_size']}"
            lines.append(f"- fp32 decode >= 90% of the read bandwidth, interleaved with `sum`, {shape}: "
                         f"{100 * r['share_median']:.0f}% (rounds {100 * r['share_min']:.0f}-"
                         f"{100 * r['share_max']:.0f}%, `sum` {r['sum_gb_min']:.0f}-{r['sum_gb_max']:.0f} GB/s; "
                         f"{'met' if r['share_median'] >= 0.9 else 'not met'})")
    cascade = {(r["variant"], r["dtype"], r["implementation"], r.get("residency", "cached")): r["ms"] for r in rows
               if r["op"] == "cascade"}
    for residency in ("cached", "flushed"):
        for dtype in DTYPES:
            for isa in ISAS:
                plain = cascade.get(("plain", dtype, f"cpp-{isa}", residency))
                casc = cascade.get(("cascade", dtype, f"cpp-{isa}", residency))
                if plain and casc:
                    lines.append(f"- cascade <= 0.4x plain on W2's step, {residency}, {dtype} cpp-{isa}: "
                                 f"{casc / plain:.2f}x ({'met' if casc <= 0.4 * plain else 'not met'})")
            pre = cascade.get(("plain", dtype, "cpp-avx2", residency))
            casc = cascade.get(("cascade", dtype, best, residency))
            if pre and casc:
                lines.append(f"- cascade ({best}) against the plain decode cbcore had before AVX-512 and cascade "
                             f"(cpp-avx2), {residency}, {dtype}: {casc / pre:.2f}x "
                             f"({'met' if casc <= 0.4 * pre else 'not met'})")
    for r in rows:
        if r["op"] == "cascade interleaved":
            lines.append(f"- cascade <= 0.4x plain on W2's step, interleaved, {r['residency']}, {r['dtype']} "
                         f"{r['implementation']}: {r['ratio_median']:.2f}x (rounds {r['ratio_min']:.2f}-"
                         f"{r['ratio_max']:.2f}x; {'met' if r['ratio_median'] <= 0.4 else 'not met'})")
    return lines + [""]


@pytest.fixture(scope="module", autouse=True)
def _write_report(request):
    yield
    if not ROWS:
        return
    memory = {r["op"]: r["gb_per_s"] for r in ROWS if r["op"].startswith("memory")}
    read = memory.get("memory sum")
    lines = [
        "# CPU attention kernels: C++ per instruction set, against the reference and the machine's bandwidth",
        "",
        f"- hardware: {hardware()}",
        f"- decode: heads {', '.join(HEAD_SHAPES)} (query/kv heads x head dim), page size {PAGE_SIZE}, pages "
        f"shuffled; batch x context {', '.join(f'{b}x{c}' for b, c in DECODE_SHAPES)}",
        "- K/V caches: mapped as the engine maps its own (cbcore.cache.zeroed_pages)",
        f"- cascade: W2's step, {W2_BATCH} requests sharing a {W2_PREFIX}-token prefix (page size {W2_PAGE}) + "
        f"16..64 own prompt tokens + 0..63 generated, heads {W2_HEADS}/{W2_KV_HEADS}x{W2_HEAD_DIM}; one layer's "
        "planned decode, plan built beforehand",
        f"- prefill: heads 9/3x64, batch x prompt {', '.join(f'{b}x{c}' for b, c in PREFILL_SHAPES)}; W2's after "
        f"its prefix hit, heads {W2_HEADS}/{W2_KV_HEADS}x{W2_HEAD_DIM}, {W2_PREFILL_BATCH} requests x "
        f"{W2_PREFILL_QUERIES} queries after {W2_PREFIX} cached keys",
        "- counts: decode GB/s = K+V bytes read / median time, % = of this run's `sum` read bandwidth, tokens/s = "
        "batch / median time; prefill GFLOP/s = 4 x heads x head_dim x causal (query, key) pairs / median time; "
        "memory = torch sum (read) and copy (read + write) of 256 MiB",
        f"- command: `{COMMAND}`" + (f" with CBCORE_BENCH_THREADS={THREADS}" if "CBCORE_BENCH_THREADS" in os.environ
                                      else ""),
        f"- timer: {request.config.getoption('benchmark_timer', None) or 'time.perf_counter'} (pytest-benchmark's "
        "--benchmark-timer; time.thread_time counts the calling thread's CPU time only, so with one thread it leaves "
        "out the time other work on the machine takes the core)",
        "- the machine is shared with other work: absolute figures move by up to ±30% between runs; ratios are "
        "between rows of this one run",
        "",
    ]
    lines += _targets(ROWS, read)
    lines += ["## Decode", "", "| heads | batch x context | dtype | implementation | ms | GB/s | % of read bw | "
              "tokens/s |", "|---|---|---|---|---|---|---|---|"]
    order = {name: i for i, name in enumerate(IMPLEMENTATIONS)}
    for r in sorted((r for r in ROWS if r["op"] == "decode"),
                    key=lambda r: (r["heads"], r["batch"] * r["context"], r["dtype"], order[r["implementation"]])):
        share = f"{100 * r['gb_per_s'] / read:.0f}%" if read else ""
        lines.append(f"| {r['heads']} | {r['batch']}x{r['context']} | {r['dtype']} | {r['implementation']} | "
                     f"{r['ms']:.2f} | {r['gb_per_s']:.1f} | {share} | {r['tokens_per_s']:.0f} |")
    shares = [r for r in ROWS if r["op"] == "decode share interleaved"]
    if shares:
        lines += ["", f"Interleaved with `sum` (`test_decode_share_interleaved`, fp32, {shares[0]['implementation']}): "
                  f"{SHARE_ROUNDS} rounds of {SHARE_CALLS} decode calls then {SHARE_CALLS} `sum`s over 256 MiB, the "
                  "ratio of their GB/s per round.", "",
                  "| heads | batch x context | page | decode GB/s | share of `sum`, median | min | max | `sum` GB/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sorted(shares, key=lambda r: (r["heads"], r["batch"] * r["context"], r["page_size"])):
            lines.append(f"| {r['heads']} | {r['batch']}x{r['context']} | {r['page_size']} | "
                         f"{r['decode_gb_per_s']:.1f} | "
                         f"{100 * r['share_median']:.0f}% | {100 * r['share_min']:.0f}% | "
                         f"{100 * r['share_max']:.0f}% | {r['sum_gb_min']:.0f}-{r['sum_gb_max']:.0f} |")
    lines += ["", "## Cascade on W2's step", "",
              "cached: the layer's pages stay in the L3 between calls; flushed: "
              f"{FLUSH_BYTES // 2**20} MiB (twice the last-level cache) written before each call, so they come from "
              "DRAM, as after a step's other layers on a CPU whose cache they overflow.", "",
              "| pages | dtype | implementation | plain ms | cascade ms | cascade / plain |", "|---|---|---|---|---|---|"]
    cascade = {(r["variant"], r["dtype"], r["implementation"], r.get("residency", "cached")): r["ms"] for r in ROWS
               if r["op"] == "cascade"}
    for residency in ("cached", "flushed"):
        for dtype in DTYPES:
            for isa in ISAS:
                plain = cascade.get(("plain", dtype, f"cpp-{isa}", residency))
                casc = cascade.get(("cascade", dtype, f"cpp-{isa}", residency))
                if plain and casc:
                    lines.append(f"| {residency} | {dtype} | cpp-{isa} | {plain:.3f} | {casc:.3f} | "
                                 f"{casc / plain:.2f}x |")
    interleaved = [r for r in ROWS if r["op"] == "cascade interleaved"]
    if interleaved:
        lines += ["", f"Interleaved (`test_cascade_w2_interleaved`): {INTERLEAVED_ROUNDS} rounds of "
                  f"{INTERLEAVED_CALLS} plain calls then {INTERLEAVED_CALLS} cascade calls, the ratio of their medians "
                  "per round.", "", "| pages | dtype | implementation | cascade / plain, median | min | max |",
                  "|---|---|---|---|---|---|"]
        for r in sorted(interleaved, key=lambda r: (r["residency"], r["dtype"])):
            lines.append(f"| {r['residency']} | {r['dtype']} | {r['implementation']} | {r['ratio_median']:.2f}x | "
                         f"{r['ratio_min']:.2f}x | {r['ratio_max']:.2f}x |")
    own = [r for r in ROWS if r["op"] == "decode own keys"]
    if own:
        lines += ["", "## Decode of W2's own keys, flushed", "",
                  f"{W2_BATCH} requests x 16..127 own keys (W2's step after its prefix), caches flushed before each "
                  "call: many short requests out of DRAM.", "",
                  "| dtype | implementation | ms | GB/s | % of read bw |", "|---|---|---|---|---|"]
        for r in sorted(own, key=lambda r: (r["dtype"], order[r["implementation"]])):
            share = f"{100 * r['gb_per_s'] / read:.0f}%" if read else ""
            lines.append(f"| {r['dtype']} | {r['implementation']} | {r['ms']:.3f} | {r['gb_per_s']:.1f} | {share} |")
    lines += ["", "## Prefill", "",
              "| heads | batch x queries | dtype | implementation | ms | GFLOP/s | vs reference |",
              "|---|---|---|---|---|---|---|"]
    shape = lambda r: (r["heads"], r["batch"], r["context"], r.get("queries", r["context"]))  # noqa: E731
    reference_ms = {(*shape(r), r["dtype"]): r["ms"] for r in ROWS
                    if r["op"] == "prefill" and r["implementation"] == "reference"}
    for r in sorted((r for r in ROWS if r["op"] == "prefill"),
                    key=lambda r: (r["heads"], r["batch"] * r["context"], r["context"], r["dtype"],
                                   order[r["implementation"]])):
        ref = reference_ms.get((*shape(r), r["dtype"]))
        speedup = f"{ref / r['ms']:.1f}x" if ref else ""
        queries = r.get("queries", r["context"])
        label = f"{r['batch']}x{queries}" + ("" if queries == r["context"] else f" after {r['context'] - queries}")
        lines.append(f"| {r['heads']} | {label} | {r['dtype']} | {r['implementation']} | {r['ms']:.2f} | "
                     f"{r['gflop_per_s']:.1f} | {speedup} |")
    lines += ["", "## Machine", "", "| op | GB/s |", "|---|---|"]
    lines += [f"| {op} (256 MiB fp32) | {gbs:.1f} |" for op, gbs in sorted(memory.items())]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "kernels_cpu.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
