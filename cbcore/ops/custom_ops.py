"""cbcore's kernels as `torch.library` custom ops: `torch.ops.cbcore.cache_write`, `.decode_attention`,
`.prefill_attention` (issue 12's first part, for the compiled step).

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


# ---- One layer's whole step attention, for the compiled forward --------------------------------------------------
# The compiled forward traces the model's Python (norms, RoPE, MLPs) but not the step's batch layout: which rows are
# decode rows, the block tables, the CPU kernels' per-step plans. Those change every step, and as graph inputs they
# would make every step's count of decode rows a guard (a recompile) or force tensors where the kernels take plans.
# So one op per layer takes only what the layer computed (q, k, v: their token dimension is the graph's one dynamic
# size) and what is fixed at its call site (layer, scale, window, softcap, sinks), and reads the rest from the step
# the runner is executing (`attention.current_step()`, set around the forward by `paged_step`), exactly as the eager
# attention function does. It writes the layer's new K/V into that step's pages: pages the graph never sees (they are
# not its inputs), so there is nothing for the compiler to order or functionalize around them.


# Defined with torch.library's lower-level API rather than `custom_op`: the compiled graph calls it once per layer per
# step, and `custom_op`'s Python wrapper (autograd redispatch, aliasing check, Dynamo guard) made a call cost 12.5 us
# against 5.8 for the same op defined this way (a trivial body, measured on this project's CPU). It mutates nothing
# the graph sees, returns a fresh tensor, and has no autograd formula (the engine runs under inference mode).
_library = torch.library.Library("cbcore", "FRAGMENT")
_library.define(
    "step_attention(Tensor query, Tensor key, Tensor value, int layer, float scale, int? sliding_window=None, "
    "float? softcap=None, Tensor? sinks=None) -> Tensor"
)


def _cpu_step_extension():
    """cbcore._C when it carries the C++ CPU kernel of `step_attention` (a stale build may not), else None."""
    try:
        from .. import _C
    except ImportError:
        return None
    return _C if hasattr(_C, "enter_cpu_step") else None


def step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                   sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                   sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Layer `layer`'s attention in the current cbcore step: query `[1, heads, T, d]`, key/value `[1, kv_heads, T,
    d]` / `[1, kv_heads, T, d_v]` (transformers' layout) -> `[1, T, heads, d_v]`. Raises RuntimeError outside a step.
    The implementation of `torch.ops.cbcore.step_attention` on every device."""
    from .. import attention

    step = attention.current_step()
    if step is None:
        raise RuntimeError("torch.ops.cbcore.step_attention ran outside a cbcore step (paged_step was not entered)")
    if isinstance(step, attention.WarmupStep):  # compiling ahead: no cache to attend over
        return step.attention(query, value)
    return attention.run_step_attention(step, layer, query, key, value, scale, sliding_window, softcap, sinks)


_library.impl("step_attention", step_attention, "CompositeExplicitAutograd")
# On the CPU the op's kernel is C++ (csrc/attention/cpu_step_attention.cpp): inside a step whose context
# cbcore.attention.paged_step entered it runs the kernels itself, ~60-80 us a layer less than this body; what it does
# not take it hands back to this function.
_step_extension = _cpu_step_extension()
if _step_extension is not None:
    _step_extension.set_python_step_attention(step_attention)


@torch.library.register_fake("cbcore::step_attention")
def _(query, key, value, layer, scale, sliding_window=None, softcap=None, sinks=None):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])
