"""Same tokens: greedy output through cbcore equals `model.generate` run on each prompt alone, token for token (fp32),
for every model kind, page size, chunking budget, scheduler, prefix-sharing setting, and under preemption."""

from __future__ import annotations

import functools

import pytest

import cbcore
from conftest import MODEL_FACTORIES, greedy_config, random_prompts, reference_tokens, run_engine, tiny_model

MAX_NEW_TOKENS = 12
# From a single token to several pages of the small page sizes; two prompts share a 20-token prefix.
PROMPT_LENGTHS = [1, 2, 7, 16, 33, 70]


def workload() -> list[list[int]]:
    prompts = random_prompts(PROMPT_LENGTHS, seed=7)
    shared = random_prompts([20], seed=8)[0]
    return prompts + [shared + [5, 6, 7], shared + [9]]


@functools.cache
def expected(kind: str) -> tuple[tuple[int, ...], ...]:
    model = tiny_model(kind)
    config = greedy_config(MAX_NEW_TOKENS)
    return tuple(tuple(reference_tokens(model, prompt, config)) for prompt in workload())


# id -> (config kwargs, whether preemption must happen)
ENGINE_SETTINGS = {
    "page4_chunked_fifo": (dict(page_size=4, max_batch_tokens=16, scheduler_type="fifo"), False),
    "page16_chunked_prefill_first_no_sharing": (
        dict(page_size=16, max_batch_tokens=24, scheduler_type="prefill_first", allow_block_sharing=False), False),
    "page256_defaults": (dict(page_size=256), False),
    # 24 blocks of 4 tokens: the longest request needs 21 blocks, so requests must be preempted and recomputed.
    "page4_preemption_fifo": (dict(page_size=4, num_blocks=24, max_batch_tokens=32, scheduler_type="fifo"), True),
    "page16_preemption_prefill_first_no_sharing": (
        dict(page_size=16, num_blocks=7, max_batch_tokens=32, scheduler_type="prefill_first",
             allow_block_sharing=False), True),
}


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("kind", list(MODEL_FACTORIES))
def test_greedy_output_equals_generate(kind: str, setting: str) -> None:
    kwargs, must_preempt = ENGINE_SETTINGS[setting]
    model = tiny_model(kind)
    outputs, manager = run_engine(model, workload(), greedy_config(MAX_NEW_TOKENS), cbcore.ContinuousBatchingConfig(**kwargs))
    for output, want in zip(outputs.values(), expected(kind)):
        assert output.status == cbcore.RequestStatus.FINISHED, output.error
        assert output.generated_tokens == list(want), f"{output.request_id} ({len(output.prompt_ids)}-token prompt)"
    if must_preempt:
        assert manager.num_preemptions > 0, "the cache was meant to be too small to avoid preemption"


def test_generate_batch_returns_input_order_and_equals_generate() -> None:
    model = tiny_model("llama_gqa")
    cbcore.enable(model)
    prompts = workload()
    outputs = model.generate_batch(
        prompts, generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=cbcore.ContinuousBatchingConfig(page_size=16, max_batch_tokens=32),
    )
    assert list(outputs) == [f"req_{i}" for i in range(len(prompts))]
    for output, prompt, want in zip(outputs.values(), prompts, expected("llama_gqa")):
        assert output.prompt_ids == prompt
        assert output.generated_tokens == list(want)


def test_eos_ends_a_request_and_is_kept_in_its_output() -> None:
    model = tiny_model("qwen2")
    prompt = random_prompts([9], seed=3)[0]
    free_run = reference_tokens(model, prompt, greedy_config(MAX_NEW_TOKENS))
    eos = free_run[4]  # a token greedy decoding will produce: generation must stop at its first occurrence
    config = greedy_config(MAX_NEW_TOKENS, eos_token_id=eos)
    want = reference_tokens(model, prompt, config)
    outputs, _ = run_engine(model, [prompt], config, cbcore.ContinuousBatchingConfig(page_size=4))
    got = outputs["req_0"].generated_tokens
    assert got == want
    assert got[-1] == eos and len(got) <= 5
