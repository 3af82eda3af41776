"""Where cbcore deliberately differs from transformers 5.24 (README, "Differences from transformers"): each
difference has its test here or is named in the README next to the test that shows it."""

from __future__ import annotations

import threading

import cbcore
from conftest import assert_engine_clean, collect_outputs, greedy_config, random_prompts, reference_tokens, tiny_model


def test_cancelled_request_gets_one_cancelled_output_and_frees_its_blocks() -> None:
    model = tiny_model("llama_gqa")
    long_prompt, short_prompt = random_prompts([20, 6], seed=40)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(400), cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=256))
    manager.start()
    try:
        doomed = manager.add_request(long_prompt, streaming=True)
        first_chunk = manager.get_result(doomed, timeout=30)  # it is running: a streamed snapshot arrived
        assert first_chunk is not None and not first_chunk.is_finished()
        survivor = manager.add_request(short_prompt, max_new_tokens=8)
        manager.cancel_request(doomed)
        # A streaming reader of the cancelled request ends instead of waiting forever.
        chunks = list(manager.request_id_iter(doomed))
        assert chunks[-1].status == cbcore.RequestStatus.CANCELLED
        assert [c for c in chunks if c.is_finished()] == [chunks[-1]]
        assert len(chunks[-1].generated_tokens) < 400
        survivor_out = collect_outputs(manager, [survivor])[survivor]
    finally:
        manager.stop()
    assert survivor_out.generated_tokens == reference_tokens(model, short_prompt, greedy_config(8))
    assert_engine_clean(manager)


def test_get_result_for_one_request_waits_for_it_and_leaves_others_queued() -> None:
    model = tiny_model("qwen2")
    slow, fast = random_prompts([5, 5], seed=41)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(4), cbcore.ContinuousBatchingConfig(page_size=4))
    manager.start()
    try:
        fast_id = manager.add_request(fast, max_new_tokens=2)
        slow_id = manager.add_request(slow, max_new_tokens=30)
        slow_out = manager.get_result(slow_id, timeout=60)  # transformers: None at once if fast's output is first
        assert slow_out is not None and slow_out.request_id == slow_id and slow_out.is_finished()
        fast_out = manager.get_result(timeout=5)
        assert fast_out is not None and fast_out.request_id == fast_id
    finally:
        manager.stop()


def test_get_result_times_out_with_none_while_the_request_runs() -> None:
    model = tiny_model("qwen2")
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(4), cbcore.ContinuousBatchingConfig(page_size=4))
    manager.start()
    release = threading.Event()
    try:
        with_gate = manager.runner.execute

        def gated(batch):
            release.wait(timeout=30)
            return with_gate(batch)

        manager.runner.execute = gated
        request_id = manager.add_request([1, 2, 3])
        assert manager.get_result(request_id, timeout=0.2) is None
        release.set()
        assert manager.get_result(request_id, timeout=30).is_finished()
    finally:
        release.set()
        manager.stop()


def test_generate_batch_refuses_unknown_keyword_arguments() -> None:
    import pytest

    model = tiny_model("qwen2")
    cbcore.enable(model)
    with pytest.raises(TypeError, match="max_new_tokenz"):
        model.generate_batch([[1, 2]], generation_config=greedy_config(2), max_new_tokenz=3)
