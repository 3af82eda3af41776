"""The manager's public API, behaviour by behaviour: lifecycle, results, streaming, control, children, sampling
parameters per request, and failures that stay local."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest
import torch
from transformers import GenerationConfig

import cbcore
import cbcore.serving.submission as manager_module
from cbcore.cache import PagedKVCache
from conftest import (
    assert_engine_clean,
    collect_outputs,
    greedy_config,
    random_prompts,
    reference_tokens,
    run_engine,
    tiny_model,
)


def started(model, generation_config, **cb_kwargs) -> cbcore.ContinuousBatchingManager:
    manager = cbcore.ContinuousBatchingManager(model, generation_config, cbcore.ContinuousBatchingConfig(**cb_kwargs))
    manager.start()
    return manager


# ---- lifecycle ---------------------------------------------------------------------------------------------------


def test_flush_stop_finishes_every_queued_request() -> None:
    model = tiny_model("llama_gqa")
    prompts = random_prompts([5, 9, 14], seed=50)
    manager = started(model, greedy_config(10), page_size=4)
    ids = manager.add_requests(prompts)
    manager.stop(block=True)  # flush: everything queued still finishes
    outputs = {}
    while (output := manager.get_result(timeout=0)) is not None:
        outputs[output.request_id] = output
    for rid, prompt in zip(ids, prompts):
        assert outputs[rid].status == cbcore.RequestStatus.FINISHED
        assert outputs[rid].generated_tokens == reference_tokens(model, prompt, greedy_config(10))
    assert_engine_clean(manager)


def test_hard_stop_fails_pending_requests_with_their_partial_tokens() -> None:
    model = tiny_model("llama_gqa")
    manager = started(model, greedy_config(2000), page_size=16, num_blocks=512)
    ids = manager.add_requests(random_prompts([4, 6], seed=51))
    first = manager.get_result(timeout=0.5)
    assert first is None  # still generating
    while manager.stats()["generated_tokens"] < 6:
        threading.Event().wait(0.01)
    manager.stop(block=True, hard_stop=True)
    finals = {}
    while (output := manager.get_result(timeout=0)) is not None:
        finals[output.request_id] = output
    assert set(finals) == set(ids)
    for output in finals.values():
        assert output.status == cbcore.RequestStatus.FAILED
        assert "hard_stop" in output.error
        assert 0 < len(output.generated_tokens) < 2000
    assert_engine_clean(manager)


def test_destroy_is_safe_twice_and_restores_the_attention() -> None:
    model = tiny_model("qwen2")
    original = model.config._attn_implementation
    manager = started(model, greedy_config(3), page_size=4)
    manager.destroy()
    manager.destroy()
    assert not manager.is_running()
    assert model.config._attn_implementation == original


def test_stop_from_inside_a_pause_raises_instead_of_hanging() -> None:
    manager = started(tiny_model("qwen2"), greedy_config(3), page_size=4)
    try:
        with manager.pause():
            with pytest.raises(RuntimeError, match="inside a pause"):
                manager.stop()
    finally:
        manager.stop()


def test_pause_without_a_running_loop_raises() -> None:
    manager = cbcore.ContinuousBatchingManager(tiny_model("qwen2"), greedy_config(3), cbcore.ContinuousBatchingConfig())
    with pytest.raises(RuntimeError, match="no generation loop"):
        with manager.pause():
            pass


def test_persistent_manager_is_reused_then_destroyed() -> None:
    model = tiny_model("llama_gqa")
    cbcore.enable(model)
    prompts = random_prompts([6, 3], seed=52)
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=32)
    first = model.generate_batch(prompts, generation_config=greedy_config(4), continuous_batching_config=config,
                                 persistent_manager=True)
    cached = model._cached_continuous_batching_manager
    assert model.init_continuous_batching() is cached
    second = model.generate_batch(prompts, generation_config=greedy_config(4), persistent_manager=True)
    assert [o.generated_tokens for o in first.values()] == [o.generated_tokens for o in second.values()]
    assert list(second) == ["req_2", "req_3"]  # the same manager kept counting
    assert cached.prefix_hit_tokens == 4  # the 6-token prompt's first block came from the kept prefix cache
    model.destroy_cached_continuous_batching_manager()
    assert not hasattr(model, "_cached_continuous_batching_manager")
    assert model.config._attn_implementation == "sdpa"


def test_context_manager_starts_and_stops_the_loop() -> None:
    model = tiny_model("qwen2")
    cbcore.enable(model)
    with model.continuous_batching_context_manager(generation_config=greedy_config(3)) as manager:
        assert manager.is_running()
        request_id = manager.add_request([1, 2, 3])
        assert manager.get_result(request_id, timeout=30).is_finished()
    assert not manager.is_running()


# ---- results, streaming, timestamps --------------------------------------------------------------------------------


def test_streaming_delivers_cumulative_snapshots_then_one_terminal_output() -> None:
    model = tiny_model("llama_gqa")
    prompt = random_prompts([7], seed=53)[0]
    manager = started(model, greedy_config(6), page_size=4)
    try:
        request_id = manager.add_request(prompt, streaming=True)
        chunks = list(manager.request_id_iter(request_id))
    finally:
        manager.stop()
    assert [len(c.generated_tokens) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert [c.is_finished() for c in chunks] == [False] * 5 + [True]
    for shorter, longer in zip(chunks, chunks[1:]):
        assert longer.generated_tokens[: len(shorter.generated_tokens)] == shorter.generated_tokens
    assert chunks[-1].generated_tokens == reference_tokens(model, prompt, greedy_config(6))


def test_record_timestamps_gives_one_increasing_stamp_per_token_and_a_lifespan() -> None:
    model = tiny_model("qwen2")
    manager = started(model, greedy_config(5), page_size=4)
    try:
        output = collect_outputs(manager, [manager.add_request([3, 4, 5], record_timestamps=True)])["req_0"]
        untimed = collect_outputs(manager, [manager.add_request([3, 4, 5])])["req_1"]
    finally:
        manager.stop()
    assert len(output.timestamps) == 5 and output.timestamps == sorted(output.timestamps)
    assert output.created_time <= output.lifespan[0] <= output.timestamps[0] <= output.timestamps[-1] <= output.lifespan[1]
    assert untimed.timestamps is None


def test_result_handler_delivers_on_the_asyncio_loop() -> None:
    model = tiny_model("llama_gqa")
    manager = started(model, greedy_config(4), page_size=4)

    async def serve() -> list:
        received: list = []
        done = asyncio.Event()
        loop_thread = threading.get_ident()

        def on_output(output) -> None:
            assert threading.get_ident() == loop_thread  # called on the event loop's thread
            received.append(output)
            if output.is_finished():
                done.set()

        manager.register_result_handler("streamed", on_output)
        manager.add_request([5, 6, 7], request_id="streamed", streaming=True)
        await asyncio.wait_for(done.wait(), timeout=30)
        return received

    try:
        received = asyncio.run(serve())
    finally:
        manager.stop()
    assert [len(o.generated_tokens) for o in received] == [1, 2, 3, 4]
    assert manager.output_router.empty()


def test_iterating_the_manager_yields_every_output() -> None:
    model = tiny_model("qwen2")
    manager = started(model, greedy_config(3), page_size=4)
    ids = manager.add_requests(random_prompts([2, 5, 8], seed=54))
    seen = []
    for output in manager:
        seen.append(output.request_id)
        if len(seen) == len(ids):
            break
    manager.stop()
    assert sorted(seen) == sorted(ids)


def test_eos_token_id_may_be_a_list() -> None:
    model = tiny_model("qwen2")
    prompt = random_prompts([9], seed=3)[0]
    free_run = reference_tokens(model, prompt, greedy_config(12))
    eos = [free_run[5], free_run[3]]
    outputs, _ = run_engine(model, [prompt], greedy_config(12, eos_token_id=eos), cbcore.ContinuousBatchingConfig(page_size=4))
    assert outputs["req_0"].generated_tokens == reference_tokens(model, prompt, greedy_config(12, eos_token_id=eos))
    assert outputs["req_0"].generated_tokens[-1] in eos


# ---- control -----------------------------------------------------------------------------------------------------


def test_pause_held_by_two_threads_freezes_the_loop_and_loses_nothing() -> None:
    model = tiny_model("llama_gqa")
    prompts = random_prompts([5, 11, 17, 3], seed=55)
    manager = started(model, greedy_config(30), page_size=4)
    ids = manager.add_requests(prompts)
    both_inside = threading.Barrier(3)
    release = threading.Event()
    frozen_steps = []

    def hold_pause() -> None:
        with manager.pause():
            both_inside.wait(timeout=30)
            release.wait(timeout=30)

    holders = [threading.Thread(target=hold_pause) for _ in range(2)]
    for thread in holders:
        thread.start()
    both_inside.wait(timeout=30)
    frozen_steps.append(manager.stats()["steps"])
    threading.Event().wait(0.3)
    frozen_steps.append(manager.stats()["steps"])
    release.set()
    for thread in holders:
        thread.join(timeout=30)
    outputs = collect_outputs(manager, ids)
    manager.stop()
    assert frozen_steps[0] == frozen_steps[1]
    for rid, prompt in zip(ids, prompts):
        assert outputs[rid].generated_tokens == reference_tokens(model, prompt, greedy_config(30))
    assert_engine_clean(manager)


def test_full_input_queue_pushes_back_with_queue_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_module, "ADD_REQUEST_TIMEOUT_S", 0.2)
    manager = started(tiny_model("qwen2"), greedy_config(3), page_size=4, max_queue_size=2)
    try:
        with manager.pause():  # the loop does not drain the queue meanwhile
            manager.add_request([1, 2])
            manager.add_request([3, 4])
            with pytest.raises(queue.Full):
                manager.add_request([5, 6])
        assert collect_outputs(manager, ["req_0", "req_1"])
    finally:
        manager.stop()


def test_a_failing_forward_fails_its_batch_and_the_loop_goes_on() -> None:
    model = tiny_model("llama_gqa")
    manager = started(model, greedy_config(4), page_size=4)
    original = manager.runner.execute
    calls = {"n": 0}

    def failing_once(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return original(batch)

    manager.runner.execute = failing_once
    try:
        doomed = collect_outputs(manager, [manager.add_request([1, 2, 3])])
        prompt = random_prompts([6], seed=56)[0]
        survivor = collect_outputs(manager, [manager.add_request(prompt)])
    finally:
        manager.stop()
    assert doomed["req_0"].status == cbcore.RequestStatus.FAILED and "injected failure" in doomed["req_0"].error
    assert survivor["req_1"].generated_tokens == reference_tokens(model, prompt, greedy_config(4))
    assert_engine_clean(manager)


# ---- num_return_sequences ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_length", [1, 4, 10])  # no prompt block, a full block, a partial last block
def test_children_share_the_prompt_blocks_and_top_k_one_children_equal_greedy(
    prompt_length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("llama_gqa")
    prompt = random_prompts([prompt_length], seed=57)[0]
    # transformers refuses num_return_sequences with do_sample=False; top_k=1 sampling is greedy.
    config = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1, eos_token_id=None, pad_token_id=0,
                              num_return_sequences=3)
    forks = []
    original_fork = PagedKVCache.fork

    def spy_fork(cache, parent, child):
        original_fork(cache, parent, child)
        forks.append((list(parent.block_table), list(child.block_table),
                      [cache.allocator.refcount(b) for b in child.block_table]))

    monkeypatch.setattr(PagedKVCache, "fork", spy_fork)
    cbcore.enable(model)
    outputs = model.generate_batch([prompt, prompt[:1]], generation_config=config,
                                   continuous_batching_config=cbcore.ContinuousBatchingConfig(page_size=4))
    # The parent computed all but its last prompt token; full blocks are shared, a partial one is copied.
    full, partial = divmod(prompt_length - 1, 4)
    longest = max(len(record[0]) for record in forks)
    parent_table, child_table, refcounts = [r for r in forks if len(r[0]) == longest][-1]  # req_0's second child
    assert len(forks) == 4  # two children for each of the two requests
    assert child_table[:full] == parent_table[:full]
    assert all(count == 3 for count in refcounts[:full])  # parent + 2 children
    if partial:
        assert child_table[full] != parent_table[full] and refcounts[full] == 1
    assert list(outputs) == ["req_0__child#0", "req_0__child#1", "req_0", "req_1__child#0", "req_1__child#1", "req_1"]
    want = reference_tokens(model, prompt, greedy_config(6))
    for rid in ("req_0__child#0", "req_0__child#1", "req_0"):
        assert outputs[rid].generated_tokens == want
        assert outputs[rid].prompt_ids == prompt


def test_sampled_children_differ_and_reproduce_with_a_seed() -> None:
    model = tiny_model("qwen2")
    config = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=1.5, eos_token_id=None, pad_token_id=0,
                              num_return_sequences=4)
    prompt = random_prompts([9], seed=58)[0]

    def run():
        manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(page_size=4, seed=7))
        manager.start()
        try:
            request_id = manager.add_request(prompt)
            ids = [f"{request_id}__child#{i}" for i in range(3)] + [request_id]
            outputs = collect_outputs(manager, ids)
        finally:
            manager.stop()
        assert_engine_clean(manager)
        return [tuple(outputs[rid].generated_tokens) for rid in ids]

    first = run()
    assert len(set(first)) > 1
    assert run() == first


# ---- per-request processors --------------------------------------------------------------------------------------


def test_per_request_top_k_one_equals_greedy_and_bad_kwargs_raise_in_add_request() -> None:
    model = tiny_model("llama_gqa")
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.4, eos_token_id=None, pad_token_id=0)
    prompt = random_prompts([8], seed=59)[0]
    manager = started(model, config, page_size=4, per_request_processors=True, seed=3)
    try:
        with pytest.raises(TypeError, match="top_k must be an int"):
            manager.add_request(prompt, top_k="1")
        with pytest.raises(TypeError, match="tmperature"):
            manager.add_request(prompt, tmperature=0.3)
        ids = [
            manager.add_request(prompt, top_k=1),
            manager.add_request(prompt, top_k=1, temperature=0.5, top_p=0.9),
        ]
        outputs = collect_outputs(manager, ids)
    finally:
        manager.stop()
    want = reference_tokens(model, prompt, greedy_config(6))
    assert outputs[ids[0]].generated_tokens == want
    assert outputs[ids[1]].generated_tokens == want
    assert ids == ["req_0", "req_1"]  # the refused calls took no id
    assert_engine_clean(manager)


def test_processor_kwargs_without_per_request_processors_raise_with_advice() -> None:
    manager = started(tiny_model("qwen2"), greedy_config(3), page_size=4)
    try:
        with pytest.raises(ValueError, match="per_request_processors=True"):
            manager.add_request([1, 2], temperature=0.7)
    finally:
        manager.stop()


def test_model_inference_mode_of_the_caller_is_used_by_the_loop() -> None:
    model = tiny_model("qwen2")
    with torch.inference_mode():
        manager = started(model, greedy_config(3), page_size=4)
        output = manager.get_result(manager.add_request([1, 2, 3]), timeout=30)
        manager.stop()
    assert output.is_finished()


def test_a_training_forward_after_generation_is_unaffected() -> None:
    model = tiny_model("llama_gqa")
    batch = torch.tensor([random_prompts([12], seed=60)[0]])

    def loss_and_grad_norm() -> tuple[float, float]:
        model.zero_grad()
        loss = model(batch, labels=batch).loss
        loss.backward()
        norm = sum(float(p.grad.norm()) for p in model.parameters() if p.grad is not None)
        model.zero_grad()
        return float(loss.detach()), norm

    before = loss_and_grad_norm()
    cbcore.enable(model)
    model.generate_batch(random_prompts([5, 9], seed=61), generation_config=greedy_config(4))
    assert loss_and_grad_norm() == before
