"""The swap-preemption soak: a long stream of short requests through a `ContinuousBatchingManager` whose cache is far
too small for them, with a small host pool, so that requests are preempted all the time and swapped out, swapped
back in, recomputed when the pool is full, and their evicted prefix blocks kept in and brought back from the host
tier.

The load: `page_size=4`, `num_blocks=32`, `max_batch_tokens=48`; prompts of 1-32 tokens, half of them after one of
a few short shared prefixes (whole blocks and a partial one), drawn from a few hundred distinct prompts, 1-16 new
tokens; arrivals in bursts, some while the engine is busy and some only once an output came back; some streaming,
some cancelled (soon after they were added, or later), some invalid (empty, or a token outside the vocabulary), and
a `pause()` now and then. Every request must end with exactly one terminal output and nothing after it, the loop
must never die, the allocator and the host pool must be consistent at the end with no block held, and every greedy
FINISHED request must equal `model.generate` (a CANCELLED one holds a prefix of it). Sampled runs draw with
`do_sample=True`, a seeded share of the requests with their own `seed`.

Run it as a script for the figures (requests, seeds, time, preemptions, swaps):

    python tests/swap_soak.py --requests 1000 --seeds 0 1 2 [--sampled] [--scheduler fifo prefill_first]
        [--host-kib 4 64 1024] [--prompts 200]

`tests/test_swap_preemption_load.py` runs a short soak in CI and the long one under `-m slow`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import sys
import time
from pathlib import Path

from transformers import GenerationConfig

# Runnable as a script from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cbcore  # noqa: E402
from conftest import VOCAB, assert_engine_clean, reference_tokens, tiny_model  # noqa: E402

MODEL = "llama_gqa"
EOS = 2  # the tiny models' generation config's EOS: `model.generate` stops there, so the requests do too
MAX_NEW_TOKENS = 16
# K + V x 2 layers x page of 4 x 2 KV heads x head dim 16 x fp32: the host pool's unit for `MODEL`.
BYTES_PER_BLOCK = 2 * 2 * 4 * 2 * 16 * 4
CACHE = dict(page_size=4, num_blocks=32, max_batch_tokens=48)
# Distinct prompts a soak draws from (the same for every soak of one seed): repeats are part of the load (whole-prompt
# prefix hits), and each distinct prompt costs one `model.generate` call for its reference, the soak's main cost.
NUM_DISTINCT_PROMPTS = 200

# Greedy references by prompt, for MAX_NEW_TOKENS new tokens (fewer are a prefix of them): shared by the soaks of a run.
_REFERENCES: dict[tuple[int, ...], list[int]] = {}


@dataclasses.dataclass
class SoakResult:
    """What a soak served and how: outcomes by status, the engine's preemption and swap counters, the seconds the
    serving took (from the first request to the last terminal output) and those its references took."""

    requests: int
    statuses: dict[str, int]
    stats: dict[str, int | float]
    serve_seconds: float
    reference_seconds: float

    def summary(self) -> str:
        s = self.stats
        return (f"{self.requests} requests in {self.serve_seconds:.1f} s (references {self.reference_seconds:.1f} s): "
                f"{self.statuses}; {s['steps']} steps, {s['preemptions']} preemptions ({s['swap_preemptions']} "
                f"swapped, {s['recompute_preemptions']} recomputed), {s['swap_outs']} swap-outs, {s['swap_ins']} "
                f"swap-ins, {s['host_tier_kept']} blocks kept in the host tier, {s['host_tier_hits']} brought back")


def _prompt_pool(seed: int, size: int) -> list[list[int]]:
    rng = random.Random(f"prompts {seed}")
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(length)] for length in (4, 8, 12, 6)]
    pool = []
    for _ in range(size):
        suffix = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 32))]
        pool.append(rng.choice(prefixes) + suffix if rng.random() < 0.5 else suffix)
    return pool


def soak(num_requests: int, seed: int, sampled: bool = False, scheduler: str = "fifo", host_kib: float = 64,
         num_prompts: int = NUM_DISTINCT_PROMPTS, timeout_s: float = 600.0) -> SoakResult:
    """Serve `num_requests` requests of the load above, drawn from `num_prompts` distinct prompts; raise
    AssertionError on any broken promise."""
    rng = random.Random(seed)
    model = tiny_model(MODEL)
    generation_config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=sampled, eos_token_id=EOS,
                                         pad_token_id=0)
    config = cbcore.ContinuousBatchingConfig(**CACHE, scheduler_type=scheduler, cpu_offload_space=host_kib / 2**20,
                                             per_request_processors=sampled, seed=seed)
    manager = cbcore.ContinuousBatchingManager(model, generation_config, config)
    pool = _prompt_pool(seed, num_prompts)
    specs: dict[str, dict] = {}
    finals: dict[str, cbcore.GenerationOutput] = {}
    streamed: dict[str, list[list[int]]] = {}

    def take(output: cbcore.GenerationOutput) -> None:
        rid = output.request_id
        assert rid not in finals, f"{rid}: an output after its terminal one ({finals[rid].status.name})"
        if output.is_finished():
            finals[rid] = output
        else:
            assert specs[rid]["streaming"], f"{rid}: a snapshot for a request that did not stream"
            streamed.setdefault(rid, []).append(list(output.generated_tokens))

    def drain(wait_for_one: bool) -> None:
        """Take the outputs delivered so far; first wait for one more when asked (the arrivals then keep pace with
        the engine, instead of only piling up in its queue)."""
        output = manager.get_result(timeout=5) if wait_for_one else None
        while output is not None or (output := manager.get_result(timeout=0)) is not None:
            take(output)
            output = None

    started = time.perf_counter()
    manager.start()
    try:
        for index in range(num_requests):
            draw = rng.random()
            prompt = [] if draw < 0.02 else [1, VOCAB + 7, 3] if draw < 0.04 else rng.choice(pool)
            spec = {"input_ids": prompt, "max_new_tokens": rng.randint(1, MAX_NEW_TOKENS),
                    "streaming": rng.random() < 0.25}
            kwargs = {"seed": rng.randrange(10_000)} if sampled and rng.random() < 0.5 else {}
            rid = manager.add_request(request_id=f"s{seed}_{index}", **spec, **kwargs)
            specs[rid] = spec
            if rng.random() < 0.03:
                manager.cancel_request(rid)  # usually before it runs
            if rng.random() < 0.05:
                manager.cancel_request(rng.choice(list(specs)))  # running, waiting, swapped out, or ended already
            if rng.random() < 0.01:
                with manager.pause():
                    pass
            if index % 8 == 7:
                drain(wait_for_one=rng.random() < 0.5)
        deadline = time.monotonic() + timeout_s
        while len(finals) < len(specs):
            assert time.monotonic() < deadline, f"stalled; {len(specs) - len(finals)} requests without an output"
            output = manager.get_result(timeout=1)
            if output is None:
                assert manager.is_running(), f"the loop died: {manager.background_thread_status.fatal_error!r}"
                continue
            take(output)
        serve_seconds = time.perf_counter() - started
    finally:
        manager.stop(block=True, timeout=60)
    assert manager.background_thread_status.fatal_error is None, manager.background_thread_status.fatal_error
    assert manager.output_router.empty(), "outputs were delivered after the terminal ones"
    assert_engine_clean(manager)
    stats = manager.stats()
    assert stats["host_blocks_free"] == stats["host_blocks"], "a host block is still held by a request"

    reference_started = time.perf_counter()
    statuses: dict[str, int] = {}
    for rid, spec in specs.items():
        output = finals[rid]
        statuses[output.status.name] = statuses.get(output.status.name, 0) + 1
        prompt = spec["input_ids"]
        if not prompt or max(prompt) >= VOCAB:  # failed, unless cancelled before the loop took it in
            assert output.status == cbcore.RequestStatus.CANCELLED or (
                output.status == cbcore.RequestStatus.FAILED and rid in output.error), output
            continue
        assert output.status in (cbcore.RequestStatus.FINISHED, cbcore.RequestStatus.CANCELLED), output
        tokens = output.generated_tokens
        for snapshot in streamed.get(rid, []):
            assert tokens[: len(snapshot)] == snapshot, f"{rid}: a streamed snapshot is not a prefix of its output"
        if sampled:
            assert len(tokens) <= spec["max_new_tokens"] and all(0 <= t < VOCAB for t in tokens), output
            continue
        key = tuple(prompt)
        if key not in _REFERENCES:  # greedy: the tokens for fewer new tokens are a prefix of those for more
            _REFERENCES[key] = reference_tokens(model, prompt, GenerationConfig(
                max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=EOS, pad_token_id=0))
        want = _REFERENCES[key][: spec["max_new_tokens"]]
        if output.status == cbcore.RequestStatus.FINISHED:
            assert tokens == want, f"{rid}: {tokens} but model.generate gives {want}"
        else:
            assert tokens == want[: len(tokens)], f"{rid}: cancelled with {tokens}, not a prefix of {want}"
    return SoakResult(len(specs), statuses, stats, serve_seconds, time.perf_counter() - reference_started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sampled", action="store_true", help="do_sample=True (default: greedy, checked)")
    parser.add_argument("--scheduler", nargs="+", default=["fifo", "prefill_first"])
    parser.add_argument("--host-kib", type=float, nargs="+", default=[4, 64, 1024])
    parser.add_argument("--prompts", type=int, default=NUM_DISTINCT_PROMPTS, help="distinct prompts per seed")
    args = parser.parse_args()
    logging.getLogger("cbcore").setLevel(logging.ERROR)  # the invalid prompts' warnings
    total = time.perf_counter()
    for seed in args.seeds:
        for scheduler in args.scheduler:
            for host_kib in args.host_kib:
                result = soak(args.requests, seed, args.sampled, scheduler, host_kib, args.prompts)
                print(f"seed {seed} {scheduler} host pool {host_kib:g} KiB "
                      f"{'sampled' if args.sampled else 'greedy'}: {result.summary()}", flush=True)
    print(f"all soaks passed in {time.perf_counter() - total:.1f} s")


if __name__ == "__main__":
    main()
