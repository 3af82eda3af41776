"""Sampling: seeded runs reproduce, logits processors built from the GenerationConfig apply with each request's
own history, and log-probabilities come with the tokens when asked."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig

import cbcore
from conftest import random_prompts, reference_tokens, run_engine, tiny_model


def sampled_config(**kwargs) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=8, do_sample=True, eos_token_id=None, pad_token_id=0, **kwargs)


def test_sampling_with_the_same_seed_is_reproducible() -> None:
    model = tiny_model("llama_gqa")
    prompts = random_prompts([3, 9, 14], seed=30)
    config = sampled_config(temperature=1.3, top_k=20)
    runs = [
        run_engine(model, prompts, config, cbcore.ContinuousBatchingConfig(page_size=4, seed=123))[0]
        for _ in range(2)
    ]
    assert [o.generated_tokens for o in runs[0].values()] == [o.generated_tokens for o in runs[1].values()]
    greedy = run_engine(model, prompts, GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None),
                        cbcore.ContinuousBatchingConfig(page_size=4))[0]
    assert [o.generated_tokens for o in runs[0].values()] != [o.generated_tokens for o in greedy.values()]


def test_top_k_one_sampling_equals_greedy() -> None:
    model = tiny_model("qwen2")
    prompts = random_prompts([5, 12], seed=31)
    outputs, _ = run_engine(model, prompts, sampled_config(top_k=1), cbcore.ContinuousBatchingConfig(page_size=4))
    greedy = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == reference_tokens(model, prompt, greedy)


def test_history_aware_processor_sees_each_requests_own_history() -> None:
    model = tiny_model("llama_gqa")
    prompts = random_prompts([6, 15, 2], seed=32)
    config = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                              repetition_penalty=1.8, no_repeat_ngram_size=2)
    outputs, _ = run_engine(model, prompts, config, cbcore.ContinuousBatchingConfig(page_size=4))
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == reference_tokens(model, prompt, config)


def test_logprobs_are_returned_when_asked() -> None:
    model = tiny_model("llama_gqa")
    prompts = random_prompts([7], seed=33)
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    outputs, _ = run_engine(model, prompts, config, cbcore.ContinuousBatchingConfig(page_size=4, return_logprobs=True))
    output = outputs["req_0"]
    assert len(output.logprobs) == len(output.generated_tokens) == 5
    assert all(lp <= 0 and math.isfinite(lp) for lp in output.logprobs)


def test_prompt_length_dependent_processor_counts_from_each_requests_own_prompt() -> None:
    """min_new_tokens suppresses EOS for the first n *generated* tokens of each request, whatever its prompt length."""
    model = tiny_model("qwen2")
    prompts = random_prompts([3, 17], seed=34)
    free = [reference_tokens(model, p, GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None,
                                                       pad_token_id=0)) for p in prompts]
    eos = free[0][1]  # greedy emits it second for the first prompt: min_new_tokens must push it back
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0, min_new_tokens=4)
    outputs, _ = run_engine(model, prompts, config, cbcore.ContinuousBatchingConfig(page_size=4))
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == reference_tokens(model, prompt, config)
    assert len(outputs["req_0"].generated_tokens) >= 4


def test_a_request_with_its_own_seed_draws_the_same_tokens_whatever_shares_its_steps() -> None:
    """`seed` (per request, with per_request_processors): the request samples from a generator of its own, so alone
    or in a crowd of other sampled requests it draws the same tokens; another seed draws others."""
    import cbcore
    from conftest import collect_outputs

    model = tiny_model("llama_gqa")
    config = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.5, eos_token_id=None, pad_token_id=0)
    prompt = random_prompts([7], seed=31)[0]

    def serve(requests: list[dict]) -> list[list[int]]:
        manager = cbcore.ContinuousBatchingManager(
            model, config, cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=128, per_request_processors=True))
        manager.start()
        try:
            ids = [manager.add_request(**request) for request in requests]
            outputs = collect_outputs(manager, ids)
        finally:
            manager.stop()
        return [outputs[rid].generated_tokens for rid in ids]

    (alone,) = serve([{"input_ids": prompt, "seed": 7}])
    crowd = serve([{"input_ids": p} for p in random_prompts([5, 9, 3], seed=32)]
                  + [{"input_ids": prompt, "seed": 7}, {"input_ids": prompt, "seed": 8}])
    assert crowd[3] == alone
    assert crowd[4] != alone


def test_a_seeded_request_with_several_return_sequences_draws_different_samples_reproducibly() -> None:
    """`num_return_sequences=3` and a `seed`: the three sequences differ (child i draws from `seed + 1 + i`, as vLLM
    seeds a request's samples), and the same seed gives the same three again."""
    from conftest import collect_outputs

    model = tiny_model("llama_gqa")
    config = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=1.5, num_return_sequences=3,
                              eos_token_id=None, pad_token_id=0)
    prompt = random_prompts([6], seed=33)[0]

    def serve() -> list[list[int]]:
        manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(page_size=4))
        manager.start()
        try:
            request_id = manager.add_request(prompt, seed=11)
            ids = [request_id, f"{request_id}__child#0", f"{request_id}__child#1"]
            outputs = collect_outputs(manager, ids)
        finally:
            manager.stop()
        return [outputs[rid].generated_tokens for rid in ids]

    first = serve()
    assert len({tuple(tokens) for tokens in first}) == 3
    assert serve() == first


