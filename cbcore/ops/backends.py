"""Which kernel backends this process has, and the switches that choose among them: `CBCORE_KERNELS` (the mode),
`CBCORE_CPU_ISA` (the CPU kernels' instruction set), `CBCORE_CASCADE_DECODE`; each backend's module loaded once
(cbcore._C, cbcore._cuda, cbcore.triton_kernels), None where it did not build or import. What each switch does:
cbcore/ops/__init__.py."""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Callable

import torch

from ..switches import env_switch

KERNELS_ENV = "CBCORE_KERNELS"
CPU_ISA_ENV = "CBCORE_CPU_ISA"
CASCADE_ENV = "CBCORE_CASCADE_DECODE"
KERNEL_MODES = ("auto", "reference", "cpu", "cuda", "triton")


def cascade_enabled() -> bool:
    """CBCORE_CASCADE_DECODE (default on): whether the C++ CPU decode plans attend shared block-table prefixes once
    per group of requests (the cascade) instead of once per request."""
    return env_switch(CASCADE_ENV)


def kernel_mode() -> str:
    """The value of CBCORE_KERNELS (default "auto"); ValueError naming the variable for an unknown value."""
    value = os.environ.get(KERNELS_ENV, "")
    mode = value.strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNELS_ENV}={value!r} is not one of {', '.join(KERNEL_MODES)}; unset it for the default "
                         "(auto: the fastest kernel for the tensors' device, else the reference)")
    return mode


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """cbcore._C when it carries the CPU attention ops (a stale build of the allocator alone does not), its
    instruction set set from CBCORE_CPU_ISA."""
    try:
        from .. import _C
    except ImportError:
        return None
    if not hasattr(_C, "decode_attention"):
        return None
    _apply_cpu_isa(_C)
    return _C


def _apply_cpu_isa(module: ModuleType) -> None:
    """Force the instruction set CBCORE_CPU_ISA names (unset or "auto": the best this CPU runs)."""
    value = os.environ.get(CPU_ISA_ENV, "")
    name = value.strip().lower() or "auto"
    if not hasattr(module, "cpu_attention_isas"):  # a build from before the AVX-512 copy: one choice, its own
        if name != "auto":
            raise ValueError(f"{CPU_ISA_ENV}={value!r} needs a cbcore._C built with instruction-set selection; "
                             "reinstall cbcore")
        return
    available = module.cpu_attention_isas()
    if name != "auto" and name not in available:
        raise ValueError(f"{CPU_ISA_ENV}={value!r}: this CPU and build run the CPU attention kernels with "
                         f"{', '.join(available)} (or auto, the best of them); unset it for auto")
    module._set_cpu_attention_isa(name)


def cpu_isas() -> list[str]:
    """The instruction sets the C++ CPU kernels can run with here, portable first (empty without cbcore._C)."""
    cpu = cpu_kernels()
    return list(cpu.cpu_attention_isas()) if cpu is not None else []


@functools.cache
def cuda_kernels() -> ModuleType | None:
    """cbcore._cuda, built only when torch has CUDA and nvcc was found at install time."""
    try:
        from .. import _cuda
    except ImportError:
        return None
    return _cuda


@functools.cache
def triton_prefill_kernel() -> Callable[..., torch.Tensor] | None:
    """The Triton prefill kernel when cbcore.triton_kernels is installed and the triton package is present."""
    try:
        from ..triton_kernels import prefill
    except ImportError:
        return None
    return prefill.prefill_attention if prefill.TRITON_AVAILABLE else None


def available_backends() -> dict[str, str | None]:
    """What loaded, for READMEs and benchmark output: the mode, and per backend a description or None."""
    cpu, cuda, triton_prefill = cpu_kernels(), cuda_kernels(), triton_prefill_kernel()
    return {
        "mode": kernel_mode(),
        "cpu": f"cbcore._C ({cpu.cpu_attention_isa()})" if cpu is not None else None,
        "cuda": "cbcore._cuda" if cuda is not None else None,
        "triton": "cbcore.triton_kernels.prefill" if triton_prefill is not None else None,
        "reference": "plain torch (cbcore.ops.*_reference)",
    }
