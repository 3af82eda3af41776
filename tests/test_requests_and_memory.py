"""Bad input fails that request alone; memory pressure loses nothing; default sizing stays bounded on the CPU; the
model stays usable while a manager holds it."""

from __future__ import annotations

import psutil
import pytest
import torch

import cbcore
from cbcore.engine.sizing import CPU_CACHE_CAP_BYTES
from conftest import (
    VOCAB,
    assert_engine_clean,
    collect_outputs,
    greedy_config,
    random_prompts,
    reference_tokens,
    run_engine,
    tiny_model,
)


def serve(model, requests: list[dict], config: cbcore.ContinuousBatchingConfig, max_new_tokens: int = 6):
    """Add each request (kwargs of add_request) and return (ids, outputs by id, stopped manager)."""
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(max_new_tokens), config)
    manager.start()
    try:
        ids = [manager.add_request(**request) for request in requests]
        outputs = collect_outputs(manager, ids)
    finally:
        manager.stop()
    assert_engine_clean(manager)
    return ids, outputs, manager


def test_invalid_prompts_fail_alone_with_a_message_naming_the_problem() -> None:
    model = tiny_model("llama_gqa")
    good = random_prompts([5, 12], seed=2)
    requests = [
        {"input_ids": good[0]},
        {"input_ids": []},
        {"input_ids": [1, 2, VOCAB + 3]},
        {"input_ids": [1, -2, 3]},
        {"input_ids": good[1]},
    ]
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=32)
    ids, outputs, _ = serve(model, requests, config)
    failed = {rid: out.error for rid, out in outputs.items() if out.status == cbcore.RequestStatus.FAILED}
    assert set(failed) == {ids[1], ids[2], ids[3]}
    assert "empty prompt" in failed[ids[1]] and ids[1] in failed[ids[1]]
    assert f"token id {VOCAB + 3}" in failed[ids[2]] and "vocabulary" in failed[ids[2]]
    assert "token id -2" in failed[ids[3]]
    for index in (0, 4):
        output = outputs[ids[index]]
        assert output.status == cbcore.RequestStatus.FINISHED
        assert output.generated_tokens == reference_tokens(model, requests[index]["input_ids"], greedy_config(6))


def test_malformed_arguments_raise_in_add_request_naming_the_argument() -> None:
    model = tiny_model("llama_gqa")
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(4), cbcore.ContinuousBatchingConfig(page_size=4))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        manager.add_request([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"request k: logits-processor kwargs \['no_such_processor_kwarg'\]"):
        manager.add_request([1, 2], request_id="k", no_such_processor_kwarg=3)
    manager.add_request([1, 2], request_id="twice")
    with pytest.raises(ValueError, match="request twice: duplicate request id"):
        manager.add_request([3, 4], request_id="twice")
    manager.start()
    try:
        outputs = collect_outputs(manager, ["twice"])
    finally:
        manager.stop()
    assert outputs["twice"].prompt_ids == [1, 2]
    assert_engine_clean(manager)


def test_request_that_can_never_fit_fails_alone_and_says_what_to_change() -> None:
    model = tiny_model("qwen2")
    fits, too_long = random_prompts([10, 40], seed=4)
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=8)  # 32 tokens at most per request
    ids, outputs, _ = serve(model, [{"input_ids": fits}, {"input_ids": too_long}, {"input_ids": fits[:3]}], config)
    error = outputs[ids[1]].error
    assert outputs[ids[1]].status == cbcore.RequestStatus.FAILED
    assert ids[1] in error and "40 tokens" in error and "num_blocks=8" in error and "raise num_blocks" in error
    assert outputs[ids[0]].generated_tokens == reference_tokens(model, fits, greedy_config(6))
    assert outputs[ids[2]].generated_tokens == reference_tokens(model, fits[:3], greedy_config(6))


def test_unbounded_request_ends_when_it_fills_the_whole_cache() -> None:
    """max_new_tokens=None is bounded by the cache's capacity rather than failing."""
    model = tiny_model("llama_gqa")
    prompt = random_prompts([6], seed=9)[0]
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=4)  # 16 tokens
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(None), config)
    manager.start()
    try:
        outputs = collect_outputs(manager, [manager.add_request(prompt, eos_token_id=-1)])
    finally:
        manager.stop()
    output = list(outputs.values())[0]
    assert output.status == cbcore.RequestStatus.FINISHED
    # 16 cached tokens: 6 prompt + 10 generated computed, plus the last generated token (never cached): 11 generated.
    assert len(output.generated_tokens) == 11
    assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(11))
    assert_engine_clean(manager)


def test_preempted_requests_are_recomputed_with_unchanged_output() -> None:
    model = tiny_model("mistral_sliding")
    prompts = random_prompts([13, 21, 8, 30, 17, 25], seed=14)
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=12, max_batch_tokens=64)
    outputs, manager = run_engine(model, prompts, greedy_config(16), config)
    assert manager.num_preemptions > 0
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(16))


def test_steps_respect_token_and_request_budgets() -> None:
    model = tiny_model("llama_gqa")
    config = cbcore.ContinuousBatchingConfig(page_size=4, max_batch_tokens=10, max_requests_per_batch=3)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(5), config)
    manager.warmup()
    seen: list[tuple[int, int]] = []
    execute = manager.runner.execute

    def spy(batch):
        seen.append((batch.num_tokens, len(batch.requests)))
        return execute(batch)

    manager.runner.execute = spy
    prompts = random_prompts([23, 4, 17, 9, 1], seed=6)
    manager.start()
    try:
        outputs = collect_outputs(manager, manager.add_requests(prompts))
    finally:
        manager.stop()
    assert max(tokens for tokens, _ in seen) == 10  # long prompts were chunked to the budget
    assert max(requests for _, requests in seen) <= 3
    for rid, prompt in zip(sorted(outputs, key=lambda r: int(r.split("_")[1])), prompts):
        assert outputs[rid].generated_tokens == reference_tokens(model, prompt, greedy_config(5))


