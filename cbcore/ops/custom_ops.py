"""cbcore's kernels as `torch.library` custom ops: `torch.ops.cbcore.cache_write`, `.decode_attention`,
`.prefill_attention`, for callers that compile their own code around the kernels (docs/design.md, "The compiled
step").

`torch.compile` cannot trace into a C++ kernel or a Triton launch made through Python glue; a custom op is an opaque
node of the graph instead, with a schema (so the compiler knows which inputs it writes: `cache_write` mutates the
two page tensors, the attention ops mutate nothing and return a fresh output) and a fake implementation (shapes and
dtypes only, no data: what the compiler traces with). Each op's real implementation is the dispatching face in
`cbcore.ops` (C++, CUDA, Triton or the reference, by the tensors' device and the kernel mode), so compiled and eager
steps run the same kernels. `tests/test_custom_ops.py` checks every op with `torch.library.opcheck` (schema, fake
tensors, mutation annotations, dynamic-shape tracing) and compiles a function of all three without a graph break.

Not used by the eager step yet: `paged_attention` calls `cbcore.ops` directly, with the step's kernel plans, which a
custom op's schema (tensors and numbers only) cannot carry.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import cache_write as _cache_write
from . import decode_attention as _decode_attention
from . import prefill_attention as _prefill_attention


@torch.library.custom_op("cbcore::cache_write", mutates_args=("k_cache", "v_cache"))
def cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor, kernel_mode: str = "auto") -> None:
    """`cbcore.ops.cache_write` as a custom op: writes k/v into the slots of the pages (it mutates them)."""
    _cache_write(k, v, k_cache, v_cache, slot_mapping, kernel_mode)


@cache_write.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, kernel_mode="auto") -> None:
    return None


@torch.library.custom_op("cbcore::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, sliding_window: Optional[int] = None,
                     softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                     kernel_mode: str = "auto") -> torch.Tensor:
    """`cbcore.ops.decode_attention` as a custom op: `[batch, heads, v_head_dim]`, a fresh tensor."""
    return _decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, sliding_window, softcap, sinks,
                             kernel_mode)


@decode_attention.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, scale, sliding_window=None, softcap=None, sinks=None,
      kernel_mode="auto"):
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])


@torch.library.custom_op("cbcore::prefill_attention", mutates_args=())
def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, scale: float,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      sinks: Optional[torch.Tensor] = None, kernel_mode: str = "auto") -> torch.Tensor:
    """`cbcore.ops.prefill_attention` as a custom op: `[num_tokens, heads, v_head_dim]`, a fresh tensor."""
    return _prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, sliding_window,
                              softcap, sinks, kernel_mode)


@prefill_attention.register_fake
def _(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, sliding_window=None, softcap=None,
      sinks=None, kernel_mode="auto"):
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
