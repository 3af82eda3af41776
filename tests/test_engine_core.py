"""`EngineCore` stepped directly, without the manager's thread: what tests and the profiler do. Each test drives one
mechanism through `add_request` / `abort` / `step()` and checks the outputs those calls return."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import cbcore
from cbcore.engine import EngineCore
from cbcore.requests import RequestState, RequestStatus
from conftest import greedy_config, random_prompts, reference_tokens, tiny_model


_BOUND: list[EngineCore] = []


@pytest.fixture(autouse=True)
def _engines_unbound_after_each_test():
    yield
    while _BOUND:
        _BOUND.pop().binding.detach()


def engine_for(model, generation_config: GenerationConfig, **cb_kwargs) -> EngineCore:
    """An engine built as the manager builds it (the generation config prepared as `model.generate` prepares it),
    bound to the model (unbound after the test)."""
    manager = cbcore.ContinuousBatchingManager(model, generation_config, cbcore.ContinuousBatchingConfig(**cb_kwargs))
    manager.warmup()
    manager.engine.binding.attach()
    _BOUND.append(manager.engine)
    return manager.engine


def request(index: int, prompt: list[int], max_new_tokens: int, num_children: int = 0) -> RequestState:
    return RequestState(request_id=f"req_{index}", initial_tokens=prompt, max_new_tokens=max_new_tokens,
                        eos_token_id=-1, num_children=num_children)


def run_to_the_end(engine: EngineCore, max_steps: int = 10_000) -> dict[str, cbcore.GenerationOutput]:
    finals = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for output in engine.step():
            if output.is_finished():
                assert output.request_id not in finals, f"{output.request_id} ended twice"
                finals[output.request_id] = output
    assert not engine.has_work(), "the engine did not finish"
    engine.check()
    assert engine.cache.allocator.num_referenced == 0
    return finals


def test_a_chunked_prefill_runs_over_several_steps_and_equals_generate() -> None:
    model = tiny_model("llama_gqa")
    engine = engine_for(model, greedy_config(5), page_size=4, num_blocks=64, max_batch_tokens=8)
    prompt = random_prompts([30], seed=70)[0]
    assert engine.add_request(request(0, prompt, 5)) == []
    steps_before_first_token = 0
    while not engine.live_requests()[0].generated_tokens:
        engine.step()
        steps_before_first_token += 1
    assert steps_before_first_token == 4  # 30 prompt tokens at 8 per step
    finals = run_to_the_end(engine)
    assert finals["req_0"].generated_tokens == reference_tokens(model, prompt, greedy_config(5))


def test_a_preemption_with_swap_keeps_the_output_unchanged() -> None:
    model = tiny_model("qwen2")
    engine = engine_for(model, greedy_config(12), page_size=4, num_blocks=12, max_batch_tokens=64,
                        cpu_offload_space=0.01)
    prompts = random_prompts([14, 18, 11, 16], seed=71)
    for index, prompt in enumerate(prompts):
        engine.add_request(request(index, prompt, 12))
    finals = run_to_the_end(engine)
    stats = engine.stats()
    assert stats["swap_preemptions"] > 0 and stats["swap_outs"] > 0
    for index, prompt in enumerate(prompts):
        assert finals[f"req_{index}"].generated_tokens == reference_tokens(model, prompt, greedy_config(12))


def test_a_fork_gives_each_child_the_parents_prompt() -> None:
    model = tiny_model("llama_gqa")
    config = GenerationConfig(max_new_tokens=4, do_sample=True, top_k=1, num_return_sequences=3, pad_token_id=0)
    engine = engine_for(model, config, page_size=4, num_blocks=64)
    prompt = random_prompts([10], seed=72)[0]
    engine.add_request(request(0, prompt, 4, num_children=2))
    finals = run_to_the_end(engine)
    assert set(finals) == {"req_0", "req_0__child#0", "req_0__child#1"}
    want = reference_tokens(model, prompt, greedy_config(4))
    assert all(output.generated_tokens == want for output in finals.values())


def test_an_abort_ends_the_request_cancelled_with_its_partial_tokens() -> None:
    model = tiny_model("llama_gqa")
    engine = engine_for(model, greedy_config(50), page_size=4, num_blocks=64)
    prompt = random_prompts([6], seed=73)[0]
    engine.add_request(request(0, prompt, 50))
    engine.add_request(request(1, prompt[:4], 3))
    early = [output for _ in range(5) for output in engine.step()]
    assert [o.request_id for o in early if o.is_finished()] == ["req_1"]  # 3 tokens: done by the third step
    outputs = engine.abort("req_0")
    assert [o.status for o in outputs] == [RequestStatus.CANCELLED]
    assert outputs[0].generated_tokens == reference_tokens(model, prompt, greedy_config(50))[:5]
    assert engine.abort("req_0") == []  # not live any more: nothing happens
    assert run_to_the_end(engine) == {}


def test_stepping_an_unbound_engine_raises_instead_of_ignoring_the_cache() -> None:
    engine = engine_for(tiny_model("qwen2"), greedy_config(3), page_size=4, num_blocks=16)
    engine.binding.detach()
    engine.add_request(request(0, [1, 2, 3], 3))
    with pytest.raises(RuntimeError, match="needs the model bound"):
        engine.step()


@pytest.mark.parametrize("prompt", [[], [1, 10_000]], ids=["empty", "outside_the_vocabulary"])
def test_a_bad_prompt_is_answered_by_add_request_itself(prompt: list[int]) -> None:
    engine = engine_for(tiny_model("qwen2"), greedy_config(3), page_size=4, num_blocks=16)
    outputs = engine.add_request(request(0, prompt, 3))
    assert [o.status for o in outputs] == [RequestStatus.FAILED] and "req_0" in outputs[0].error
    assert not engine.has_work()


def test_forks_and_swaps_in_the_same_steps_keep_every_child_exact() -> None:
    """Copy-on-write blocks of forks are copied in the same batched flush as the step's swaps, before them: a child
    preempted and swapped out right after its fork still holds its parent's K/V."""
    model = tiny_model("llama_gqa")
    config = GenerationConfig(max_new_tokens=10, do_sample=True, top_k=1, num_return_sequences=3, pad_token_id=0)
    engine = engine_for(model, config, page_size=4, num_blocks=16, max_batch_tokens=32, cpu_offload_space=0.01)
    prompts = random_prompts([10, 7, 13], seed=74)  # partial last blocks: every fork copies one
    for index, prompt in enumerate(prompts):
        engine.add_request(request(index, prompt, 10, num_children=2))
    finals = run_to_the_end(engine)
    assert len(finals) == 9
    assert engine.stats()["preemptions"] > 0
    for index, prompt in enumerate(prompts):
        want = reference_tokens(model, prompt, greedy_config(10))
        family = [f"req_{index}", f"req_{index}__child#0", f"req_{index}__child#1"]
        assert [finals[rid].generated_tokens for rid in family] == [want] * 3


