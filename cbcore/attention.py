"""The attention function cbcore registers with transformers' `AttentionInterface`.

Every attention layer of an unmodified transformers model calls `paged_attention(module, query, key, value, ...)`
with the packed batch (RoPE already applied). It writes the new K/V into the layer's pages, then attends over the
pages: the decode rows (one query token per request, packed first) through `ops.decode_attention`, the prefill rows
through `ops.prefill_attention`. All batch metadata comes from the `StepMetadata` the runner built once for the step
and passed through the forward's kwargs (transformers hands unknown kwargs down to the attention function unchanged).

The mask function registered under the same name returns None, so transformers never builds an attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from . import ops

ATTENTION_NAME = "cbcore_paged"
STEP_KWARG = "cbcore_step"


@dataclass
class StepMetadata:
    """Flat tensors describing one step's packed batch; built once by the runner, read by every layer.

    Rows `[0, num_decode_tokens)` of the packed batch are decode rows (one query token per request); the rest are
    prefill rows (one or more query tokens per request, packed by `prefill_cu_seqlens_q`).
    """

    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_table: torch.Tensor
    decode_seq_lens: torch.Tensor
    num_prefill_requests: int
    prefill_block_table: torch.Tensor
    prefill_cu_seqlens_q: torch.Tensor
    prefill_seq_lens_k: torch.Tensor


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: query `[1, heads, T, d]`, key/value `[1, kv_heads, T, d]` -> `[1, T, heads, d]`."""
    step: StepMetadata | None = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(
            f"the model's attention is set to {ATTENTION_NAME!r} but the forward was called without cbcore's step "
            "metadata; this implementation only serves cbcore's runner (restore the model's attention first)"
        )
    if attention_mask is not None:
        raise RuntimeError("cbcore's paged attention expects no attention mask; its mask function must return None")
    layer = module.layer_idx
    k_cache, v_cache = step.key_caches[layer], step.value_caches[layer]
    q = query[0].transpose(0, 1)  # [T, heads, d]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    head_dim = q.shape[-1]
    scale = scaling if scaling is not None else head_dim**-0.5
    window = kwargs.get("sliding_window")

    ops.cache_write(k, v, k_cache, v_cache, step.slot_mapping)

    out = torch.empty_like(q)
    num_decode = step.num_decode_tokens
    if num_decode:
        out[:num_decode] = ops.decode_attention(
            q[:num_decode], k_cache, v_cache, step.decode_block_table, step.decode_seq_lens, scale, window
        )
    if step.num_prefill_requests:
        out[num_decode:] = ops.prefill_attention(
            q[num_decode:],
            k_cache,
            v_cache,
            step.prefill_block_table,
            step.prefill_cu_seqlens_q,
            step.prefill_seq_lens_k,
            scale,
            window,
        )
    return out.unsqueeze(0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """cbcore's attention masks inside the kernels (causal, bottom-right aligned, sliding window)."""
    return None


_registered = False


def register() -> str:
    """Register cbcore's attention and (no-op) mask function with transformers; idempotent. Returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, paged_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
        _registered = True
    return ATTENTION_NAME
