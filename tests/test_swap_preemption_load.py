"""Preemption by swap under load: a cache far too small for its requests (`page_size=4`, `num_blocks=32`,
`max_batch_tokens=48`) and a small host pool (4 KiB to 1 MiB), so that requests are swapped out and back in,
recomputed when the pool is full, and evicted prefix blocks are kept in the host tier and brought back. The scheduler
must only ever ask the allocator for blocks it reserved: the loop never dies, `check()` holds after every step, every
request ends exactly once, and outputs do not change (greedy ones equal `model.generate`, seeded sampled ones equal
the same requests served with room to spare).

The property test drives `EngineCore` step by step (arrivals, shared short prefixes, cancels, invalid prompts,
`num_return_sequences` children, greedy and seeded sampling, both schedulers); the soaks drive the manager
(tests/swap_soak.py, also runnable as a script for its figures)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from transformers import GenerationConfig

import cbcore
from cbcore.engine import EngineCore
from cbcore.requests import RequestState, RequestStatus, child_request_id
from conftest import VOCAB, random_prompts, reference_tokens, tiny_model
from swap_soak import BYTES_PER_BLOCK, CACHE, EOS, MODEL, soak

MAX_NEW_TOKENS = 12
# Short shared prefixes: one block, two blocks, and a block and a half (its partial block is never shared), and the
# suffixes that follow them (or stand alone): few distinct prompts, so that their greedy references are computed once
# per session, and repeats are whole-prompt prefix hits.
PREFIXES = random_prompts([4, 8, 6], seed=90)
SUFFIXES = random_prompts([1, 2, 3, 5, 7, 9, 12, 16, 20, 24, 28, 32], seed=91)
_REFERENCES: dict[tuple[int, ...], list[int]] = {}  # prompt -> `model.generate`'s MAX_NEW_TOKENS greedy tokens
MAX_STEPS = 5000  # far more than any example needs: reaching it means the engine stopped making progress

request_spec = st.fixed_dictionaries({
    "arrival": st.integers(0, 10),  # the step before which it is added
    "prefix": st.sampled_from([None, 0, 1, 2]),
    "suffix": st.integers(0, len(SUFFIXES) - 1),
    "max_new_tokens": st.integers(1, MAX_NEW_TOKENS),
    "children": st.sampled_from([0, 0, 0, 1, 2]),
    "cancel": st.one_of(st.none(), st.none(), st.none(), st.tuples(st.integers(0, 16), st.sampled_from([-1, 0]))),
    "invalid": st.sampled_from([None] * 12 + ["empty", "out_of_vocabulary"]),
    "seed": st.integers(0, 10_000),  # its sampling seed
    "streaming": st.booleans(),
})
load = st.fixed_dictionaries({
    "scheduler": st.sampled_from(["fifo", "prefill_first"]),
    "host_blocks": st.sampled_from([2, 3, 8, 64, 512]),  # 4 KiB, 6 KiB, 16 KiB, 128 KiB, 1 MiB
    "sampled": st.booleans(),
    "requests": st.lists(request_spec, min_size=16, max_size=40),
})


def _engine(scheduler: str, host_blocks: int, sampled: bool, roomy: bool = False) -> EngineCore:
    """An engine built as the manager builds it, bound to the tiny model (the caller unbinds it). `roomy`: a cache
    that holds every request at once and no host pool (nothing is ever preempted)."""
    generation_config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=sampled, eos_token_id=EOS,
                                         pad_token_id=0)
    cache = dict(CACHE, num_blocks=1024, cpu_offload_space=0) if roomy else dict(
        CACHE, cpu_offload_space=host_blocks * BYTES_PER_BLOCK / 2**30)
    config = cbcore.ContinuousBatchingConfig(**cache, scheduler_type=scheduler, per_request_processors=sampled)
    manager = cbcore.ContinuousBatchingManager(tiny_model(MODEL), generation_config, config)
    manager.warmup()
    assert roomy or manager.engine.cache.swap.num_host_blocks == host_blocks
    manager.engine.binding.attach()
    return manager.engine


def _state(index: int, spec: dict, sampled: bool) -> RequestState:
    if spec["invalid"] == "empty":
        prompt = []
    elif spec["invalid"] == "out_of_vocabulary":
        prompt = [3, VOCAB + 1]
    else:
        prompt = (PREFIXES[spec["prefix"]] if spec["prefix"] is not None else []) + SUFFIXES[spec["suffix"]]
    return RequestState(request_id=f"req_{index}", initial_tokens=prompt, max_new_tokens=spec["max_new_tokens"],
                        eos_token_id=EOS, streaming=spec["streaming"], num_children=spec["children"],
                        logit_processor_kwargs={"seed": spec["seed"]} if sampled else {})


def _serve(engine: EngineCore, specs: list[dict], sampled: bool, cancels: bool = True, check_every_step: bool = True
           ) -> tuple[dict[str, cbcore.GenerationOutput], dict[str, RequestState]]:
    """Add each request before its arrival step, cancel it (or its first child) when its spec says, and step until
    no work is left; every id's one terminal output, and the request each id belongs to."""
    finals: dict[str, cbcore.GenerationOutput] = {}
    owners: dict[str, RequestState] = {}

    def take(outputs: list[cbcore.GenerationOutput]) -> None:
        for output in outputs:
            assert output.request_id not in finals, f"{output.request_id}: an output after its terminal one"
            if output.is_finished():
                finals[output.request_id] = output

    last_arrival = max(spec["arrival"] for spec in specs)
    for step in range(MAX_STEPS):
        for index, spec in enumerate(specs):
            if spec["arrival"] == step:
                state = _state(index, spec, sampled)
                owners[state.request_id] = state
                for child in range(spec["children"]):
                    owners[child_request_id(state.request_id, child)] = state
                take(engine.add_request(state))
            if cancels and spec["cancel"] is not None and spec["arrival"] + spec["cancel"][0] == step:
                child = spec["cancel"][1]
                target = f"req_{index}"
                if child >= 0 and spec["children"]:
                    target = child_request_id(target, child)
                take(engine.abort(target))
        if engine.has_work():
            take(engine.step())
        if check_every_step:
            engine.check()
        if step >= last_arrival + 16 and not engine.has_work():
            break
    assert not engine.has_work(), f"no progress after {MAX_STEPS} steps"
    return finals, owners