def test_the_kernel_mode_is_resolved_once_when_the_engine_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """CBCORE_KERNELS is read when the engine is built, not by every layer's op call: changing it afterwards (even to
    a value that would raise) does not reach the engine's steps."""
    monkeypatch.setenv("CBCORE_KERNELS", "reference")
    model = tiny_model("qwen2")
    engine = engine_for(model, greedy_config(4), page_size=4, num_blocks=16)
    assert engine.runner.kernel_mode == "reference"
    monkeypatch.setenv("CBCORE_KERNELS", "no-such-backend")
    prompt = random_prompts([6], seed=75)[0]
    engine.add_request(request(0, prompt, 4))
    finals = run_to_the_end(engine)
    assert finals["req_0"].generated_tokens == reference_tokens(model, prompt, greedy_config(4))


def _ids_and_ints(value) -> bool:
    """Whether `value` is built of strings, ints, bools, None (no state slot) and tuples/lists of them only (no
    tensor, no live object)."""
    if value is None or isinstance(value, (str, int, bool)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_ids_and_ints(v) for v in value)
    return False


def test_the_plan_is_ids_and_ints_and_its_copies_wait_for_the_worker() -> None:
    """schedule() decides a fork's copy-on-write block and a swap-out as block-id pairs in the step's plan; no
    tensor changes until the runner issues them (copy_blocks), and every plan field is an id or an int."""
    import dataclasses

    model = tiny_model("llama_gqa")
    config = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1, num_return_sequences=2, pad_token_id=0)
    engine = engine_for(model, config, page_size=4, num_blocks=12, max_batch_tokens=64, cpu_offload_space=0.01)
    for index, prompt in enumerate(random_prompts([10, 9, 11], seed=75)):
        engine.add_request(request(index, prompt, 6, num_children=1))
    seen = {"device_to_device": 0, "device_to_host": 0, "copied_by_the_worker": 0}
    while engine.has_work():
        batch = engine.scheduler.schedule()
        plan = batch.plan()
        for planned in plan.requests:
            assert all(_ids_and_ints(getattr(planned, f.name)) for f in dataclasses.fields(planned))
        for direction in ("device_to_device", "device_to_host", "host_to_device"):
            assert _ids_and_ints(getattr(plan.copies, direction))
        keys = engine.cache.key_caches[0]
        pairs = plan.copies.device_to_device
        seen["copied_by_the_worker"] += sum(not torch.equal(keys[s], keys[t]) for s, t in pairs)
        engine.runner.copy_blocks(plan.copies)
        assert all(torch.equal(keys[s], keys[t]) for s, t in pairs)
        for direction in ("device_to_device", "device_to_host"):
            seen[direction] += len(getattr(plan.copies, direction))
        for state in batch.filled_the_cache:
            engine._end(state, RequestStatus.FINISHED)
        if batch.requests:
            engine.update_from_output(batch, [engine.runner.execute(batch)])
    engine.check()
    # Forks and swap-outs happened, and the forks' blocks differed from their sources until the worker copied them.
    assert seen["device_to_device"] > 0 and seen["device_to_host"] > 0 and seen["copied_by_the_worker"] > 0, seen


