"""Per-request sampling controls (cbcore/sampling_controls.py): the vectorised masks and penalties against a plain
per-row reference written from vLLM's semantics, then end to end through the manager against `model.generate` with
that reference as a logits processor (greedy, fp32), and the finishing rules (stop_token_ids, ignore_eos,
min_tokens). The server's fields of the same names: tests/test_server_scoring.py."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import VOCAB, assert_engine_clean, collect_outputs, greedy_config, random_prompts, tiny_model
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

import cbcore
from cbcore.sampling_controls import ControlRow, apply_before_processors, apply_min_p, check_controls


def reference_controls(row: torch.Tensor, controls: dict, prompt: list[int], output: list[int],
                       stop_tokens: set[int]) -> torch.Tensor:
    """vLLM's order and semantics, one token at a time."""
    row = row.clone()
    if len(output) < controls.get("min_tokens", 0):
        for token in stop_tokens:
            row[token] = -math.inf
    for word in controls.get("bad_words_ids", ()):
        prefix = word[:-1]
        if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
            row[word[-1]] = -math.inf
    for token, bias in controls.get("logit_bias", {}).items():
        row[token] += bias
    penalty = controls.get("repetition_penalty", 1.0)
    for token in set(prompt) | set(output):
        row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    for token in output:
        row[token] -= controls.get("frequency_penalty", 0.0)
    for token in set(output):
        row[token] -= controls.get("presence_penalty", 0.0)
    return row


def reference_min_p(row: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = torch.softmax(row, dim=-1)
    return torch.where(probs >= min_p * probs.max(), row, torch.tensor(-math.inf))


def _random_controls(rng: random.Random, vocab: int) -> dict:
    controls = {}
    if rng.random() < 0.6:
        controls["repetition_penalty"] = rng.choice([0.7, 1.3, 2.0])
    if rng.random() < 0.6:
        controls["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.6:
        controls["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.5:
        controls["logit_bias"] = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(3)}
    if rng.random() < 0.5:
        controls["min_tokens"] = rng.randrange(6)
    if rng.random() < 0.5:
        controls["bad_words_ids"] = [[rng.randrange(vocab)], [rng.randrange(vocab), rng.randrange(vocab)]]
    return controls


@pytest.mark.parametrize("seed", range(5))
def test_masks_biases_and_penalties_equal_the_per_row_reference(seed: int) -> None:
    rng = random.Random(seed)
    vocab, num_rows = 50, 7
    scores = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    rows, expected = [], scores.clone()
    for index in range(num_rows):
        if index == 3:
            continue  # a row without controls stays as it was
        controls = check_controls(_random_controls(rng, vocab), "test")
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        if "bad_words_ids" in controls and output:  # make the two-token word's prefix match now and then
            controls["bad_words_ids"][1][0] = output[-1] if rng.random() < 0.5 else controls["bad_words_ids"][1][0]
        stop = {rng.randrange(vocab), rng.randrange(vocab)}
        rows.append(ControlRow(index, controls, prompt, output, frozenset(stop)))
        expected[index] = reference_controls(scores[index], controls, prompt, output, stop)
    got = apply_before_processors(scores.clone(), rows)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-6, atol=1e-5)


def test_min_p_equals_the_reference_and_keeps_the_most_likely_token() -> None:
    scores = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * 4
    min_p = [0.0, 0.05, 0.3, 1.0, 0.5]
    got = apply_min_p(scores, min_p)
    for row, value in enumerate(min_p):
        assert torch.equal(got[row], reference_min_p(scores[row], value))
        assert torch.isfinite(got[row, scores[row].argmax()])


@pytest.mark.parametrize("kwargs, error", [
    ({"presence_penalty": 2.5}, ValueError), ({"frequency_penalty": math.nan}, TypeError),
    ({"repetition_penalty": 0}, ValueError), ({"logit_bias": {3: 101}}, ValueError),
    ({"logit_bias": [3, 1]}, TypeError), ({"logit_bias": {-1: 1}}, TypeError), ({"min_p": 1.5}, ValueError),
    ({"min_tokens": -1}, ValueError), ({"stop_token_ids": "2"}, TypeError), ({"ignore_eos": 1}, TypeError),
    ({"bad_words_ids": [[]]}, ValueError), ({"bad_words_ids": [1, 2]}, TypeError),
])
def test_bad_control_values_are_refused_by_add_request_naming_them(kwargs: dict, error: type) -> None:
    manager = cbcore.ContinuousBatchingManager(tiny_model("qwen2"), greedy_config(3),
                                               cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=32))
    with pytest.raises(error, match=next(iter(kwargs))):
        manager.add_request([1, 2, 3], **kwargs)


def test_a_control_token_outside_the_vocabulary_fails_that_request_alone() -> None:
    model = tiny_model("qwen2")
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(3),
                                               cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=32))
    manager.start()
    try:
        bad = manager.add_request([1, 2, 3], stop_token_ids=[VOCAB + 5])
        good = manager.add_request([1, 2, 3], stop_token_ids=[4])
        outputs = collect_outputs(manager, [bad, good])
    finally:
        manager.stop(block=True)
    assert outputs[bad].status == cbcore.RequestStatus.FAILED and "stop_token_ids" in outputs[bad].error
    assert outputs[good].status == cbcore.RequestStatus.FINISHED
    assert_engine_clean(manager)


class ReferenceControls(LogitsProcessor):
    """The reference above as a transformers processor, for `model.generate` on one prompt."""

    def __init__(self, controls: dict, prompt_length: int, stop_tokens: set[int]) -> None:
        self.controls, self.prompt_length, self.stop_tokens = controls, prompt_length, stop_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        history = input_ids[0].tolist()
        prompt, output = history[: self.prompt_length], history[self.prompt_length:]
        return reference_controls(scores[0].float(), self.controls, prompt, output, self.stop_tokens).view(1, -1)


