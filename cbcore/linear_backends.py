"""Which matmul a packed linear weight runs on, per CPU and dtype: cbcore's skinny matmul (AVX2 / AVX-512 / AMX
tiles), oneDNN's packed matmul, or both with a row count where they cross; and whether this build and CPU can pack at
all. cbcore/linear.py packs with what this module chooses (`linear_backends`)."""

from __future__ import annotations

import functools

import torch

from .switches import env_switch

SKINNY_GEMM_ENV = "CBCORE_SKINNY_GEMM"


def linear_extension():
    """cbcore._C when it carries the packed linear op (a stale build may not), else None."""
    try:
        from . import _C
    except ImportError:
        return None
    return _C if hasattr(_C, "register_packed_linear") else None


def packing_available() -> bool:
    """Whether this torch build has the oneDNN ops the packed path uses, and cbcore._C the op that runs them."""
    return (bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and linear_extension() is not None)


@functools.lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU: bf16 needs AVX-512 (or AVX-NE-CONVERT), so an AVX2-only
    CPU packs none and its bf16 weights are packed only for the skinny matmul (`_C.skinny_available`)."""
    if not packing_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(8, 8).to(dtype), None)
    except RuntimeError:
        return False
    return True


# The most rows a call runs on the skinny matmul when oneDNN's copy is there too, where the two cross. bf16 on a CPU
# without AMX: the skinny matmul leads oneDNN at 64 rows on a Zen 4 and trails it at 128 (docs/performance_log.md,
# 2026-12-02).
SKINNY_MAX_ROWS_BF16 = 64
# fp32 on a CPU with two full 512-bit FMA units a core (a Xeon with AMX, a server or desktop Zen 5): oneDNN's larger
# register tiles overtake the skinny matmul between 64 and 128 rows (bench/linear_crossover.py,
# bench/results/linear_crossover_xeon_amx.md, bench/results/linear_crossover_zen5.md).
SKINNY_MAX_ROWS_FP32_WIDE = 64
# bf16 on a Zen 5 with full-width AVX-512 (no AMX): the skinny matmul's vdpbf16ps leads oneDNN up to about 128 rows
# of a W2-shaped step (bench/results/linear_crossover_zen5.md); up to 128 rows also spares oneDNN's primitive per new
# row count (see the AMX limit below).
SKINNY_MAX_ROWS_BF16_WIDE = 128
# bf16 on a CPU with AMX tiles, where the skinny matmul runs them too (K a multiple of AMX_DEPTH): on a Xeon with AMX,
# with its 2 x 2 tile blocks, it leads oneDNN up to 64 rows and about ties it at 96-128
# (bench/results/linear_crossover_xeon_amx.md). Even at 96-128 it wins where a row count is new, since oneDNN builds a
# primitive per row count, and in the engine W1 and W2 bf16 ran faster with 128 here than with 32
# (docs/performance_log.md, 2026-12-03, the decode step's linears).
SKINNY_MAX_ROWS_BF16_AMX = 128
AMX_DEPTH = 32  # k per AMX tile product: the skinny matmul's AMX tiles take K a multiple of it


@functools.lru_cache(maxsize=None)
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon of the 4th generation and later), on which oneDNN runs bf16 matmuls.
    torch's own check, private, so a build without it counts as no AMX."""
    check = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=None)
def cpu_full_width_avx512() -> bool:
    """Whether this CPU runs AVX-512 on two full 512-bit FMA units a core (a Xeon with AMX; AMD's server and desktop
    Zen 5, told by CPUID's family and model), where oneDNN's fp32 matmul overtakes the skinny one on many rows. A Zen 4
    or a mobile Zen 5 splits each 512-bit FMA in two. False without the extension or on a build that predates it."""
    ext = linear_extension()
    return bool(ext.cpu_full_width_avx512()) if ext is not None and hasattr(ext, "cpu_full_width_avx512") else False


def linear_backends(dtype: torch.dtype, in_features: int | None = None) -> tuple[bool, int]:
    """Where this CPU runs a packed weight of `dtype`: `(skinny, skinny_max_rows)` for `_C.register_packed_linear`.
    `skinny`: packed for cbcore's skinny matmul (where the CPU runs it for the dtype), else for oneDNN alone;
    `skinny_max_rows` >= 0: oneDNN's copy too, for calls of more rows; -1: every call on the skinny matmul.

    - `CBCORE_SKINNY_GEMM=0`, or no skinny matmul for the dtype here: oneDNN alone.
    - AMX: bf16 on the skinny matmul's AMX tiles up to SKINNY_MAX_ROWS_BF16_AMX rows and oneDNN's copy above, where
      the skinny matmul runs AMX tiles for `in_features` (None: any K they take); else on oneDNN alone (on its AMX
      tiles it ran a step's linears 0.96-1.2x as fast as the skinny matmul's vdpbf16ps at 1-8 rows, 1.3-1.5x at 16,
      3.5-4x at 64, 6.8x at 512).
    - Full-width AVX-512 (AMX's Xeons, a server or desktop Zen 5): fp32 on the skinny matmul up to
      SKINNY_MAX_ROWS_FP32_WIDE rows, where it streams a decode step's weights as fast or faster, and on oneDNN's copy
      above (1.07-1.22x at 128-2048 rows: two full FMA units a core favour oneDNN's larger register tiles); bf16
      without AMX on the skinny matmul up to SKINNY_MAX_ROWS_BF16_WIDE rows and oneDNN's copy above.
    - Otherwise (a Zen 4, an AVX2 CPU): fp32 on the skinny matmul alone (one copy: on a prefill's rows it reached
      0.9-1.04x oneDNN on wide projections), bf16 on the skinny matmul up to SKINNY_MAX_ROWS_BF16 rows and on
      oneDNN's copy above, where oneDNN packs bf16.
    """
    if not (env_switch(SKINNY_GEMM_ENV) and linear_extension().skinny_available(dtype)):
        return False, -1
    if cpu_has_amx() and dtype == torch.bfloat16:
        amx_tiles = (linear_extension().skinny_isa(dtype) == "amx"
                     and (in_features is None or in_features % AMX_DEPTH == 0))
        return (True, SKINNY_MAX_ROWS_BF16_AMX) if amx_tiles else (False, -1)
    if cpu_has_amx() or cpu_full_width_avx512():
        return (True, SKINNY_MAX_ROWS_FP32_WIDE) if dtype == torch.float32 else (True, SKINNY_MAX_ROWS_BF16_WIDE)
    if dtype == torch.bfloat16:
        return True, SKINNY_MAX_ROWS_BF16
    return True, -1