def test_default_cache_size_on_cpu_is_a_bounded_share_of_memory() -> None:
    model = tiny_model("llama_gqa")
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(4), cbcore.ContinuousBatchingConfig())
    manager.warmup()
    assert manager.cache.nbytes <= CPU_CACHE_CAP_BYTES
    assert manager.cache.nbytes <= 0.6 * psutil.virtual_memory().available
    assert manager.continuous_batching_config.num_blocks == manager.cache.num_blocks
    manager.destroy()


def test_a_large_cpu_cache_costs_memory_only_for_the_pages_a_workload_touches() -> None:
    """The CPU cache is zero pages from the kernel, faulted in when first written: building an engine no longer
    writes every byte of it (W2's 0.8 GB cache took 0.18 s of each generate_batch to zero)."""
    model = tiny_model("llama_gqa")
    page_size = 64
    probe = cbcore.ContinuousBatchingManager(model, greedy_config(4), cbcore.ContinuousBatchingConfig(num_blocks=1,
                                                                                                       page_size=page_size))
    probe.warmup()
    block_bytes = probe.cache.nbytes
    probe.destroy()
    num_blocks = (1 << 30) // block_bytes  # 1 GiB of K/V
    process = psutil.Process()
    before = process.memory_info().rss
    config = cbcore.ContinuousBatchingConfig(num_blocks=num_blocks, page_size=page_size)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(4), config)
    manager.warmup()
    assert manager.cache.nbytes >= 1 << 29
    assert process.memory_info().rss - before < manager.cache.nbytes // 4
    for tensor in manager.cache.key_caches + manager.cache.value_caches:
        assert tensor.is_contiguous() and torch.count_nonzero(tensor) == 0  # reading untouched pages maps no memory
    prompt = random_prompts([9], seed=3)[0]
    manager.start()
    try:
        outputs = collect_outputs(manager, [manager.add_request(prompt, request_id="r", max_new_tokens=5)])
    finally:
        manager.stop()
    assert outputs["r"].generated_tokens == reference_tokens(model, prompt, greedy_config(5))
    assert_engine_clean(manager)
    assert process.memory_info().rss - before < manager.cache.nbytes // 4
    manager.destroy()


def test_workload_hints_shrink_the_default_cache_to_what_the_workload_can_use() -> None:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = tiny_model("llama_gqa")
    hints = WorkloadHints(max_prompt_length=30, max_generated_length=10, num_requests=4)
    config = cbcore.ContinuousBatchingConfig(page_size=16)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(4), config, hints)
    manager.warmup()
    # Each of the 4 requests rounds its 40 tokens up to 3 pages of 16; one block of slack.
    assert manager.cache.num_blocks == 4 * 3 + 1
    manager.destroy()


def test_model_stays_usable_while_a_manager_holds_it_and_is_restored_after() -> None:
    model = tiny_model("qwen2")
    prompt = random_prompts([11], seed=1)[0]
    before = reference_tokens(model, prompt, greedy_config(6))
    original = model.config._attn_implementation
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(6), cbcore.ContinuousBatchingConfig(page_size=4))
    manager.start()
    try:
        assert reference_tokens(model, prompt, greedy_config(6)) == before  # generate() on another thread's model
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits
        assert logits.shape == (1, len(prompt), VOCAB)
    finally:
        manager.stop()
    assert model.config._attn_implementation == original


def test_callers_generation_config_is_not_mutated() -> None:
    model = tiny_model("llama_gqa")
    config = greedy_config(5)
    before = config.to_dict()
    cb_config = cbcore.ContinuousBatchingConfig(page_size=8)
    run_engine(model, random_prompts([4], seed=0), config, cb_config)
    assert config.to_dict() == before
    assert cb_config.num_blocks is None and cb_config.max_batch_tokens is None


@pytest.mark.parametrize("max_new_tokens", [1, 3])
def test_short_generations(max_new_tokens: int) -> None:
    model = tiny_model("llama_head_dim_128")
    prompts = random_prompts([1, 4, 9], seed=max_new_tokens)
    outputs, _ = run_engine(model, prompts, greedy_config(max_new_tokens), cbcore.ContinuousBatchingConfig(page_size=4))
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(max_new_tokens))


def test_a_preempted_request_is_not_preempted_again_before_it_makes_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    from cbcore.scheduler import Scheduler

    model = tiny_model("llama_gqa")
    prompts = random_prompts([13, 21, 8, 30, 17, 25, 11, 19], seed=15)
    preemptions: list[tuple[str, int]] = []
    original = Scheduler._preempt

    def spy(self, state, batch):
        preemptions.append((state.request_id, len(state.generated_tokens)))
        original(self, state, batch)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    # Small chunks: a recompute spans several steps, during which the others keep needing blocks.
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=14, max_batch_tokens=8)
    outputs, manager = run_engine(model, prompts, greedy_config(20), config)
    assert len(preemptions) >= 5
    for request_id in {rid for rid, _ in preemptions}:
        progress = [generated for rid, generated in preemptions if rid == request_id]
        assert progress == sorted(set(progress)), f"{request_id} was preempted again without progress: {progress}"
    stats = manager.stats()
    assert stats["preemptions"] == len(preemptions)
    assert stats["recomputed_tokens"] > 0
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(20))