def test_top_logprobs_are_the_models_own_before_temperature_and_top_k() -> None:
    """A request with `top_logprobs=n` gets, per generated token, the model's n most likely tokens with the
    log-softmax of the raw logits (and that chosen-token logprob), whatever its temperature and top-k; a request
    without it keeps the logprobs of the distribution it was drawn from. Out-of-range values raise in add_request."""
    import pytest
    import torch

    from conftest import collect_outputs

    model = tiny_model("llama_gqa")
    config = GenerationConfig(max_new_tokens=4, do_sample=True, temperature=0.3, top_k=5, eos_token_id=None,
                              pad_token_id=0)
    prompt = random_prompts([6], seed=34)[0]
    manager = cbcore.ContinuousBatchingManager(model, config, cbcore.ContinuousBatchingConfig(
        page_size=4, num_blocks=64, per_request_processors=True, return_logprobs=True))
    manager.start()
    try:
        with pytest.raises(ValueError, match="top_logprobs must be in"):
            manager.add_request(prompt, top_logprobs=21)
        ids = [manager.add_request(prompt, top_logprobs=3, seed=1), manager.add_request(prompt, seed=1)]
        outputs = collect_outputs(manager, ids)
    finally:
        manager.stop(block=True, timeout=60)
    asked, plain = outputs[ids[0]], outputs[ids[1]]
    assert asked.generated_tokens == plain.generated_tokens  # the same draws: reporting changes no token
    assert len(asked.top_logprobs) == 4 and plain.top_logprobs == []
    with torch.no_grad():
        rows = model(torch.tensor([prompt + asked.generated_tokens])).logits[0].float().log_softmax(-1)
    for i, (token, (top_ids, top_values)) in enumerate(zip(asked.generated_tokens, asked.top_logprobs)):
        row = rows[len(prompt) - 1 + i]
        values, best = row.topk(3)
        assert top_ids == best.tolist() and top_values == pytest.approx(values.tolist(), abs=1e-4)
        assert asked.logprobs[i] == pytest.approx(row[token].item(), abs=1e-4)
    # Drawn at temperature 0.3 among the top 5: the drawn distribution is sharper than the model's.
    assert any(p > a + 1e-3 for p, a in zip(plain.logprobs, asked.logprobs))


