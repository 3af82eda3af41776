"""Model support (cbcore/model_support.py, cbcore/model_self_check.py) as the manager applies it: a model cbcore
cannot serve exactly is refused at `warmup()`/`start()` with an error naming it, the model is left exactly as it was,
and the start-up self-check leaves the engine's cache, allocator and counters untouched."""

from __future__ import annotations

import re

import pytest
import torch

import architecture_sweep as sweep
import cbcore
from cbcore import model_self_check, model_support
from cbcore.model_self_check import SELF_CHECK_ENV
from cbcore.model_support import UnsupportedModelError
from conftest import collect_outputs, greedy_config, random_prompts, reference_tokens, tiny_model


def _untouched(model: torch.nn.Module, attn_implementation: str) -> bool:
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = any("forward" in m.__dict__ for m in linears)
    return model.config._attn_implementation == attn_implementation and not packed


def _manager(model: torch.nn.Module) -> cbcore.ContinuousBatchingManager:
    return cbcore.ContinuousBatchingManager(model, greedy_config(4), cbcore.ContinuousBatchingConfig(page_size=4))


def test_state_kept_outside_the_cache_api_is_refused_at_start_before_anything_is_built() -> None:
    model = sweep.build_model("minimax")  # lightning attention keeps its state in its own cache layer
    before = model.config._attn_implementation
    manager = _manager(model)
    with pytest.raises(UnsupportedModelError, match="MiniMaxForCausalLM.*per-request state.*outside transformers' "
                                                   "cache API"):
        manager.start()
    assert manager.cache is None and not manager.is_running()
    assert _untouched(model, before)


def test_warmup_refuses_a_recurrent_model_without_the_cache_api() -> None:
    manager = _manager(sweep.build_model("rwkv"))
    with pytest.raises(NotImplementedError, match="RwkvForCausalLM"):
        manager.warmup()
    assert manager.cache is None


def test_a_hybrid_model_is_served_and_unbound_after() -> None:
    model = sweep.build_model("qwen3_next")
    before = model.config._attn_implementation
    manager = _manager(model)
    manager.start()
    manager.stop(block=True, timeout=60)
    assert _untouched(model, before)
    assert not any("forward" in module.__dict__ for module in model.modules()), "a stateful layer is still bound"


def test_a_self_check_refusal_leaves_the_model_as_it_was() -> None:
    model = sweep.build_model("gpt_neo")  # attention outside AttentionInterface: only the self-check can tell
    before = model.config._attn_implementation
    model_support.check_model_supported(model)  # structure alone does not refuse it
    with pytest.raises(UnsupportedModelError, match="GPTNeoForCausalLM.*self-check.*never called cbcore's attention"):
        _manager(model).start()
    assert _untouched(model, before)


def test_the_self_check_counts_attention_calls_per_layer() -> None:
    model = sweep.build_model("diffllama")  # one attention module called twice per forward
    with pytest.raises(UnsupportedModelError, match="DiffLlamaForCausalLM.*2 times in one forward"):
        _manager(model).start()


def test_the_self_check_leaves_cache_allocator_and_counters_untouched() -> None:
    model = tiny_model("llama_gqa")
    manager = _manager(model)
    manager.start()
    try:
        assert manager.is_running()
        stats = manager.stats()
        assert all(stats[name] == 0 for name in ("steps", "computed_tokens", "generated_tokens", "prefix_lookups"))
        assert stats["blocks_free"] == stats["num_blocks"]
        prompts = random_prompts([3, 13], seed=2)
        outputs = collect_outputs(manager, manager.add_requests(prompts))
    finally:
        manager.stop(block=True, timeout=60)
    manager.check_invariants()
    got = [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    assert got == [reference_tokens(model, p, greedy_config(4)) for p in prompts]


def test_the_self_check_can_be_skipped_and_a_bad_value_raises(monkeypatch) -> None:
    model = sweep.build_model("gpt_neo")  # refused by the self-check alone
    monkeypatch.setenv(SELF_CHECK_ENV, "0")
    manager = _manager(model)
    manager.start()  # not checked: the caller took responsibility
    manager.stop(block=True, timeout=60)
    monkeypatch.setenv(SELF_CHECK_ENV, "maybe")
    with pytest.raises(ValueError, match=SELF_CHECK_ENV):
        model_self_check.self_check_enabled()


def test_a_decoder_computing_its_own_positions_gets_the_steps_positions_only_inside_steps() -> None:
    """BART's decoder takes no position_ids: its positional embedding gets each step's positions (packed requests,
    chunked prefill) through a hook that does nothing outside cbcore's steps and is removed when the model is handed
    back."""
    model = sweep.build_model("bart")
    embedding = model.model.decoder.embed_positions
    prompts = random_prompts([2, 9, 17], seed=5)
    config = greedy_config(6)
    want = [reference_tokens(model, p, config) for p in prompts]
    manager = cbcore.ContinuousBatchingManager(
        model, config, cbcore.ContinuousBatchingConfig(page_size=4, max_batch_tokens=8))
    manager.start()
    try:
        assert len(embedding._forward_pre_hooks) == 1
        # The model's own generate while cbcore holds it: the hook leaves its positions alone.
        assert [reference_tokens(model, p, config) for p in prompts] == want
        outputs = collect_outputs(manager, manager.add_requests(prompts))
    finally:
        manager.stop(block=True, timeout=60)
    manager.check_invariants()
    assert [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))] == want
    assert not embedding._forward_pre_hooks


