"""The skinny matmul (csrc/linear/skinny_gemm.cpp) against a plain-torch reference: every row count a tile takes
(1..16 rows, and row blocks past 16 and past a 128-row pass), odd column counts that end inside a panel, odd K (a
bf16 pair half padded), bias or none, rows with a stride, in each instruction set this CPU runs (AVX-512's tiles
and AVX2's, forced with `_set_skinny_isa`); and the packed linear op using it where the CPU runs it."""

from __future__ import annotations

import pytest
import torch

from cbcore import linear
from cbcore import linear_backends as choice
from cbcore.linear import PackedLinears
from cbcore.linear_backends import SKINNY_GEMM_ENV, linear_backends, onednn_packs, packing_available
from cbcore.attention import paged_step
from cbcore.ops import cpu_isas

_C = pytest.importorskip("cbcore._C")


def _available(dtype: torch.dtype) -> bool:
    return hasattr(_C, "skinny_available") and _C.skinny_available(dtype)


@pytest.fixture(params=["auto", "avx512", "avx2"])
def isa(request):
    """The instruction set the skinny matmul runs: the best this CPU has, then AVX-512's tiles forced where AMX's
    are the best, and AVX2's where AVX-512's are (each skipped where the case before ran it)."""
    best = [_C.skinny_isa(dtype) for dtype in (torch.float32, torch.bfloat16)]
    if request.param == "avx512" and "amx" not in best:
        pytest.skip("AMX's tiles do not run here: the auto case ran AVX-512's or AVX2's")
    if request.param == "avx2" and "avx512" not in best and "amx" not in best:
        pytest.skip("AVX2's tiles are this CPU's best: the auto case ran them")
    _C._set_skinny_isa(request.param)
    yield request.param
    _C._set_skinny_isa("auto")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


ROWS = [1, 2, 3, 4, 7, 8, 12, 13, 16, 17, 33, 64, 150]
# (K, N); K = 64, 96 and 128 take AMX's tiles where they run (K a multiple of 32): one panel, a pair and a single,
# and fifteen (the last partial) split over the threads in pairs.
SHAPES = [(1, 1), (7, 15), (64, 16), (65, 17), (96, 40), (128, 232), (577, 200)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_matmul_matches_the_reference(isa, dtype, rows, shape, bias) -> None:
    if not _available(dtype):
        pytest.skip(f"this CPU has no skinny matmul for {dtype}")
    K, N = shape
    generator = torch.Generator().manual_seed(rows * 1000 + K + N)
    w = torch.randn(N, K, generator=generator).to(dtype)
    b = torch.randn(N, generator=generator).to(dtype) if bias else None
    # Rows with a stride: a view of every other row of a wider tensor, as a slice of a merged projection can be.
    x = torch.randn(rows, K + 3, generator=generator).to(dtype)[:, 1:K + 1]
    out = _C.skinny_matmul(x, _C.skinny_pack(w), N, b)
    assert out.shape == (rows, N) and out.dtype == dtype
    expected = _reference(x, w, b)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * K)
    else:  # fp32 sums, one rounding to bf16 at the end: within one bf16 step (2^-8 relative) of the exact value
        torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=2 ** -7, atol=1e-3 * K ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_matmul_refuses_what_does_not_fit(dtype) -> None:
    if not _available(dtype):
        pytest.skip(f"this CPU has no skinny matmul for {dtype}")
    w = torch.randn(20, 8).to(dtype)
    panels = _C.skinny_pack(w)
    with pytest.raises(ValueError, match="do not fit"):
        _C.skinny_matmul(torch.randn(3, 9).to(dtype), panels, 20)
    with pytest.raises(ValueError, match="bias"):
        _C.skinny_matmul(torch.randn(3, 8).to(dtype), panels, 20, torch.randn(19).to(dtype))
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="x is"):
        _C.skinny_matmul(torch.randn(3, 8).to(other), panels, 20)


@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN linear ops")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("skinny", ["1", "0"])
def test_the_packed_linear_runs_the_skinny_matmul_where_the_cpu_has_it(monkeypatch, dtype, tolerance, skinny) -> None:
    """On by default where available, oneDNN's blocked layout with CBCORE_SKINNY_GEMM=0; the same result both ways."""
    monkeypatch.setenv(SKINNY_GEMM_ENV, skinny)
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(96, 40, bias=True)).to(dtype)
    packed = PackedLinears.attach(layer)
    if packed is None:  # neither the skinny matmul (off, or not on this CPU) nor oneDNN packs this dtype here
        assert not (skinny == "1" and _available(dtype)) and not onednn_packs(dtype)
        pytest.skip(f"nothing packs {dtype} on this CPU with {SKINNY_GEMM_ENV}={skinny}: F.linear runs")
    try:
        handle = layer[0]._cbcore_member.group.handle
        expect_skinny, skinny_max_rows = linear_backends(dtype)
        no_amx_tiles = choice.cpu_has_amx() and dtype == torch.bfloat16 and _C.skinny_isa(dtype) != "amx"
        assert expect_skinny == (skinny == "1" and _available(dtype) and not no_amx_tiles)
        assert _C.packed_linear_is_skinny(handle) == expect_skinny
        onednn_copy = not expect_skinny or (skinny_max_rows >= 0 and onednn_packs(dtype))
        expected_above = (0 if not expect_skinny else skinny_max_rows) if onednn_copy else -1
        assert _C.packed_linear_onednn_above(handle) == expected_above
        for rows in (1, 16, 17, 64, 65, 300):
            x = torch.randn(rows, 96, dtype=dtype)
            with paged_step():
                inside = layer(x)
            expected = torch.nn.functional.linear(x, layer[0].weight, layer[0].bias)
            assert torch.allclose(inside.float(), expected.float(), rtol=tolerance, atol=tolerance)
    finally:
        packed.detach()


