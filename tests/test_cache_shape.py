"""`CacheShape.from_model_config`: the K/V page shapes read off a transformers config, exactly or not at all, and the
cache allocating V pages with V's own head dim (multi-head latent attention)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DeepseekV3Config, Gemma4TextConfig, LlamaConfig, MiniCPM3Config, Qwen3Config

from cbcore.cache import PagedKVCache
from cbcore.cache_shape import CacheShape


def test_a_plain_config_gives_kv_heads_and_hidden_over_heads() -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    assert CacheShape.from_model_config(config, torch.float32) == CacheShape(3, 2, 16, torch.float32)


def test_an_explicit_head_dim_wins_over_hidden_over_heads() -> None:
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_hidden_layers=2)
    assert CacheShape.from_model_config(config, torch.bfloat16).head_dim == 32


def test_multi_head_latent_attention_gets_per_head_k_and_v_of_their_own_dims() -> None:
    """DeepSeek-V3 expands its latent into one K/V head per query head before attention: K is nope + rope (24), V is
    v_head_dim (16); config.head_dim is only the rotary part (8) and must not be used."""
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                              kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
                              v_head_dim=16)
    assert config.head_dim == 8
    shape = CacheShape.from_model_config(config, torch.float32)
    assert shape == CacheShape(2, 4, 24, torch.float32, v_head_dim=16)
    assert shape.value_head_dim == 16
    assert shape.bytes_per_token == 2 * 4 * (24 + 16) * 4


def test_minicpm3_is_read_as_latent_attention_too() -> None:
    config = MiniCPM3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                            kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=24)
    assert CacheShape.from_model_config(config, torch.float32) == CacheShape(2, 4, 24, torch.float32)


def test_layers_with_different_head_dims_get_a_shape_each() -> None:
    config = Gemma4TextConfig(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16)
    shape = CacheShape.from_model_config(config, torch.float32)
    assert shape.per_layer is not None and len(set(shape.per_layer)) > 1 and not shape.uniform
    assert shape.bytes_per_token == sum(h * (k + v) for h, k, v in shape.per_layer) * 4


def test_the_shape_is_read_off_what_the_attention_layers_receive() -> None:
    """JetMoE's config says 2 KV heads; its attention receives num_key_value_heads x experts per token."""
    from transformers import JetMoeConfig, JetMoeForCausalLM

    torch.manual_seed(0)
    model = JetMoeForCausalLM(JetMoeConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2,
                                           kv_channels=16, num_local_experts=4, num_experts_per_tok=2,
                                           intermediate_size=64)).eval()
    probed = CacheShape.from_model(model, torch.float32)
    assert probed.layer_dims(0)[0] == 4 != CacheShape.from_model_config(model.config, torch.float32).num_kv_heads
    assert model.config._attn_implementation != "cbcore_paged"  # the probe put the model back


def test_a_v_head_dim_outside_latent_attention_is_refused() -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    config.v_head_dim = 8
    with pytest.raises(ValueError, match="v_head_dim 8 differs from head_dim 16 outside multi-head latent"):
        CacheShape.from_model_config(config, torch.float32)


def test_a_hidden_size_not_divisible_by_the_heads_without_head_dim_is_refused() -> None:
    # transformers' own configs validate this themselves; a remote-code config may not.
    config = SimpleNamespace(hidden_size=66, num_attention_heads=4, num_hidden_layers=2, head_dim=None)
    config.get_text_config = lambda: config
    with pytest.raises(ValueError, match="hidden_size 66 is not a multiple of num_attention_heads 4"):
        CacheShape.from_model_config(config, torch.float32)


def test_the_cache_allocates_v_pages_with_their_own_head_dim_and_refuses_swap() -> None:
    shape = CacheShape(2, 4, 24, torch.float32, v_head_dim=16)
    cache = PagedKVCache(shape, num_blocks=3, page_size=4, device=torch.device("cpu"))
    assert [tuple(t.shape) for t in cache.key_caches] == [(3, 4, 4, 24)] * 2
    assert [tuple(t.shape) for t in cache.value_caches] == [(3, 4, 4, 16)] * 2
    with pytest.raises(NotImplementedError, match="set cpu_offload_space=0"):
        cache.enable_swap(2)
