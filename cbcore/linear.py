"""Prepacked oneDNN matmuls for the model's `nn.Linear` layers during cbcore's CPU steps.

Why: on the CPU a step is mostly linear layers (half of a W1 decode step, three quarters of a prefill step), and
torch's x86 builds run fp32 `F.linear` through MKL, which on this AMD EPYC reaches 83-200 GFLOP/s on the shapes of a
step, against 180-220 GFLOP/s for oneDNN with the weight reordered once into its blocked layout
(`bench/test_bench_linear.py`, `bench/results/linear_cpu.md`). The engine's end-to-end W1 throughput rises by about a
quarter.

How: `PackedLinears.attach(model)` (called by the manager's `start()`) reorders every CPU fp32/bf16 `nn.Linear`
weight with `torch.ops.mkldnn._reorder_linear_weight` and gives the module an instance-level `forward` that runs
`torch.ops.mkldnn._linear_pointwise` on the packed weight, but only inside a cbcore step (`attention.in_paged_step`,
the same thread-local flag the attention uses): a user's own forward, `model.generate` or a training step on another
thread runs the module's own `forward`, untouched. `detach()` (called by `stop()`/`destroy()`) removes the instance
`forward` and frees the packed copies.

Weights changed in place (an optimizer step between two `generate_batch` calls, or inside `manager.pause()`) are
seen: each packed weight remembers the tensor's `_version` counter and is reordered again when it moved. Memory: the
packed copy costs one more copy of the linear weights while a manager runs.

Numerics: oneDNN sums in a different order than MKL, as any change of batch shape already does; greedy parity with
`model.generate` is tested with it on. `CBCORE_PACKED_LINEAR=0` turns it off (read at `start()`).
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass

import torch

from .attention import in_paged_step
from .switches import env_switch

logger = logging.getLogger(__name__)

PACKED_LINEAR_ENV = "CBCORE_PACKED_LINEAR"
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_available() -> bool:
    """Whether this torch build has the oneDNN ops the packed path uses."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packing_enabled() -> bool:
    """`CBCORE_PACKED_LINEAR` (default on): 0/false/no/off turn packing off; anything else not recognised raises."""
    return env_switch(PACKED_LINEAR_ENV)


@dataclass
class _Packed:
    weight: torch.Tensor  # oneDNN blocked layout
    version: int  # the source weight's `_version` when packed


def _pack(weight: torch.Tensor) -> _Packed:
    with torch.no_grad():
        return _Packed(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), weight._version)


def _packed_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The instance `forward`: the packed oneDNN matmul inside a cbcore step, the module's own forward elsewhere."""
    packed: _Packed = module._cbcore_packed
    if not in_paged_step() or x.dtype != module.weight.dtype or x.device.type != "cpu":
        return type(module).forward(module, x)
    if module.weight._version != packed.version:  # updated in place since it was packed
        packed = module._cbcore_packed = _pack(module.weight)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed.weight, module.bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


class PackedLinears:
    """The packed linear layers of one model while a manager runs; `detach()` restores every module."""

    def __init__(self, modules: list[torch.nn.Linear]) -> None:
        self.modules = modules

    @classmethod
    def attach(cls, model: torch.nn.Module) -> PackedLinears | None:
        """Pack every CPU fp32/bf16 `nn.Linear` of `model` (exactly that class, never a subclass); None when packing
        is off, unavailable or nothing qualifies."""
        if not packing_enabled() or not packing_available():
            return None
        modules = [
            m
            for m in model.modules()
            # Exactly nn.Linear: a subclass may do more than F.linear in its own forward (a router returning a tuple,
            # an LM head with a learned logit scale), which the packed forward would silently drop.
            if type(m) is torch.nn.Linear
            and m.weight.device.type == "cpu"
            and m.weight.dtype in _PACKABLE_DTYPES
            and "forward" not in m.__dict__  # someone else already replaced this instance's forward
        ]
        attached: list[torch.nn.Linear] = []
        try:
            for module in modules:
                module._cbcore_packed = _pack(module.weight)
                module.forward = types.MethodType(_packed_forward, module)
                attached.append(module)
        except RuntimeError as error:  # an op this torch build lacks for this dtype: keep the plain path everywhere
            logger.info(f"cbcore: oneDNN weight packing unavailable ({error}); using F.linear")
            cls(attached).detach()
            return None
        return cls(attached) if attached else None

    def detach(self) -> None:
        """Give every module back its own `forward` and free the packed weights."""
        for module in self.modules:
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_cbcore_packed", None)
        self.modules = []
