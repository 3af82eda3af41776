"""Attention features transformers models pass in their attention kwargs, end to end (docs/design.md, "Kernels and their
dispatch": honoured by every backend or refused, never ignored).

- Logit soft-capping (`softcap`): a tiny Gemma-2 with `attn_logit_softcapping` small enough to bend its scores.
- Attention sinks (`s_aux`): a tiny GPT-OSS (MoE, 4 experts) whose sink logits are scaled up so they take a real share
  of every softmax.
- A V head dim other than K's: a tiny DeepSeek-V3 (multi-head latent attention: K 24 = 16 + 8 rotary, V 16).
Gemma-2 and GPT-OSS alternate sliding-window and full layers, so the window combines with each feature. Greedy tokens through cbcore
(fp32, chunked prefill, page-crossing prompts) equal `model.generate` run on each prompt alone with the model's own
attention (eager: neither model supports sdpa in transformers). Each model is first shown to depend on its feature:
without it, `model.generate` gives other tokens.

Outside a step, a model switched to cbcore's attention still computes what its own eager attention computes; and in a
step, an attention kwarg cbcore does not implement raises an error naming it.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Gemma2Config, Gemma2ForCausalLM, GptOssConfig,
                          GptOssForCausalLM, LlamaConfig, LlamaForCausalLM)

import cbcore
from cbcore import attention
from conftest import VOCAB, greedy_config, random_prompts, reference_tokens, run_engine

MAX_NEW_TOKENS = 10
PROMPT_LENGTHS = [1, 2, 7, 16, 33]  # a single token to several pages of page size 4, longer than the window (6)


@functools.cache
def gemma2() -> torch.nn.Module:
    """Gemma-2 with soft-capping at 1.0: its attention logits (a few tenths to a few units) are visibly bent."""
    torch.manual_seed(1234)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                          sliding_window=6, attn_logit_softcapping=1.0, final_logit_softcapping=None,
                          max_position_embeddings=1024, attn_implementation="eager")
    model = Gemma2ForCausalLM(config).eval()
    # Gemma's default init gives near-uniform attention at this size; larger q/k weights make the scores (and so the
    # cap) matter.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.generation_config.pad_token_id = 0
    return model


@functools.cache
def gpt_oss() -> torch.nn.Module:
    """GPT-OSS (MoE: 4 experts, 2 per token) with sink logits drawn with standard deviation 3."""
    torch.manual_seed(1234)
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=6,
                          # YaRN's implicit factor (max / original positions) equal to its explicit one (32).
                          max_position_embeddings=32 * 4096, attn_implementation="eager")
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 3.0)
    model.generation_config.pad_token_id = 0
    return model


MODELS = {"gemma2_softcap": gemma2, "gpt_oss_sinks": gpt_oss}


@contextlib.contextmanager
def feature_removed(kind: str):
    """The model without its feature: soft-capping off, or sinks so low that e^sink adds nothing."""
    model = MODELS[kind]()
    layers = [layer.self_attn for layer in model.model.layers]
    if kind == "gemma2_softcap":
        saved = [layer.attn_logit_softcapping for layer in layers]
        for layer in layers:
            layer.attn_logit_softcapping = None
        try:
            yield model
        finally:
            for layer, value in zip(layers, saved):
                layer.attn_logit_softcapping = value
    else:
        saved = [layer.sinks.detach().clone() for layer in layers]
        with torch.no_grad():
            for layer in layers:
                layer.sinks.fill_(-1e4)
        try:
            yield model
        finally:
            with torch.no_grad():
                for layer, value in zip(layers, saved):
                    layer.sinks.copy_(value)


def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, seed=7)


@functools.cache
def expected(kind: str) -> tuple[tuple[int, ...], ...]:
    model = MODELS[kind]()
    config = greedy_config(MAX_NEW_TOKENS)
    return tuple(tuple(reference_tokens(model, prompt, config)) for prompt in prompts())


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_feature_changes_the_models_tokens(kind) -> None:
    """Otherwise the parity tests below would pass with the feature ignored."""
    config = greedy_config(MAX_NEW_TOKENS)
    with feature_removed(kind) as model:
        without = tuple(tuple(reference_tokens(model, prompt, config)) for prompt in prompts())
    assert without != expected(kind)


ENGINE_SETTINGS = {
    "page4_chunked": dict(page_size=4, max_batch_tokens=16),
    "page16_chunked_prefill_first": dict(page_size=16, max_batch_tokens=24, scheduler_type="prefill_first"),
    "page256_defaults": dict(page_size=256),
    # The compiled step: on the CPU each layer's attention is the C++ kernel of cbcore::step_attention (with the
    # reference kernels, its Python body), soft-cap, sinks and the window included.
    "page4_chunked_compiled": dict(page_size=4, max_batch_tokens=16, default_compile_level=1),
}


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_greedy_output_equals_generate(monkeypatch, kind, kernels, setting) -> None:
    monkeypatch.setenv("CBCORE_KERNELS", kernels)
    model = MODELS[kind]()
    config = cbcore.ContinuousBatchingConfig(**ENGINE_SETTINGS[setting])
    outputs, _ = run_engine(model, prompts(), greedy_config(MAX_NEW_TOKENS), config)
    for output, want in zip(outputs.values(), expected(kind)):
        assert output.status == cbcore.RequestStatus.FINISHED, output.error
        assert output.generated_tokens == list(want), f"{output.request_id} ({len(output.prompt_ids)}-token prompt)"
    assert model.config._attn_implementation == "eager", "stop() must give the model its own attention back"


@pytest.mark.parametrize("kind", list(MODELS))
def test_generate_batch_equals_generate(kind) -> None:
    model = MODELS[kind]()
    cbcore.enable(model)
    outputs = model.generate_batch(prompts(), generation_config=greedy_config(MAX_NEW_TOKENS),
                                   continuous_batching_config=cbcore.ContinuousBatchingConfig(page_size=8))
    assert [output.generated_tokens for output in outputs.values()] == [list(want) for want in expected(kind)]


@functools.cache
def deepseek_v3() -> torch.nn.Module:
    """DeepSeek-V3 (MoE, latent attention): per head, K = 16 + 8 rotary dims, V = 16."""
    torch.manual_seed(1234)
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                              q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                              v_head_dim=16, max_position_embeddings=1024)
    model = DeepseekV3ForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_latent_attention_with_its_own_v_head_dim_equals_generate(monkeypatch, kernels) -> None:
    """model.generate runs the model's own attention (sdpa); cbcore's cache holds 24-dim K and 16-dim V pages. The
    host pool holds one block shape for K and V, so swap is off (cpu_offload_space=0; see PagedKVCache.enable_swap)."""
    monkeypatch.setenv("CBCORE_KERNELS", kernels)
    model = deepseek_v3()
    config = greedy_config(MAX_NEW_TOKENS)
    want = [reference_tokens(model, prompt, config) for prompt in prompts()]
    outputs, manager = run_engine(model, prompts(), config, cbcore.ContinuousBatchingConfig(
        page_size=4, max_batch_tokens=16, cpu_offload_space=0))
    assert tuple(manager.cache.key_caches[0].shape[2:]) == (4, 24)
    assert tuple(manager.cache.value_caches[0].shape[2:]) == (4, 16)
    for output, tokens in zip(outputs.values(), want):
        assert output.status == cbcore.RequestStatus.FINISHED, output.error
        assert output.generated_tokens == tokens, f"{output.request_id} ({len(output.prompt_ids)}-token prompt)"


@pytest.mark.parametrize("kind", list(MODELS))
def test_outside_a_step_cbcores_attention_computes_the_models_eager_attention(kind) -> None:
    """A padded batch (a boolean mask from sdpa_mask, turned into eager's additive mask) and one prompt alone (no
    mask: causal)."""
    model = MODELS[kind]()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 21, 22, 23, 24, 25, 26]])
    mask = torch.tensor([[1] * 9, [0, 0, 0] + [1] * 6])
    with torch.no_grad():
        eager_batch = model(input_ids=input_ids, attention_mask=mask).logits
        eager_alone = model(input_ids=input_ids[:1]).logits
        model.set_attn_implementation(attention.register())
        try:
            cbcore_batch = model(input_ids=input_ids, attention_mask=mask).logits
            cbcore_alone = model(input_ids=input_ids[:1]).logits
        finally:
            model.set_attn_implementation("eager")
    torch.testing.assert_close(cbcore_batch[0], eager_batch[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cbcore_batch[1, 3:], eager_batch[1, 3:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cbcore_alone, eager_alone, atol=1e-6, rtol=1e-6)


# ---- attention kwargs a step cannot honour -------------------------------------------------------------------------


def test_every_routinely_passed_kwarg_is_handled_or_known_harmless() -> None:
    for name in ("position_ids", "use_cache", "output_router_logits", "sliding_window", "softcap", "s_aux",
                 "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal", "output_attentions"):
        attention.check_step_kwargs({name: None})


@pytest.mark.parametrize(("kwargs", "dropout", "message"), [
    (dict(position_bias=torch.zeros(1)), 0.0, "'position_bias'"),
    (dict(indices=torch.zeros(1), sinks=torch.zeros(1)), 0.0, "'indices', 'sinks'"),
    (dict(is_causal=False), 0.0, "is_causal=False"),
    (dict(output_attentions=True), 0.0, "output_attentions=True"),
    ({}, 0.1, "dropout=0.1"),
])
def test_a_kwarg_or_value_a_step_cannot_honour_raises_naming_it(kwargs, dropout, message) -> None:
    with pytest.raises(ValueError, match=message):
        attention.check_step_kwargs(kwargs, dropout)


def test_an_unknown_kwarg_reaching_attention_in_a_step_raises_naming_it() -> None:
    """Through a real model's forward: transformers hands the forward's extra kwargs to every attention call."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    model.set_attn_implementation(attention.register())
    with torch.no_grad(), attention.paged_step(), pytest.raises(ValueError, match="'block_indices'"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False, block_indices=torch.zeros(3),
              **{attention.STEP_KWARG: object()})


def test_outside_steps_an_eager_model_runs_its_own_eager_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a manager holds a model loaded with attn_implementation="eager", the model's own forward (outside
    cbcore's steps) runs the model's eager attention, not sdpa, and gives exactly the logits it gave before."""
    import transformers.models.llama.modeling_llama as modeling_llama

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="eager")).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = model(ids).logits
    calls = []
    eager = modeling_llama.eager_attention_forward
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", lambda *a, **k: calls.append(1) or eager(*a, **k))
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(2),
                                               cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=16))
    manager.start()
    try:
        calls.clear()
        with torch.no_grad():
            during = model(ids).logits
    finally:
        manager.stop()
    assert len(calls) == 2  # one per layer
    assert torch.equal(during, before)
    assert model.config._attn_implementation == "eager"