def test_draw_samples_each_rows_distribution_and_never_a_zero_probability_token() -> None:
    """The sampler's inverse-CDF draw: frequencies match the probabilities (seeded, 40k draws per row: a fixed
    outcome, within 4 standard deviations), tokens of probability 0 (masked by top-k / top-p) never come out."""
    import torch

    from cbcore.sampling import draw

    probs = torch.tensor([[0.0, 0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [0.25, 0.25, 0.0, 0.25, 0.25]])
    generator = torch.Generator().manual_seed(0)
    n = 40_000
    counts = torch.zeros_like(probs)
    for _ in range(n // 1000):
        tokens = torch.stack([draw(probs, generator) for _ in range(1000)])  # [1000, rows]
        counts += torch.nn.functional.one_hot(tokens, probs.shape[1]).sum(0).float()
    frequencies = counts / n
    assert torch.all(counts[probs == 0] == 0)
    sigma = (probs * (1 - probs) / n).sqrt()
    assert torch.all((frequencies - probs).abs() <= 4 * sigma + 1e-9), frequencies


@pytest.mark.parametrize("isa", ["auto", "avx2", "avx512"])
@pytest.mark.parametrize("vocab", [1, 7, 16, 31, 32, 33, 100, 8192, 49152])
def test_greedy_tokens_are_torch_argmax_ties_nans_and_infinities_included(vocab: int, isa: str) -> None:
    """The sampler's greedy choice (cbcore._C.greedy_tokens where built) is torch.argmax's: the first maximum of each
    row, a NaN counting as the maximum (the first NaN), an all -inf row giving 0; with each instruction set's rows
    (vector and tail elements), for contiguous, strided and non-float32 scores."""
    import functools

    from cbcore import _C, sampling

    if isa == "auto":
        greedy_tokens = sampling.greedy_tokens
    else:
        try:
            _C.greedy_tokens(torch.zeros(1, 1), isa)
        except ValueError:
            pytest.skip(f"this CPU has no {isa}")
        greedy_tokens = functools.partial(_C.greedy_tokens, isa=isa)

    generator = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=generator) for _ in range(12)]
    rows[1][:] = 0.25  # every element tied: the first
    rows[2][vocab // 2 :] = rows[2].max() + 1  # ties on the new maximum: the first of them
    rows[3][:] = float("-inf")
    rows[4][vocab - 1] = float("nan")  # a NaN in the tail
    rows[5][vocab // 3] = float("nan")
    rows[5][vocab - 1] = float("nan")  # two NaNs: the first
    rows[6][vocab - 1] = float("inf")
    rows[7][0] = float("inf")
    rows[7][vocab - 1] = float("inf")
    rows[8] = rows[8].round(decimals=1)  # many ties below the maximum
    rows[9][vocab // 2] = -0.0
    rows[9][:] = rows[9].clamp(max=0.0)  # zeros of both signs tied on the maximum
    scores = torch.stack(rows)
    assert greedy_tokens(scores).tolist() == scores.argmax(dim=-1).tolist()
    strided = torch.stack(rows, dim=1).t()  # rows not contiguous: torch's argmax runs
    assert greedy_tokens(strided).tolist() == strided.argmax(dim=-1).tolist()
    padded = torch.cat([scores, torch.zeros(12, 5)], dim=1)[:, :vocab]  # rows with a stride past their length
    assert greedy_tokens(padded).tolist() == padded.argmax(dim=-1).tolist()
    half = scores.to(torch.bfloat16)  # bf16 rows: the vector rows widen them in registers (more ties once rounded)
    assert greedy_tokens(half).tolist() == half.argmax(dim=-1).tolist()
    half_padded = torch.cat([half, torch.zeros(12, 5, dtype=torch.bfloat16)], dim=1)[:, :vocab]
    assert greedy_tokens(half_padded).tolist() == half_padded.argmax(dim=-1).tolist()
    fp16 = scores.to(torch.float16)  # torch's argmax
    assert greedy_tokens(fp16).tolist() == fp16.argmax(dim=-1).tolist()
    many = torch.randn(300, vocab, generator=generator)  # enough rows for several threads
    assert greedy_tokens(many).tolist() == many.argmax(dim=-1).tolist()
    assert greedy_tokens(many.to(torch.bfloat16)).tolist() == many.to(torch.bfloat16).argmax(dim=-1).tolist()
