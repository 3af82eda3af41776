"""The side-by-side benchmark's models, saved as ordinary transformers folders so that every peer (vLLM, in its own
venv, included) loads the same weights.

    random-llama-32m  W1-W3: a seeded random Llama of 32M parameters (vocab 8192, hidden 512, 8 layers, 8 heads,
                      4 KV heads, intermediate 1408), no EOS; saved once (fp32 safetensors) into the cache folder
                      (`--cache-dir`, default `locations.default_cache_dir()`)
    random-qwen3.5-100m  W5: a seeded random Qwen3.5-shaped hybrid of about 100M parameters (vocab 8192, hidden 768,
                      12 layers: three gated delta-net layers to one full-attention layer, as Qwen3.5; 16 value and 8
                      key heads of 64 in the delta-net layers, 8 query and 2 KV heads of 64 in attention,
                      intermediate 2048), no EOS; saved as the Llama is
    default           W4: the default model's converted folder (`cbcore.default_model.ensure_default_model`, in
                      cbcore's own cache)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from cbcore.benchmarks.locations import default_cache_dir

RANDOM_LLAMA = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
RANDOM_LLAMA_SEED = 0
RANDOM_LLAMA_NAME = "random-llama-32m"

RANDOM_QWEN35 = dict(
    vocab_size=8192,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
RANDOM_QWEN35_NAME = "random-qwen3.5-100m"


def ensure_random_llama(cache_dir: Path | None = None) -> Path:
    """Save the seeded random Llama once (fp32 safetensors) under `cache_dir` and return its folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _ensure_random_model(RANDOM_LLAMA_NAME, LlamaForCausalLM, LlamaConfig(**RANDOM_LLAMA), cache_dir)


def ensure_random_qwen35(cache_dir: Path | None = None) -> Path:
    """Save the seeded random Qwen3.5-shaped hybrid once (fp32 safetensors) under `cache_dir` and return its folder."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return _ensure_random_model(RANDOM_QWEN35_NAME, Qwen3_5ForCausalLM, Qwen3_5TextConfig(**RANDOM_QWEN35),
                                cache_dir)


def _ensure_random_model(name: str, model_class, config, cache_dir: Path | None) -> Path:
    """Save a seeded random model once; written into a temporary folder and renamed into place, so a concurrent
    first run never reads half a model."""
    from transformers import GenerationConfig

    folder = Path(cache_dir or default_cache_dir()) / f"{name}-seed{RANDOM_LLAMA_SEED}"
    if (folder / "model.safetensors").exists():
        return folder
    torch.manual_seed(RANDOM_LLAMA_SEED)
    model = model_class(config).eval()
    # No EOS in the random model's configs: W1-W3 generate exactly max_new_tokens for every peer.
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model.config.bos_token_id = model.config.eos_token_id = None
    model.config.pad_token_id = 0
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another run saved it first
        if not (folder / "model.safetensors").exists():
            raise
    return folder


def model_folder(name: str, cache_dir: Path | None = None) -> Path:
    """The saved folder of a workload's model (`RANDOM_LLAMA_NAME`, `RANDOM_QWEN35_NAME` or "default")."""
    if name == RANDOM_LLAMA_NAME:
        return ensure_random_llama(cache_dir)
    if name == RANDOM_QWEN35_NAME:
        return ensure_random_qwen35(cache_dir)
    from cbcore.default_model import ensure_default_model

    return ensure_default_model()