@pytest.mark.parametrize("amx,full_width", [(False, False), (False, True), (True, True)])
def test_the_backends_follow_the_cpu(monkeypatch, amx, full_width) -> None:
    """With AMX, bf16 runs the skinny matmul's AMX tiles up to SKINNY_MAX_ROWS_BF16_AMX rows (where they run and
    take K), else oneDNN alone; with full-width AVX-512 (AMX's Xeons, a server Zen 5), fp32 runs the skinny matmul up
    to SKINNY_MAX_ROWS_FP32_WIDE rows and oneDNN above, and bf16 without AMX up to SKINNY_MAX_ROWS_BF16_WIDE; on
    other CPUs fp32 the skinny matmul alone and bf16 the skinny matmul up to SKINNY_MAX_ROWS_BF16 rows;
    CBCORE_SKINNY_GEMM=0 oneDNN alone."""
    monkeypatch.setattr(choice, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(choice, "cpu_full_width_avx512", lambda: full_width)
    for dtype in (torch.float32, torch.bfloat16):
        if not _available(dtype):
            assert linear_backends(dtype) == (False, -1)
            continue
        if amx and dtype == torch.bfloat16:
            amx_tiles = _C.skinny_isa(dtype) == "amx"
            assert linear_backends(dtype, 96) == ((True, choice.SKINNY_MAX_ROWS_BF16_AMX) if amx_tiles else (False, -1))
            assert linear_backends(dtype, 100) == (False, -1)  # K not a multiple of 32: AMX's tiles do not take it
            expected = (True, choice.SKINNY_MAX_ROWS_BF16_AMX) if amx_tiles else (False, -1)
        elif full_width:
            expected = (True, choice.SKINNY_MAX_ROWS_FP32_WIDE if dtype == torch.float32
                        else choice.SKINNY_MAX_ROWS_BF16_WIDE)
        else:
            expected = (True, -1) if dtype == torch.float32 else (True, choice.SKINNY_MAX_ROWS_BF16)
        assert linear_backends(dtype) == expected
    monkeypatch.setenv(SKINNY_GEMM_ENV, "0")
    assert linear_backends(torch.float32) == linear_backends(torch.bfloat16) == (False, -1)


def test_full_width_avx512_is_told_by_the_cpu() -> None:
    """The extension's answer is a bool, and only a CPU with AVX-512 can say yes (its family and model, or AMX)."""
    if not hasattr(_C, "cpu_full_width_avx512"):
        pytest.skip("a build without cpu_full_width_avx512")
    answer = _C.cpu_full_width_avx512()
    assert isinstance(answer, bool)
    assert choice.cpu_full_width_avx512() == answer
    if answer:
        assert any(isa.startswith("avx512") for isa in cpu_isas())


@pytest.mark.skipif(not packing_available() or not _available(torch.float32), reason="no skinny matmul or oneDNN")
def test_calls_past_the_row_limit_run_onednns_copy(monkeypatch) -> None:
    """A weight packed for both: calls of up to skinny_max_rows rows take the skinny matmul, more oneDNN's copy;
    both give F.linear's result. K = 1000, where the two matmuls sum in different orders, so the result tells which
    one ran (at K = 64 they agreed bit for bit and a wrong row limit went unnoticed)."""
    monkeypatch.setattr(linear, "linear_backends", lambda dtype, in_features=None: (True, 8))
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(1000, 48, bias=True))
    packed = PackedLinears.attach(layer)
    try:
        handle = layer[0]._cbcore_member.group.handle
        assert _C.packed_linear_is_skinny(handle) and _C.packed_linear_onednn_above(handle) == 8
        w, b = layer[0].weight.detach(), layer[0].bias.detach()
        panels, blocked = _C.skinny_pack(w), torch.ops.mkldnn._reorder_linear_weight(w, None)
        for rows in (1, 8, 9, 64, 100):
            x = torch.randn(rows, 1000)
            with paged_step():
                inside = layer(x)
            torch.testing.assert_close(inside, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
            # Which matmul ran: its result, bit for bit.
            skinny = _C.skinny_matmul(x, panels, 48, b)
            onednn = torch.ops.mkldnn._linear_pointwise(x, blocked, b, "none", [], None)
            assert torch.equal(inside, skinny if rows <= 8 else onednn)
    finally:
        packed.detach()


def test_the_instruction_set_is_reported_and_forced_by_name_only() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert _C.skinny_isa(dtype) in (("amx", "avx512", "avx2", "none") if dtype == torch.bfloat16 else
                                        ("avx512", "avx2", "none"))
        assert (_C.skinny_isa(dtype) != "none") == _available(dtype)
    assert _C.skinny_isa(torch.float16) == "none"
    with pytest.raises(ValueError, match="unknown instruction set"):
        _C._set_skinny_isa("sse2")