def test_a_steps_kernel_plans_are_made_once_and_reused_by_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU kernels' work split and block-table validation are per step, not per layer: one plan per step (per
    window and head shape), and every layer's kernel call runs over it, writing into the layer's output."""
    from cbcore import _C

    calls = {"plan_decode": 0, "decode_attention_planned": 0, "plan_prefill": 0, "prefill_attention_planned": 0}
    for name in calls:
        original = getattr(_C, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(_C, name, counted)
    model = tiny_model("llama_gqa")
    engine = engine_for(model, greedy_config(3), page_size=4, num_blocks=64)
    num_layers = model.config.num_hidden_layers
    prompts = random_prompts([5, 9], seed=76)
    for index, prompt in enumerate(prompts):
        engine.add_request(request(index, prompt, 3))
    engine.step()  # both prompts: one prefill step
    assert calls["plan_prefill"] == 1 and calls["prefill_attention_planned"] == num_layers, calls
    engine.step()  # both decode
    assert calls["plan_decode"] == 1 and calls["decode_attention_planned"] == num_layers, calls
    finals = run_to_the_end(engine)
    for index, prompt in enumerate(prompts):
        assert finals[f"req_{index}"].generated_tokens == reference_tokens(model, prompt, greedy_config(3))


def test_priorities_order_admission_and_spare_the_urgent_from_preemption() -> None:
    """`priority` (lower first): waiting requests are admitted in (priority, arrival) order, and when blocks run out
    the least urgent running request is preempted, never a more urgent one; outputs stay exact."""
    model = tiny_model("llama_gqa")
    engine = engine_for(model, greedy_config(4), page_size=4, num_blocks=64, max_requests_per_batch=1,
                        per_request_processors=True)
    prompts = random_prompts([5, 6, 7], seed=77)
    for index, (prompt, priority) in enumerate(zip(prompts, (5, 0, 5))):
        state = request(index, prompt, 4)
        state.logit_processor_kwargs = {"priority": priority}
        engine.add_request(state)
    finished = []
    while engine.has_work():
        finished += [o.request_id for o in engine.step() if o.is_finished()]
    assert finished == ["req_1", "req_0", "req_2"]

    # Preemption: a less urgent request admitted first, an urgent one after it; when the urgent one needs a block
    # and none is free, the less urgent one is preempted (by arrival alone, the urgent newcomer would have been).
    engine = engine_for(model, greedy_config(12), page_size=4, num_blocks=7, max_batch_tokens=64,
                        per_request_processors=True)
    first, second = random_prompts([12, 12], seed=78)
    relaxed = request(0, first, 12)
    relaxed.logit_processor_kwargs = {"priority": 9}
    engine.add_request(relaxed)
    engine.step()  # its prompt, alone
    urgent = request(1, second, 12)
    urgent.logit_processor_kwargs = {"priority": -1}
    engine.add_request(urgent)
    preempted, finals = [], {}
    while engine.has_work():
        before = engine.stats()["preemptions"]
        for output in engine.step():
            if output.is_finished():
                finals[output.request_id] = output
        if engine.stats()["preemptions"] > before:
            preempted += [s.request_id for s in engine.scheduler.waiting]
    assert preempted and set(preempted) == {"req_0"}
    for index, prompt in enumerate((first, second)):
        assert finals[f"req_{index}"].generated_tokens == reference_tokens(model, prompt, greedy_config(12))
    engine.check()
