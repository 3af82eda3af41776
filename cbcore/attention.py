"""The attention function cbcore registers with transformers' `AttentionInterface`.

Every attention layer of an unmodified transformers model calls `paged_attention(module, query, key, value, ...)`
with the packed batch (RoPE already applied). It writes the new K/V into the layer's pages, then attends over the
pages: the decode rows (one query token per request, packed first) through `ops.decode_attention`, the prefill rows
through `ops.prefill_attention`. All batch metadata comes from the `StepMetadata` the runner built once for the step
and passed through the forward's kwargs (transformers hands unknown kwargs down to the attention function unchanged).

The mask function registered under the same name returns None during cbcore's steps, so transformers never builds
an attention mask for them.

Outside cbcore's steps (a user's own forward, `model.generate`, a training step while a manager is attached) both
functions behave exactly like transformers' "sdpa": the model stays usable while cbcore holds it. The runner marks
its forward with `paged_step()`, a thread-local flag, because transformers calls the mask function without the
forward's kwargs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import ops

ATTENTION_NAME = "cbcore_paged"
STEP_KWARG = "cbcore_step"

_in_paged_step = threading.local()


@contextmanager
def paged_step() -> Iterator[None]:
    """Mark the current thread's forward as a cbcore step (no mask is built; attention goes to the pages)."""
    _in_paged_step.active = True
    try:
        yield
    finally:
        _in_paged_step.active = False


def in_paged_step() -> bool:
    """Whether the current thread is inside a cbcore step's forward."""
    return getattr(_in_paged_step, "active", False)


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
    step: StepMetadata | None = kwargs.pop(STEP_KWARG, None)
    if step is None:  # not one of cbcore's steps: behave exactly like transformers' sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
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


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask in cbcore's steps (the kernels mask: causal, bottom-right aligned, sliding window); sdpa's otherwise."""
    if getattr(_in_paged_step, "active", False):
        return None
    return sdpa_mask(*args, **kwargs)


_registered = False


def register() -> str:
    """Register cbcore's attention and (no-op) mask function with transformers; idempotent. Returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, paged_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, _mask)
        _registered = True
    return ATTENTION_NAME
