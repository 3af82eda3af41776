"""Microbenchmarks of the orchestrator: the scheduler and the block allocator on the CPU, with no model forward, so a
regression in scheduling shows up on its own instead of hiding in a step's forward time.

Workload (seeded; page size 16, fifo order, the manager's CPU budgets of 1024 query tokens and 1024 requests a step):
- decode step: N requests (N = 64, 256, 1024) with prompts of 16..128 tokens, unique, no EOS and no token limit,
    brought into steady decode first; one measured step is one cycle of `ContinuousBatchingManager._step` without the
    forward: `scheduler.schedule()`, `scheduler.on_step_done(batch)`, then for every request whose row emits a token
    `state.status = DECODING` and `state.append_token(...)`. Every step schedules all N requests (asserted), and on
    average one request in 16 crosses a page boundary (a block committed to the prefix cache, a block allocated).
    decisions/s = requests scheduled per second = N / median step time.
- prefill wave: N requests arrive together, each prompt a 64-token prefix shared by all (4 full blocks, cached by
    the previous wave) followed by 16..64 unique tokens, max_new_tokens=1; one measured round runs steps until the
    wave is done (every request admitted, prefix matched, suffix computed in chunks of the token budget, first token
    appended, request finished and its blocks released). Every request must hit the whole 64-token prefix (asserted).
    decisions/s = (request, step) pairs scheduled in the round / round time.
- allocator (`cbcore._C.BlockAllocator`, 4096 blocks of 16 tokens, called from Python as cbcore/cache.py does):
    allocate/free: 256 block tables of 1 or 16 blocks allocated, then freed tail first; ops/s = allocate and free
    calls per second. Prefix cache: 256 chains of 8 full blocks; commit = `commit(block, parent, tokens)` down each
    chain (blocks/s); match = `match_prefix(tokens, 8)` of each chain with all 8 blocks cached-unused, each match
    followed by the `free` that gives its references back (blocks matched per second).

The K/V tensors are never touched: the cache has 1 layer, 1 kv head and head_dim 1, so building it costs nothing.
Correctness is asserted where it is cheap (counts per step, `check()` of the allocator after each run); there are no
timing assertions. Run it (`bench/` is not in the default test paths); it writes bench/results/orchestrator_cpu.json
and bench/results/orchestrator_cpu.md (to another folder with $CBCORE_BENCH_RESULTS):

    python -m pytest bench/test_bench_orchestrator.py -q
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cbcore._C import BlockAllocator
from cbcore.benchmarks.machine import cpu_model
from cbcore.cache import PagedKVCache
from cbcore.cache_shape import CacheShape
from cbcore.requests import RequestState, RequestStatus
from cbcore.scheduler import SCHEDULING_ORDERS, ScheduledBatch, Scheduler

PAGE_SIZE = 16
# The CPU step budgets of cbcore/engine/sizing.py (DEFAULT_MAX_BATCH_TOKENS["cpu"], now 2048;
# FALLBACK_MAX_REQUESTS_PER_BATCH) when this was written; fixed here so the workload does not change under the figures
# when those defaults do.
MAX_BATCH_TOKENS = 1024
MAX_REQUESTS_PER_BATCH = 1024
SHAPE = CacheShape(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
VOCAB = 32000
SEED = 0

DECODE_SIZES = [64, 256, 1024]
DECODE_PROMPT_TOKENS = (16, 128)
# Measured steps per size: a fixed count, so the cache can be sized for them (the whole file runs in ~12 s).
DECODE_ROUNDS = {64: 500, 256: 200, 1024: 60}
WARMUP_ROUNDS = 2

PREFILL_SIZES = [64, 256, 1024]
SHARED_PREFIX_TOKENS = 64
PREFILL_SUFFIX_TOKENS = (16, 64)
PREFILL_ROUNDS = {64: 50, 256: 20, 1024: 8}

ALLOCATOR_ROUNDS = 100
ALLOCATOR_BLOCKS = 4096
NUM_TABLES = 256
CHAIN_BLOCKS = 8

RESULTS_DIR = Path(os.environ.get("CBCORE_BENCH_RESULTS", Path(__file__).resolve().parent / "results"))
COMMAND = "python -m pytest bench/test_bench_orchestrator.py -q"

ROWS: list[dict] = []


# ---- the engine's loop without the model ----------------------------------------------------------------------------


def build_scheduler(num_blocks: int) -> Scheduler:
    """Cache and scheduler as `ContinuousBatchingManager._build_engine` builds them: fifo, prefix sharing, no swap."""
    cache = PagedKVCache(SHAPE, num_blocks, PAGE_SIZE, torch.device("cpu"), allow_prefix_sharing=True)
    return Scheduler(
        cache,
        SCHEDULING_ORDERS["fifo"](),
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_requests_per_batch=min(MAX_REQUESTS_PER_BATCH, MAX_BATCH_TOKENS),
    )


def step(scheduler: Scheduler) -> ScheduledBatch:
    """`ContinuousBatchingManager._step` with a fake sampler in place of the forward: every emitting request gets
    one more token, and a request that is complete is finished (its blocks released)."""
    batch = scheduler.schedule()
    assert not (batch.preempted or batch.filled_the_cache or batch.failed), "the cache is sized so that nothing is preempted"
    # Read before on_step_done advances the requests, as the runner does while preparing the step.
    emitted = [item.state for item in batch.requests if item.emits_token]
    scheduler.on_step_done(batch)
    for state in emitted:
        state.status = RequestStatus.DECODING
        if state.append_token(state.num_tokens % VOCAB, None):
            scheduler.finish(state)
    return batch


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


def record(benchmark, case: str, size: int, size_label: str, unit: str, rates: dict[str, int], **extra) -> None:
    """Put the case's rates (each count per median time; the first is the headline) in extra_info and keep a row
    for the report."""
    stats = benchmark.stats
    if stats is None:  # --benchmark-disable: the function ran once, untimed
        return
    median = stats.stats.median
    per_second = {name: count / median for name, count in rates.items()}
    benchmark.extra_info.update(case=case, size=size, size_label=size_label, unit=unit, **per_second, **extra)
    rate_name = next(iter(rates))
    ROWS.append(dict(benchmark.extra_info, name=benchmark.name, median_s=median, rate_name=rate_name,
                     rate=per_second[rate_name], rounds=stats.stats.rounds, min_s=stats.stats.min,
                     mean_s=stats.stats.mean, iqr_s=stats.stats.iqr))


# ---- scheduler -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_requests", DECODE_SIZES)
def test_decode_step_schedules_every_running_request(benchmark, num_requests) -> None:
    rng = random.Random(SEED)
    rounds = DECODE_ROUNDS[num_requests]
    # Room for every prompt plus 1024 generated tokens each: bring-up takes ~580 steps at N=1024 (fifo serves the
    # decodes first, so the last prompts are computed with what they leave of the token budget), the measured steps
    # another 62; a shortfall would show as a preemption, which `step` rejects.
    blocks_per_request = -(-DECODE_PROMPT_TOKENS[1] // PAGE_SIZE) + 1024 // PAGE_SIZE
    scheduler = build_scheduler(num_requests * blocks_per_request)
    requests = [
        RequestState(f"req_{i}", random_tokens(rng, rng.randint(*DECODE_PROMPT_TOKENS)), max_new_tokens=None)
        for i in range(num_requests)
    ]
    for state in requests:
        scheduler.add(state)
    bring_up_steps = 0
    while not all(state.generated_tokens for state in requests):
        step(scheduler)
        bring_up_steps += 1
        assert bring_up_steps < 1000, "the requests never all reached decode"

    scheduled: list[int] = []

    def one_step() -> None:
        scheduled.append(len(step(scheduler).requests))

    benchmark.pedantic(one_step, rounds=rounds, iterations=1, warmup_rounds=WARMUP_ROUNDS)

    assert scheduled == [num_requests] * len(scheduled), "a decode step left running requests out"
    assert scheduler.num_preemptions == 0
    scheduler.cache.check(scheduler.live_requests())
    record(benchmark, "decode step", num_requests, f"N={num_requests}", "step", {"decisions_per_s": num_requests},
           bring_up_steps=bring_up_steps, num_blocks=scheduler.cache.num_blocks)


@pytest.mark.parametrize("num_requests", PREFILL_SIZES)
def test_prefill_wave_shares_the_cached_prefix(benchmark, num_requests) -> None:
    rng = random.Random(SEED)
    rounds = PREFILL_ROUNDS[num_requests]
    prefix = random_tokens(rng, SHARED_PREFIX_TOKENS)
    # One wave at its largest, plus as much again: after the first waves, new blocks come from evicting the previous
    # waves' cached suffix blocks (the steady state of a busy cache), never from the shared prefix.
    blocks_per_request = -(-(SHARED_PREFIX_TOKENS + PREFILL_SUFFIX_TOKENS[1] + 1) // PAGE_SIZE)
    scheduler = build_scheduler(2 * num_requests * blocks_per_request)
    waves = [0]

    def new_wave():
        waves[0] += 1
        wave = [
            RequestState(f"w{waves[0]}_req_{i}", prefix + random_tokens(rng, rng.randint(*PREFILL_SUFFIX_TOKENS)),
                         max_new_tokens=1)
            for i in range(num_requests)
        ]
        return (wave,), {}

    # The first wave computes the prefix (its first request does; the others wait for its blocks, then share them).
    (first_wave,), _ = new_wave()
    for state in first_wave:
        scheduler.add(state)
    while scheduler.has_work():
        step(scheduler)

    per_wave: list[tuple[int, int, int]] = []  # (steps, scheduled (request, step) pairs, prefix hit tokens)

    def run_wave(wave: list[RequestState]) -> None:
        hits_before = scheduler.num_prefix_hit_tokens
        steps = decisions = 0
        for state in wave:
            scheduler.add(state)
        while scheduler.has_work():
            decisions += len(step(scheduler).requests)
            steps += 1
        per_wave.append((steps, decisions, scheduler.num_prefix_hit_tokens - hits_before))

    benchmark.pedantic(run_wave, setup=new_wave, rounds=rounds, iterations=1, warmup_rounds=1)

    assert all(hits == num_requests * SHARED_PREFIX_TOKENS for _, _, hits in per_wave), "a request missed the prefix"
    assert scheduler.num_preemptions == 0
    scheduler.cache.check(scheduler.live_requests())
    # Waves differ a little (their suffixes are random): report the average wave.
    steps = round(statistics.mean(steps for steps, _, _ in per_wave))
    decisions = round(statistics.mean(decisions for _, decisions, _ in per_wave))
    record(benchmark, "prefill wave, shared prefix", num_requests, f"N={num_requests}", "wave",
           {"decisions_per_s": decisions, "requests_per_s": num_requests},
           steps_per_wave=steps, decisions_per_wave=decisions, num_blocks=scheduler.cache.num_blocks)


# ---- allocator -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks_per_table", [1, 16])
def test_allocate_then_free_every_table(benchmark, blocks_per_table) -> None:
    allocator = BlockAllocator(ALLOCATOR_BLOCKS, PAGE_SIZE)
    num_tables = min(NUM_TABLES, ALLOCATOR_BLOCKS // blocks_per_table)

    def cycle() -> None:
        tables = [allocator.allocate(blocks_per_table) for _ in range(num_tables)]
        for table in tables:
            allocator.free(table[::-1])

    benchmark.pedantic(cycle, rounds=ALLOCATOR_ROUNDS, iterations=1, warmup_rounds=WARMUP_ROUNDS)

    allocator.check()
    assert allocator.num_free == ALLOCATOR_BLOCKS
    calls = 2 * num_tables
    record(benchmark, f"allocate({blocks_per_table}) + free", num_tables, f"{num_tables} tables", "cycle",
           {"ops_per_s": calls, "blocks_per_s": num_tables * blocks_per_table})


def chains(rng: random.Random) -> list[list[int]]:
    """Token lists of NUM_TABLES unrelated chains of CHAIN_BLOCKS full blocks."""
    return [random_tokens(rng, CHAIN_BLOCKS * PAGE_SIZE) for _ in range(NUM_TABLES)]


def test_commit_chains_to_the_prefix_cache(benchmark) -> None:
    tokens = chains(random.Random(SEED))
    pages = [[chain[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] for i in range(CHAIN_BLOCKS)] for chain in tokens]
    committed: list[int] = []
    last: list[BlockAllocator] = []

    def fresh_allocator():
        allocator = BlockAllocator(ALLOCATOR_BLOCKS, PAGE_SIZE)
        tables = [allocator.allocate(CHAIN_BLOCKS) for _ in range(NUM_TABLES)]
        last[:] = [allocator]
        return (allocator, tables), {}

    def commit_all(allocator: BlockAllocator, tables: list[list[int]]) -> None:
        count = 0
        for table, chain_pages in zip(tables, pages):
            parent = -1
            for block, page in zip(table, chain_pages):
                count += allocator.commit(block, parent, page)
                parent = block
        committed.append(count)

    benchmark.pedantic(commit_all, setup=fresh_allocator, rounds=ALLOCATOR_ROUNDS, iterations=1, warmup_rounds=1)

    assert committed == [NUM_TABLES * CHAIN_BLOCKS] * len(committed), "a commit was refused"
    last[0].check()
    record(benchmark, "prefix cache commit", NUM_TABLES * CHAIN_BLOCKS,
           f"{NUM_TABLES} chains x {CHAIN_BLOCKS} blocks", "round",
           {"ops_per_s": NUM_TABLES * CHAIN_BLOCKS})


def test_match_cached_chains_then_free(benchmark) -> None:
    tokens = chains(random.Random(SEED))
    allocator = BlockAllocator(ALLOCATOR_BLOCKS, PAGE_SIZE)
    for chain in tokens:
        table = allocator.allocate(CHAIN_BLOCKS)
        parent = -1
        for i, block in enumerate(table):
            assert allocator.commit(block, parent, chain[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])
            parent = block
        allocator.free(table[::-1])  # cached-unused: each match takes the blocks out of the LRU list and back
    allocator.reset_stats()
    rounds_run = [0]

    def match_all() -> None:
        for chain in tokens:
            allocator.free(allocator.match_prefix(chain, CHAIN_BLOCKS)[::-1])
        rounds_run[0] += 1

    benchmark.pedantic(match_all, rounds=ALLOCATOR_ROUNDS, iterations=1, warmup_rounds=WARMUP_ROUNDS)

    stats = allocator.stats()
    assert stats["hits"] == stats["lookups"] == rounds_run[0] * NUM_TABLES * CHAIN_BLOCKS, stats
    allocator.check()
    assert allocator.num_cached_unused == NUM_TABLES * CHAIN_BLOCKS
    record(benchmark, "prefix cache match_prefix + free", NUM_TABLES * CHAIN_BLOCKS,
           f"{NUM_TABLES} chains x {CHAIN_BLOCKS} blocks", "round",
           {"ops_per_s": NUM_TABLES * CHAIN_BLOCKS})


# ---- report --------------------------------------------------------------------------------------------------------


def hardware() -> str:
    model = cpu_model()
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()} (single-threaded: no torch ops run)"


def load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def _format_time(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


@pytest.fixture(scope="module", autouse=True)
def _write_report():
    yield
    if not ROWS:
        return
    workload = (
        f"page size {PAGE_SIZE}, fifo, budgets {MAX_BATCH_TOKENS} tokens / {MAX_REQUESTS_PER_BATCH} requests a step; "
        f"decode: N requests, prompts {DECODE_PROMPT_TOKENS[0]}..{DECODE_PROMPT_TOKENS[1]} tokens, in steady decode; "
        f"prefill wave: N requests, {SHARED_PREFIX_TOKENS}-token shared cached prefix + "
        f"{PREFILL_SUFFIX_TOKENS[0]}..{PREFILL_SUFFIX_TOKENS[1]} unique tokens, max_new_tokens=1; allocator: "
        f"{ALLOCATOR_BLOCKS} blocks, {NUM_TABLES} tables / chains of {CHAIN_BLOCKS} blocks; seed {SEED}"
    )
    lines = [
        "# Orchestrator: scheduler step and block allocator (CPU, no model)",
        "",
        f"- hardware: {hardware()}; load average at the end of the run {load_average()} (other work on the machine "
        "shows up as noise)",
        f"- workload: {workload}",
        "- counts: decode decisions/s = N / median step; prefill decisions/s = (request, step) pairs scheduled in a "
        "wave / median wave; allocator ops/s = calls (allocate + free) or blocks (commit, match) / median round",
        f"- command: `{COMMAND}`",
        "",
        "| case | size | median time | rate | detail |",
        "|---|---|---|---|---|",
    ]
    for r in ROWS:
        rate = f"{r['rate']:,.0f} {'decisions/s' if r['rate_name'] == 'decisions_per_s' else 'ops/s'}"
        if "steps_per_wave" in r:
            detail = (f"{r['steps_per_wave']} steps, {r['decisions_per_wave']} decisions a wave; "
                      f"{r['requests_per_s']:,.0f} requests/s; {_format_time(r['median_s'] / r['steps_per_wave'])} "
                      "a step")
        elif "blocks_per_s" in r:
            detail = f"{r['blocks_per_s']:,.0f} blocks/s"
        elif "bring_up_steps" in r:
            detail = f"{_format_time(r['median_s'] / r['size'])} a request"
        else:
            detail = f"{_format_time(r['median_s'] / r['size'])} a block"
        median = f"{_format_time(r['median_s'])} / {r['unit']}"
        lines.append(f"| {r['case']} | {r['size_label']} | {median} | {rate} | {detail} |")
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    report = {
        "command": COMMAND,
        "hardware": hardware(),
        "load_average_at_end": load_average(),
        "python": sys.version.split()[0],
        "commit": commit or None,
        "workload": workload,
        "benchmarks": ROWS,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "orchestrator_cpu.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (RESULTS_DIR / "orchestrator_cpu.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