def _generate_with_reference(model, prompt: list[int], controls: dict, max_new_tokens: int, eos: int | None
                             ) -> list[int]:
    stop = set(controls.get("stop_token_ids", ())) | ({eos} if eos is not None and not controls.get("ignore_eos")
                                                      else set())
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                              eos_token_id=sorted(stop) or None)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             logits_processor=LogitsProcessorList([ReferenceControls(controls, len(prompt), stop)]))
    return out[0, len(prompt):].tolist()


def test_every_control_through_the_manager_equals_generate_with_the_reference() -> None:
    model = tiny_model("qwen2")
    prompts = random_prompts([5, 9, 14, 3, 20, 7, 11], seed=11)
    plain = [_generate_with_reference(model, prompt, {}, 12, None) for prompt in prompts]
    eos = plain[0][3]  # a token the plain run generates, so EOS, min_tokens and ignore_eos have something to do
    cases = [
        {"repetition_penalty": 1.6},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"logit_bias": {plain[2][1]: -50.0, 17: 4.0}},
        {"bad_words_ids": [[plain[3][0]], [plain[3][1], plain[3][2]]]},
        {"min_tokens": 6},
        {"stop_token_ids": [plain[5][4]]},
        {"ignore_eos": True, "presence_penalty": -0.5},
    ]
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(12, eos_token_id=eos),
                                               cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=128))
    manager.start()
    try:
        plain_id = manager.add_request(prompts[0])  # shares steps with the controlled rows, unchanged by them
        ids = [manager.add_request(prompt, **controls) for prompt, controls in zip(prompts, cases)]
        outputs = collect_outputs(manager, [plain_id, *ids])
    finally:
        manager.stop(block=True)
    assert_engine_clean(manager)
    assert outputs[plain_id].generated_tokens == _generate_with_reference(model, prompts[0], {}, 12, eos)
    changed = 0
    for prompt, controls, rid in zip(prompts, cases, ids):
        want = _generate_with_reference(model, prompt, check_controls(controls, "test"), 12, eos)
        assert outputs[rid].generated_tokens == want, controls
        changed += want != _generate_with_reference(model, prompt, {}, 12, eos)
    assert changed >= len(cases) - 1  # the controls did something


def test_stop_tokens_min_tokens_and_ignore_eos_decide_the_end() -> None:
    model = tiny_model("qwen2")
    prompt = random_prompts([6], seed=4)[0]
    plain = _generate_with_reference(model, prompt, {}, 10, None)
    eos = plain[2]
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(10, eos_token_id=eos),
                                               cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=64))
    manager.start()
    try:
        ids = {
            "eos": manager.add_request(prompt),
            "ignore": manager.add_request(prompt, ignore_eos=True),
            "stop": manager.add_request(prompt, stop_token_ids=[plain[1]], ignore_eos=True),
            "min": manager.add_request(prompt, min_tokens=5),
        }
        outputs = collect_outputs(manager, list(ids.values()))
    finally:
        manager.stop(block=True)
    tokens = {name: outputs[rid].generated_tokens for name, rid in ids.items()}
    assert tokens["eos"] == plain[: plain.index(eos) + 1]
    assert tokens["ignore"] == plain  # runs to max_new_tokens through EOS
    assert tokens["stop"] == plain[:2]  # the stop token is kept, as EOS is
    assert len(tokens["min"]) >= 5 and eos not in tokens["min"][:5]
    assert tokens["min"] == _generate_with_reference(model, prompt, {"min_tokens": 5}, 10, eos)


def test_min_p_and_processed_logprobs_with_the_kept_mass() -> None:
    """Sampling with top_k and min_p, `logprobs_mode="processed"`: the chosen token's logprob and the top list are
    those of the distribution drawn from, and `logprob_mass` is the log of what top-k and min_p kept of the
    tempered distribution, checked against a full forward of each step's history."""
    model = tiny_model("qwen2")
    prompt = random_prompts([8], seed=9)[0]
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.8, pad_token_id=0, eos_token_id=None)
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(
        page_size=4, num_blocks=64, per_request_processors=True))
    manager.start()
    try:
        rid = manager.add_request(prompt, top_k=8, min_p=0.1, seed=3, top_logprobs=3, logprobs_mode="processed")
        raw_id = manager.add_request(prompt, top_k=8, seed=3, top_logprobs=3)
        outputs = collect_outputs(manager, [rid, raw_id])
    finally:
        manager.stop(block=True)
    output = outputs[rid]
    assert len(output.logprob_mass) == len(output.generated_tokens) == 6 and not outputs[raw_id].logprob_mass
    history = list(prompt)
    for step, token in enumerate(output.generated_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([history])).logits[0, -1].float()
        tempered = logits / 0.8
        kept = torch.full_like(tempered, -math.inf)
        top = tempered.topk(8)
        kept[top.indices] = top.values
        kept = reference_min_p(kept, 0.1)
        processed = torch.log_softmax(kept, dim=-1)
        ids, values = output.top_logprobs[step]
        assert ids == processed.topk(3).indices.tolist()
        torch.testing.assert_close(torch.tensor(values), processed[ids], rtol=1e-4, atol=1e-4)
        mass = torch.logsumexp(torch.log_softmax(tempered, dim=-1)[torch.isfinite(kept)], dim=0).item()
        assert output.logprob_mass[step] == pytest.approx(mass, abs=1e-4)
        assert math.isfinite(processed[token].item())
        history.append(token)
