"""The same scenarios through transformers' own continuous batching (5.24) and through cbcore: what a caller sees
must be the same — result ids and order, statuses, tokens, logprobs, streaming chunks, timestamps, and the queue's
behaviour — except the deliberate differences, which have their own tests (tests/test_differences.py and the README).

transformers' entry points are called through the model's class (`type(model).generate_batch(model, ...)`), since
`cbcore.enable(model)` replaces them on the instance.
"""

from __future__ import annotations

import pytest
from transformers import ContinuousBatchingConfig as TransformersCBConfig
from transformers import GenerationConfig

import cbcore
from conftest import VOCAB, random_prompts, tiny_model

EOS = VOCAB - 1  # explicit, so both sides agree on it (the README's Differences table says how EOS is resolved)
# An explicit cache size for the queue scenarios: sized from memory, transformers' manager on a CPU allocates and
# zero-fills about half the machine at start(), which on a busy 2-core machine outlasts the tests' 30 s waits.
SMALL_CACHE = dict(page_size=16, num_blocks=64)


def generation_config(**kwargs) -> GenerationConfig:
    defaults = dict(max_new_tokens=10, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    defaults.update(kwargs)
    return GenerationConfig(**defaults)


def both_generate_batch(model, prompts, gen_config, **cb_kwargs):
    """generate_batch through transformers, then through cbcore, with equal settings."""
    theirs = type(model).generate_batch(
        model, prompts, generation_config=gen_config, continuous_batching_config=TransformersCBConfig(**cb_kwargs)
    )
    cbcore.enable(model)
    ours = model.generate_batch(prompts, generation_config=gen_config,
                                continuous_batching_config=cbcore.ContinuousBatchingConfig(**cb_kwargs))
    return theirs, ours


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2"])
def test_generate_batch_gives_the_same_results_ids_order_statuses_tokens_and_logprobs(kind: str) -> None:
    model = tiny_model(kind)
    prompts = random_prompts([1, 6, 19, 33, 4], seed=70)
    theirs, ours = both_generate_batch(model, prompts, generation_config(), page_size=16, num_blocks=64,
                                       max_batch_tokens=32, return_logprobs=True)
    assert list(ours) == list(theirs)
    for rid in theirs:
        assert ours[rid].status == theirs[rid].status
        assert ours[rid].prompt_ids == theirs[rid].prompt_ids
        assert ours[rid].generated_tokens == theirs[rid].generated_tokens
        assert ours[rid].logprobs == pytest.approx(theirs[rid].logprobs, abs=1e-5)
        assert ours[rid].error is None and theirs[rid].error is None


def test_generate_batch_with_children_uses_the_same_ids_and_order() -> None:
    model = tiny_model("llama_gqa")
    config = generation_config(do_sample=True, top_k=1, num_return_sequences=3, max_new_tokens=5)
    prompts = random_prompts([7, 3], seed=71)
    theirs, ours = both_generate_batch(model, prompts, config, page_size=16, num_blocks=64)
    assert list(ours) == list(theirs)
    for rid in theirs:
        assert ours[rid].generated_tokens == theirs[rid].generated_tokens


def test_timestamps_come_one_per_token_on_both() -> None:
    model = tiny_model("qwen2")
    prompts = random_prompts([5, 12], seed=72)
    theirs = type(model).generate_batch(model, prompts, generation_config=generation_config(), record_timestamps=True,
                                        continuous_batching_config=TransformersCBConfig(page_size=16, num_blocks=32))
    cbcore.enable(model)
    ours = model.generate_batch(prompts, generation_config=generation_config(), record_timestamps=True,
                                continuous_batching_config=cbcore.ContinuousBatchingConfig(page_size=16, num_blocks=32))
    for rid in theirs:
        assert len(ours[rid].timestamps) == len(theirs[rid].timestamps) == len(theirs[rid].generated_tokens)


def run_streaming(manager, prompt):
    manager.start()
    try:
        request_id = manager.add_request(prompt, streaming=True)
        return request_id, [(len(c.generated_tokens), c.status, c.is_finished()) for c in manager.request_id_iter(request_id)]
    finally:
        manager.stop(block=True)


def test_streaming_chunks_are_the_same_sequence() -> None:
    model = tiny_model("llama_gqa")
    prompt = random_prompts([9], seed=73)[0]
    theirs = run_streaming(type(model).init_continuous_batching(
        model, generation_config=generation_config(max_new_tokens=6),
        continuous_batching_config=TransformersCBConfig(page_size=16, num_blocks=32)), prompt)
    ours = run_streaming(cbcore.ContinuousBatchingManager(model, generation_config(max_new_tokens=6),
                                                          cbcore.ContinuousBatchingConfig(page_size=16, num_blocks=32)), prompt)
    assert ours == theirs
    assert ours[0] == "req_0"


def test_get_result_times_out_and_returns_none_when_nothing_is_running() -> None:
    model = tiny_model("qwen2")
    transformers_manager = type(model).init_continuous_batching(
        model, generation_config=generation_config(), continuous_batching_config=TransformersCBConfig(**SMALL_CACHE))
    cbcore_manager = cbcore.ContinuousBatchingManager(model, generation_config(), cbcore.ContinuousBatchingConfig(**SMALL_CACHE))
    for manager in (transformers_manager, cbcore_manager):
        assert manager.get_result(timeout=0.05) is None  # not started: None at once
        manager.start()
        try:
            assert manager.get_result(timeout=0.1) is None  # running, nothing queued: None after the timeout
            request_id = manager.add_request([1, 2, 3], max_new_tokens=2)
            result = manager.get_result(timeout=30)
            assert result.request_id == request_id and result.is_finished()
        finally:
            manager.stop(block=True)
        assert not manager.is_running()


def test_request_ids_follow_the_same_conventions() -> None:
    model = tiny_model("qwen2")
    transformers_manager = type(model).init_continuous_batching(
        model, generation_config=generation_config(), continuous_batching_config=TransformersCBConfig(**SMALL_CACHE))
    cbcore_manager = cbcore.ContinuousBatchingManager(model, generation_config(), cbcore.ContinuousBatchingConfig(**SMALL_CACHE))
    seen = []
    for manager in (transformers_manager, cbcore_manager):
        manager.start()
        try:
            ids = [manager.add_request([1, 2]), manager.add_request([3], request_id="mine")]
            ids += manager.add_requests([[4], [5, 6]])
            finals = {}
            while len(finals) < 4:
                output = manager.get_result(timeout=30)
                finals[output.request_id] = output.status
        finally:
            manager.stop(block=True)
        seen.append((ids, sorted(finals)))
    assert seen[0] == seen[1]
    assert seen[1][0] == ["req_0", "mine", "req_1", "req_2"]
