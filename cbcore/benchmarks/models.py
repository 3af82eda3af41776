"""The side-by-side benchmark's models, saved as ordinary transformers folders so that every peer (vLLM, in its own
venv, included) loads the same weights.

    random-llama-32m  W1-W3: a seeded random Llama of 32M parameters (vocab 8192, hidden 512, 8 layers, 8 heads,
                      4 KV heads, intermediate 1408), no EOS; saved once (fp32 safetensors) into the cache folder
                      (`--cache-dir`, default `locations.default_cache_dir()`)
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


def ensure_random_llama(cache_dir: Path | None = None) -> Path:
    """Save the seeded random Llama once (fp32 safetensors) under `cache_dir` and return its folder.

    Written into a temporary folder and renamed into place, so a concurrent first run never reads half a model."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder = Path(cache_dir or default_cache_dir()) / f"{RANDOM_LLAMA_NAME}-seed{RANDOM_LLAMA_SEED}"
    if (folder / "model.safetensors").exists():
        return folder
    torch.manual_seed(RANDOM_LLAMA_SEED)
    model = LlamaForCausalLM(LlamaConfig(**RANDOM_LLAMA)).eval()
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
    """The saved folder of a workload's model (`RANDOM_LLAMA_NAME` or "default")."""
    if name == RANDOM_LLAMA_NAME:
        return ensure_random_llama(cache_dir)
    from cbcore.default_model import ensure_default_model

    return ensure_default_model()
