"""The step a thread is running: `paged_step(step)` marks a forward as a cbcore step (its attention layers read the
step's `StepMetadata` from here when their decoder layer does not hand the forward's kwargs down, and transformers'
mask function, called without them, sees that no mask is wanted), hands the step to the C++ CPU kernel of
`torch.ops.cbcore.step_attention`, and `STEP_TRACE` tells a trace of cbcore's compiled step from a trace of the
user's own forward. Read by the attention function (cbcore/attention.py), the packed linears, the position hooks and
the stateful layers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from . import ops

_in_paged_step = threading.local()


@contextmanager
def paged_step(step: StepMetadata | None = None) -> Iterator[None]:
    """Mark the current thread's forward as a cbcore step (no mask is built; attention goes to the pages). `step` is
    the step's metadata, for the attention layers of models whose decoder layers do not hand the forward's keyword
    arguments down (StableLM, Nemotron): the keyword argument is used when it arrives, this otherwise."""
    _in_paged_step.active = True
    _in_paged_step.step = step
    extension = _enter_cpu_step(step)
    try:
        yield
    finally:
        _in_paged_step.active = False
        _in_paged_step.step = None
        if extension is not None:
            extension.exit_cpu_step()


def _enter_cpu_step(step: Any):
    """Hand the step to the C++ CPU kernel of `torch.ops.cbcore.step_attention` (csrc/attention/
    cpu_step_attention.cpp) when its kernels are the C++ CPU ones; the extension to call `exit_cpu_step` on after, or
    None. A step of another kernel mode (the reference, CUDA) or device is left to the op's Python implementation."""
    extension = cpu_step_extension()
    if extension is None:
        return None
    if isinstance(step, WarmupStep):
        extension.enter_warmup_step()
        return extension
    if not isinstance(step, StepMetadata) or step.kernel_mode not in ("auto", "cpu"):
        return None
    # Copies of the page lists, taken by iteration: the start-up self-check hands a list that counts item reads (one
    # per layer's attention call).
    key_caches, value_caches = list(step.key_caches), list(step.value_caches)
    if not key_caches or key_caches[0].device.type != "cpu" or ops.cpu_kernels() is None:
        return None
    extension.enter_cpu_step(key_caches, value_caches, step.slot_mapping, step.num_decode_tokens,
                             step.decode_block_table, step.decode_seq_lens, step.num_prefill_requests,
                             step.prefill_block_table, step.prefill_cu_seqlens_q, step.prefill_seq_lens_k,
                             step.cascade_decode)
    return extension


def current_step() -> Any:
    """The step metadata handed to `paged_step()` on this thread (None outside cbcore's steps)."""
    return getattr(_in_paged_step, "step", None) if in_paged_step() else None


def in_paged_step() -> bool:
    """Whether the current thread is inside a cbcore step's forward."""
    return getattr(_in_paged_step, "active", False)


class _StepTrace:
    """Whether the code Dynamo is tracing is cbcore's compiled step: the compiled function sets `active` around its
    model call (cbcore/compiled_step.py), so inside that trace it reads True, while a `torch.compile` of the user's own
    forward (the model bound to a manager meanwhile) reads False and traces the model's own attention and linears."""

    active: bool = False


STEP_TRACE = _StepTrace()


def tracing_compiled_step() -> bool:
    """Whether torch is compiling cbcore's step forward right now (not some other code that calls the model)."""
    return torch.compiler.is_compiling() and STEP_TRACE.active


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
    # The kernel mode (CBCORE_KERNELS) the engine resolved when it was built; every layer's op calls use it.
    kernel_mode: str = "auto"
    # Whether the CPU decode plans cascade over shared prefixes (CBCORE_CASCADE_DECODE, resolved with kernel_mode).
    cascade_decode: bool = True
    # Each packed token's position in its request, `[num_tokens]` (cbcore/positions.py hands it to decoders that
    # compute positions themselves).
    positions: torch.Tensor | None = None
    # The step's requests as the stateful layers run them (a `state_layers.StateStep`), for a model with such layers.
    states: Any = None
    # The kernels' plans for this step, made by the first layer's calls and reused by the others (cbcore/ops).
    kernel_plans: ops.StepKernelPlans = field(init=False)

    def __post_init__(self) -> None:
        self.kernel_plans = ops.StepKernelPlans(self.cascade_decode)


class WarmupStep:
    """Handed to `paged_step()` while the compiled forward is compiled ahead (cbcore/compiled_step.py): each layer's
    attention answers zeros and no cache is touched."""

    @staticmethod
    def attention(query: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A layer's attention output while compiling ahead: zeros `[1, T, heads, d_v]` (transformers' layout)."""
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1])


def cpu_step_extension():
    """cbcore._C when it carries the C++ CPU kernel of `step_attention` (a stale build may not), else None."""
    try:
        from . import _C
    except ImportError:
        return None
    return _C if hasattr(_C, "enter_cpu_step") else None