def _greedy_reference(prompt: list[int], max_new_tokens: int) -> list[int]:
    """`model.generate`'s greedy tokens (with fewer new tokens, a prefix of those with more)."""
    key = tuple(prompt)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_tokens(tiny_model(MODEL), prompt, GenerationConfig(
            max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=EOS, pad_token_id=0))
    return _REFERENCES[key][:max_new_tokens]


@pytest.mark.filterwarnings("ignore")
@settings(max_examples=24, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(load=load)
def test_swap_preemption_under_load_keeps_the_allocator_consistent_and_outputs_unchanged(load: dict) -> None:
    sampled, specs = load["sampled"], load["requests"]
    engine = _engine(load["scheduler"], load["host_blocks"], sampled)
    try:
        finals, owners = _serve(engine, specs, sampled)
    finally:
        engine.binding.detach()
    assert set(finals) == set(owners), f"requests without a terminal output: {set(owners) - set(finals)}"
    assert engine.cache.allocator.num_referenced == 0, "a block is still referenced after every request ended"
    assert engine.cache.swap.num_free == engine.cache.swap.num_host_blocks, "a host block is still held"

    if sampled:  # seeded: what the requests draw does not depend on what else ran, or on preemption
        roomy = _engine(load["scheduler"], 0, sampled, roomy=True)
        try:
            unpressured, _ = _serve(roomy, specs, sampled, cancels=False, check_every_step=False)
        finally:
            roomy.binding.detach()
    for request_id, output in finals.items():
        state = owners[request_id]
        if not state.initial_tokens or max(state.initial_tokens) >= VOCAB:
            assert output.status == RequestStatus.FAILED and request_id in output.error, output
            continue
        assert output.status in (RequestStatus.FINISHED, RequestStatus.CANCELLED), output
        if sampled:
            want = unpressured[request_id].generated_tokens
        else:
            want = _greedy_reference(state.initial_tokens, state.max_new_tokens)
        if output.status == RequestStatus.FINISHED:
            assert output.generated_tokens == want, request_id
        else:
            assert output.generated_tokens == want[: len(output.generated_tokens)], request_id


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("seed", "sampled", "scheduler", "host_kib"), [
    (0, False, "fifo", 8), (1, False, "prefill_first", 64), (2, True, "fifo", 1024)])
def test_a_short_swap_soak_through_the_manager_loses_and_duplicates_nothing(seed, sampled, scheduler, host_kib) -> None:
    result = soak(300, seed, sampled, scheduler, host_kib, num_prompts=48)
    assert result.stats["swap_preemptions"] > 0 and result.stats["swap_ins"] > 0


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("scheduler", ["fifo", "prefill_first"])
def test_a_swap_soak_of_thousands_of_requests_never_kills_the_loop(scheduler: str, sampled: bool) -> None:
    for seed in range(3):
        for host_kib in (4, 64, 1024):
            result = soak(1000, seed, sampled, scheduler, host_kib)
            assert result.stats["preemptions"] > 0  # swapped, or recomputed when 4 KiB (2 blocks) is too little
