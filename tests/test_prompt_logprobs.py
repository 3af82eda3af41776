"""Prompt logprobs (`prompt_logprobs=k`) and `manager.score`: equal to a full forward's `log_softmax` (fp32) with
chunked prefill, prefix sharing, `num_return_sequences` children and preemption, computed a bounded number of rows
per step."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_engine_clean, collect_outputs, greedy_config, random_prompts, tiny_model
from transformers import GenerationConfig

import cbcore
import cbcore.engine.core as engine_core


def full_forward_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """`[len(tokens), vocab]` log-softmax of the model's logits over the whole sequence at once."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def assert_prompt_logprobs_exact(model, prompt: list[int], scored: cbcore.PromptLogprobs, k: int) -> None:
    reference = full_forward_logprobs(model, prompt)
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    assert len(scored.token_logprobs) == len(scored.top_logprobs) == len(prompt)
    want = [reference[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    torch.testing.assert_close(torch.tensor(scored.token_logprobs[1:]), torch.tensor(want), rtol=0, atol=2e-5)
    for i in range(1, len(prompt)):
        ids, values = scored.top_logprobs[i]
        top = reference[i - 1].topk(k)
        assert ids == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(values), top.values, rtol=0, atol=2e-5)


def _serve(model, prompts, config, cb_config, **kwargs) -> tuple[dict, cbcore.ContinuousBatchingManager]:
    manager = cbcore.ContinuousBatchingManager(model, config, cb_config)
    manager.start()
    try:
        ids = [manager.add_request(prompt, **kwargs) for prompt in prompts]
        outputs = collect_outputs(manager, ids)
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)
    return {rid: outputs[rid] for rid in ids}, manager


def test_prompt_logprobs_equal_a_full_forward_across_chunks() -> None:
    model = tiny_model("qwen2")
    prompts = random_prompts([1, 2, 9, 37, 64], seed=5)
    outputs, _ = _serve(model, prompts, greedy_config(3),
                        cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=16),
                        prompt_logprobs=3)
    for prompt, output in zip(prompts, outputs.values()):
        assert_prompt_logprobs_exact(model, prompt, output.prompt_logprobs, 3)
    plain, _ = _serve(model, prompts, greedy_config(3),
                      cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=16))
    assert [o.generated_tokens for o in plain.values()] == [o.generated_tokens for o in outputs.values()]
    assert all(o.prompt_logprobs is None for o in plain.values())


def test_a_request_asking_prompt_logprobs_does_not_skip_cached_rows_but_others_share_its_blocks() -> None:
    model = tiny_model("qwen2")
    shared = random_prompts([24], seed=8)[0]
    first, second, third = shared + [5, 6, 7], shared + [9, 10], shared + [11]
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(2), cbcore.ContinuousBatchingConfig(
        page_size=4, num_blocks=128))
    manager.start()
    try:
        outputs = collect_outputs(manager, [manager.add_request(first)])
        hits_before = manager.stats()["prefix_hit_tokens"]
        scored = manager.add_request(second, prompt_logprobs=1)  # its prefix is cached: computed again anyway
        outputs.update(collect_outputs(manager, [scored]))
        assert manager.stats()["prefix_hit_tokens"] == hits_before
        plain = manager.add_request(third)  # shares the cached prefix as usual
        outputs.update(collect_outputs(manager, [plain]))
        assert manager.stats()["prefix_hit_tokens"] > hits_before
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)
    assert_prompt_logprobs_exact(model, second, outputs[scored].prompt_logprobs, 1)


def test_children_of_num_return_sequences_carry_the_prompt_logprobs() -> None:
    model = tiny_model("qwen2")
    prompt = random_prompts([13], seed=2)[0]
    config = GenerationConfig(max_new_tokens=4, do_sample=True, num_return_sequences=3, pad_token_id=0,
                              eos_token_id=None)
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(page_size=4,
                                                                                                num_blocks=64))
    manager.start()
    try:
        rid = manager.add_request(prompt, prompt_logprobs=2)
        family = [f"{rid}__child#0", f"{rid}__child#1", rid]
        outputs = collect_outputs(manager, family)
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)
    for request_id in family:
        assert_prompt_logprobs_exact(model, prompt, outputs[request_id].prompt_logprobs, 2)


def test_prompt_logprobs_survive_preemption_by_recompute() -> None:
    """A cache too small for every request at once: requests are preempted and recomputed mid-prompt and after it;
    the entries already computed are kept, none is duplicated or lost."""
    model = tiny_model("qwen2")
    prompts = random_prompts([30, 26, 34, 22], seed=13)
    outputs, manager = _serve(model, prompts, greedy_config(8),
                              cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=24, max_batch_tokens=12),
                              prompt_logprobs=1)
    assert manager.stats()["preemptions"] > 0
    for prompt, output in zip(prompts, outputs.values()):
        assert_prompt_logprobs_exact(model, prompt, output.prompt_logprobs, 1)


def test_a_step_keeps_at_most_the_scoring_cap_of_prompt_rows(monkeypatch) -> None:
    """The logits kept for scoring are `[rows, vocab]`: the scheduler runs a scoring request's prompt in chunks of
    the cap (here 16 rows) even when the step's token budget would take it whole."""
    model = tiny_model("qwen2")
    vocab = model.get_input_embeddings().num_embeddings
    monkeypatch.setattr(engine_core, "PROMPT_SCORING_BYTES", 16 * 4 * vocab)
    prompt = random_prompts([80], seed=1)[0]
    outputs, manager = _serve(model, [prompt], greedy_config(1),
                              cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=64, max_batch_tokens=256),
                              prompt_logprobs=0)
    assert manager.stats()["steps"] >= 80 // 16
    assert_prompt_logprobs_exact(model, prompt, next(iter(outputs.values())).prompt_logprobs, 0)


def test_score_equals_the_full_forward_and_says_when_the_continuation_is_greedy() -> None:
    model = tiny_model("qwen2")
    prompts = random_prompts([6, 17, 3], seed=21)
    greedy_continuation = [model.generate(torch.tensor([prompts[0]]), attention_mask=torch.ones(1, 6, dtype=torch.long),
                                          generation_config=greedy_config(4))[0, 6:].tolist()]
    continuations = greedy_continuation + random_prompts([5, 1], seed=22)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(4), cbcore.ContinuousBatchingConfig(
        page_size=4, num_blocks=64, max_batch_tokens=8))
    manager.start()
    try:
        scores = manager.score(prompts, continuations)
        with pytest.raises(ValueError, match="prompts\\[0\\] is empty"):
            manager.score([[]], [[1]])
        with pytest.raises(ValueError, match="2 prompts but 1 continuations"):
            manager.score(prompts[:2], continuations[:1])
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)
    for prompt, continuation, score in zip(prompts, continuations, scores):
        reference = full_forward_logprobs(model, prompt + continuation)
        want = [reference[len(prompt) - 1 + i, token].item() for i, token in enumerate(continuation)]
        torch.testing.assert_close(torch.tensor(score.token_logprobs), torch.tensor(want), rtol=0, atol=2e-5)
        assert score.logprob == pytest.approx(sum(want), abs=1e-4)
    assert scores[0].is_greedy and not scores[1].is_greedy