def test_a_decoder_without_logits_to_keep_is_served_from_every_rows_logits() -> None:
    model = sweep.build_model("whisper")
    prompts = random_prompts([1, 12], seed=6)
    config = greedy_config(5)
    manager = cbcore.ContinuousBatchingManager(
        model, config, cbcore.ContinuousBatchingConfig(page_size=4, max_batch_tokens=8))
    manager.start()
    try:
        outputs = collect_outputs(manager, manager.add_requests(prompts))
    finally:
        manager.stop(block=True, timeout=60)
    assert [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))] == [
        reference_tokens(model, p, config) for p in prompts]


# ---- transformers' paged spellings: the self-check's reference is the implementation they stand for ---------------


@pytest.mark.parametrize("loaded, reference", [
    ("paged|eager", "eager"),
    ("paged|sdpa", "sdpa"),
    ("paged|flash_attention_2", "flash_attention_2"),
    ("eager", "eager"),
    ("sdpa", "sdpa"),
    (None, None),
])
def test_a_paged_spelling_is_checked_against_its_non_paged_implementation(loaded, reference) -> None:
    assert model_self_check.reference_attn_implementation(loaded) == reference


def test_a_name_registered_for_a_transformers_paged_function_maps_to_its_implementation() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.eager_paged import eager_paged_attention_forward

    AttentionInterface.register("cbcore_test_eager_paged", eager_paged_attention_forward)
    assert model_self_check.reference_attn_implementation("cbcore_test_eager_paged") == "eager"


@pytest.mark.parametrize("name", ["paged|", "paged", "sdpa_paged", "paged_attention"])
def test_a_paged_implementation_without_a_known_equivalent_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"{re.escape(repr(name))}.*no"):
        model_self_check.reference_attn_implementation(name)


def test_the_self_check_refuses_a_paged_implementation_without_an_equivalent_naming_the_model() -> None:
    model = sweep.build_model("llama")
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*'sdpa_paged'.*no non-paged"):
        model_self_check.self_check(model, "sdpa_paged", force=True)


@pytest.mark.parametrize("model_type, loaded", [
    ("llama", "paged|eager"),
    ("llama", "paged|sdpa"),
    ("gemma2", "paged|eager"),  # soft-capping and a sliding window: eager is the only attention transformers gives it
    ("gpt_oss", "paged|eager"),  # attention sinks, sliding layers: likewise
])
def test_a_model_loaded_with_a_paged_implementation_is_served_and_handed_back_as_loaded(model_type: str,
                                                                                      loaded: str) -> None:
    """transformers' own spelling for continuous batching (`paged|eager`; `paged|sdpa`, which transformers 5.24 reads as
    `sdpa`): served, with exactly the tokens `model.generate` gives with the implementation it stands for, also while
    the manager holds the model; stopping hands back exactly what the model was loaded with."""
    model = sweep.build_model(model_type)
    prompts, config = sweep.prompts(), sweep.greedy_config()
    true_implementation = loaded.removeprefix("paged|")
    model.set_attn_implementation(true_implementation)
    want = [reference_tokens(model, p, config) for p in prompts]
    model.set_attn_implementation(loaded)
    as_loaded = model.config._attn_implementation
    manager = cbcore.ContinuousBatchingManager(
        model, config,
        cbcore.ContinuousBatchingConfig(page_size=sweep.PAGE_SIZE, max_batch_tokens=sweep.MAX_BATCH_TOKENS))
    manager.start()
    try:
        outputs = collect_outputs(manager, manager.add_requests(prompts))
        # Outside cbcore's steps the layers compute the model's true function too.
        assert [reference_tokens(model, p, config) for p in prompts] == want
    finally:
        manager.stop(block=True, timeout=60)
    assert [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))] == want
    assert model.config._attn_implementation == as_loaded
