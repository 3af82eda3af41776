"""The stateful layers' C++ CPU kernels (cbcore._C: causal_conv1d_update / _varlen, gated_delta_rule_recurrent /
_varlen, mamba2_state_update / mamba2_scan_varlen, mamba_state_update / mamba_scan_varlen) against their plain-torch
references (cbcore/ops/state_reference.py), which call transformers' own functions per request; then the dispatch of
the Python faces, the argument checks, and the adapters bound at transformers' seams (cbcore/state_seams.py) against
transformers' functions on the arguments its mixers pass.

Every case runs on a pool with more slots than requests, the requests' slots scattered (not 0..n-1, not in order), so
a read or write of the wrong slot shows; slots no request names must come out untouched. Shapes are small and odd
(channels and value dims not multiples of the vector width) so that the kernels' tails run too.

Tolerances: fp32 atol = rtol = 1e-5 (the kernels sum in another order; the delta rule's and Mamba-2's varlen kernels
run token by token where their references run in chunks). bf16: the same inputs through both, atol = rtol = 2e-2 (a bf16
rounding of the output is up to 2^-8 relative; the conv also rounds before its SiLU, as transformers does).
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from cbcore import state_seams
from cbcore.ops import state_ops, state_reference

_C = state_ops._state_kernels()
pytestmark = pytest.mark.skipif(_C is None, reason="cbcore._C was built without the state-op kernels")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CHANNELS, WIDTH = 37, 4  # 37: a vector tail for every lane count
KEY_HEADS, HEADS, DK, DV = 2, 4, 32, 40  # two value heads per key head; DV 40: wide, one-vector and scalar blocks
RAGGED = [1, 2, WIDTH - 1, WIDTH, WIDTH + 1, 70]


@pytest.fixture(params=_C.state_ops_isas() if _C is not None else ["generic"])
def isa(request):
    """Each instruction set this CPU runs the kernels with (the fixture restores the best one after the test)."""
    _C._set_state_ops_isa(request.param)
    yield request.param
    _C._set_state_ops_isa("auto")


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[got.dtype] if got.dtype in TOLERANCE else TOLERANCE[torch.float32]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def scattered_slots(count: int, generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """A pool size and `count` distinct slots of it in random order, three slots left to nobody."""
    num_slots = count + 3
    return num_slots, torch.randperm(num_slots, generator=generator)[:count]


def packed(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# ---- causal conv1d -------------------------------------------------------------------------------------------------


def conv_inputs(tokens: int, num_slots: int, dtype: torch.dtype, seed: int, bias: bool = True):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, CHANNELS, generator=generator).to(dtype)
    pool = torch.randn(num_slots, CHANNELS, WIDTH, generator=generator).to(dtype)
    weight = (torch.randn(CHANNELS, WIDTH, generator=generator) * 0.5).to(dtype)
    b = torch.randn(CHANNELS, generator=generator).to(dtype) if bias else None
    return x, pool, weight, b


def test_conv_update_matches_transformers_causal_conv1d_update(isa):
    generator = torch.Generator().manual_seed(0)
    num_slots, slots = scattered_slots(5, generator)
    x, pool, weight, bias = conv_inputs(5, num_slots, torch.float32, seed=1)
    want_pool = pool.clone()
    want = state_reference.causal_conv1d_update_reference(x, want_pool, slots, weight, bias, "silu")
    got = _C.causal_conv1d_update(x, pool, slots, weight, bias, "silu")
    assert_close(got, want)
    assert torch.equal(pool, want_pool)


def test_conv_update_without_bias_or_activation(isa):
    generator = torch.Generator().manual_seed(2)
    num_slots, slots = scattered_slots(3, generator)
    x, pool, weight, _ = conv_inputs(3, num_slots, torch.float32, seed=3, bias=False)
    want_pool = pool.clone()
    want = state_reference.causal_conv1d_update_reference(x, want_pool, slots, weight, None, None)
    assert_close(_C.causal_conv1d_update(x, pool, slots, weight, None, None), want)
    assert torch.equal(pool, want_pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_varlen_matches_reference_on_ragged_lengths(isa, dtype):
    generator = torch.Generator().manual_seed(4)
    num_slots, slots = scattered_slots(len(RAGGED), generator)
    x, pool, weight, bias = conv_inputs(sum(RAGGED), num_slots, dtype, seed=5)
    has_initial = torch.tensor([True, False, True, False, True, False])
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    before = pool.clone()
    want_pool = pool.clone()
    want = state_reference.causal_conv1d_varlen_reference(x, packed(RAGGED), want_pool, slots, has_initial, weight,
                                                          bias, "silu")
    got = _C.causal_conv1d_varlen(x, packed(RAGGED), pool, slots, has_initial, weight, bias, "silu")
    assert_close(got, want)
    assert torch.equal(pool, want_pool)  # the last K inputs, exact in any dtype
    assert torch.equal(pool[untouched], before[untouched])


def test_conv_varlen_run_in_chunks_equals_one_call(isa):
    x, pool, weight, bias = conv_inputs(70, 2, torch.float32, seed=6)
    slot = torch.tensor([1])
    whole_pool = pool.clone()
    whole = _C.causal_conv1d_varlen(x, packed([70]), whole_pool, slot, torch.tensor([False]), weight, bias, "silu")
    outputs, begin = [], 0
    for i, length in enumerate([2, 1, WIDTH + 1, 62]):  # chunks shorter and longer than the kernel
        outputs.append(_C.causal_conv1d_varlen(x[begin:begin + length], packed([length]), pool, slot,
                                               torch.tensor([i > 0]), weight, bias, "silu"))
        begin += length
    assert_close(torch.cat(outputs), whole)
    assert torch.equal(pool, whole_pool)


def test_conv_state_carries_from_prefill_through_decode_steps(isa):
    x, pool, weight, bias = conv_inputs(12, 3, torch.float32, seed=7)
    slots = torch.tensor([2])
    whole_pool = pool.clone()
    whole = _C.causal_conv1d_varlen(x, packed([12]), whole_pool, slots, torch.tensor([False]), weight, bias, "silu")
    steps = [_C.causal_conv1d_varlen(x[:5], packed([5]), pool, slots, torch.tensor([False]), weight, bias, "silu")]
    steps += [_C.causal_conv1d_update(x[t:t + 1], pool, slots, weight, bias, "silu") for t in range(5, 12)]
    assert_close(torch.cat(steps), whole)
    assert torch.equal(pool, whole_pool)


def test_conv_request_without_tokens_keeps_or_clears_its_state(isa):
    x, pool, weight, bias = conv_inputs(3, 4, torch.float32, seed=8)
    before = pool.clone()
    slots, has_initial = torch.tensor([3, 0, 1]), torch.tensor([True, False, True])
    out = _C.causal_conv1d_varlen(x, packed([0, 0, 3]), pool, slots, has_initial, weight, bias, None)
    assert out.shape == (3, CHANNELS)
    assert torch.equal(pool[3], before[3])
    assert torch.equal(pool[0], torch.zeros_like(pool[0]))


# ---- gated delta rule ----------------------------------------------------------------------------------------------


def rule_inputs(tokens: int, num_slots: int, dtype: torch.dtype, seed: int, unit_keys: bool = False):
    """q, k [tokens, KEY_HEADS, DK], v [tokens, HEADS, DV], g <= 0 (log decay), beta in (0, 1), an fp32 state pool.
    unit_keys: keys of norm about 1, for runs without L2 normalisation (longer keys make the rule blow up)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, KEY_HEADS, DK, generator=generator)
    k = torch.randn(tokens, KEY_HEADS, DK, generator=generator) * (DK**-0.5 if unit_keys else 1.0)
    v = torch.randn(tokens, HEADS, DV, generator=generator)
    g = -torch.nn.functional.softplus(torch.randn(tokens, HEADS, generator=generator))
    beta = torch.sigmoid(torch.randn(tokens, HEADS, generator=generator))
    pool = torch.randn(num_slots, HEADS, DK, DV, generator=generator) * 0.5
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), pool


def test_delta_recurrent_matches_transformers_recurrent_rule(isa):
    generator = torch.Generator().manual_seed(10)
    num_slots, slots = scattered_slots(6, generator)
    q, k, v, g, beta, pool = rule_inputs(6, num_slots, torch.float32, seed=11)
    want_pool = pool.clone()
    want = state_reference.gated_delta_rule_recurrent_reference(q, k, v, g, beta, want_pool, slots, True)
    got = _C.gated_delta_rule_recurrent(q, k, v, g, beta, pool, slots, True, DK**-0.5)
    assert_close(got, want)
    assert_close(pool, want_pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_varlen_matches_chunked_reference_on_ragged_lengths(isa, dtype):
    generator = torch.Generator().manual_seed(12)
    num_slots, slots = scattered_slots(len(RAGGED), generator)
    q, k, v, g, beta, pool = rule_inputs(sum(RAGGED), num_slots, dtype, seed=13)
    has_initial = torch.tensor([False, True, True, False, True, True])
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    before = pool.clone()
    want_pool = pool.clone()
    want = state_reference.gated_delta_rule_varlen_reference(q, k, v, g, beta, packed(RAGGED), want_pool, slots,
                                                             has_initial, True)
    got = _C.gated_delta_rule_varlen(q, k, v, g, beta, packed(RAGGED), pool, slots, has_initial, True, DK**-0.5)
    assert_close(got, want)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5)  # fp32 in both, whatever the inputs
    assert torch.equal(pool[untouched], before[untouched])


def test_delta_varlen_run_in_chunks_equals_one_call(isa):
    q, k, v, g, beta, pool = rule_inputs(70, 2, torch.float32, seed=14)
    slot = torch.tensor([1])
    whole_pool = pool.clone()
    whole = _C.gated_delta_rule_varlen(q, k, v, g, beta, packed([70]), whole_pool, slot, torch.tensor([False]), True,
                                       DK**-0.5)
    outputs, begin = [], 0
    for i, length in enumerate([1, 3, 64, 2]):
        end = begin + length
        outputs.append(_C.gated_delta_rule_varlen(q[begin:end], k[begin:end], v[begin:end], g[begin:end],
                                                  beta[begin:end], packed([length]), pool, slot,
                                                  torch.tensor([i > 0]), True, DK**-0.5))
        begin = end
    torch.testing.assert_close(torch.cat(outputs), whole, atol=0, rtol=0)  # the same arithmetic, split
    torch.testing.assert_close(pool, whole_pool, atol=0, rtol=0)


def test_delta_state_carries_from_prefill_through_decode_steps(isa):
    q, k, v, g, beta, pool = rule_inputs(9, 3, torch.float32, seed=15)
    slots = torch.tensor([0])
    want_pool = pool.clone()
    want = state_reference.gated_delta_rule_varlen_reference(q, k, v, g, beta, packed([9]), want_pool, slots,
                                                             torch.tensor([False]), True)
    steps = [_C.gated_delta_rule_varlen(q[:4], k[:4], v[:4], g[:4], beta[:4], packed([4]), pool, slots,
                                        torch.tensor([False]), True, DK**-0.5)]
    for t in range(4, 9):
        steps.append(_C.gated_delta_rule_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                                   pool, slots, True, DK**-0.5))
    assert_close(torch.cat(steps), want)
    assert_close(pool, want_pool)


def test_delta_rule_takes_another_scale_and_no_l2norm(isa):
    generator = torch.Generator().manual_seed(16)
    num_slots, slots = scattered_slots(3, generator)
    q, k, v, g, beta, pool = rule_inputs(3 + 5 + 8, num_slots, torch.float32, seed=17, unit_keys=True)
    cu, has_initial = packed([3, 5, 8]), torch.tensor([True, False, True])
    want_pool = pool.clone()
    want = state_reference.gated_delta_rule_varlen_reference(q, k, v, g, beta, cu, want_pool, slots, has_initial, False,
                                                             scale=0.3)
    got = _C.gated_delta_rule_varlen(q, k, v, g, beta, cu, pool, slots, has_initial, False, 0.3)
    assert_close(got, want)
    assert_close(pool, want_pool)


def test_delta_rule_reads_query_and_key_heads_through_strided_views(isa):
    """q, k and v split from one fused projection, as the layer does: rows strided, heads contiguous."""
    q, k, v, g, beta, pool = rule_inputs(7, 2, torch.float32, seed=18)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qs, ks, vs = fused.split([KEY_HEADS * DK, KEY_HEADS * DK, HEADS * DV], dim=1)
    views = qs.view(7, KEY_HEADS, DK), ks.view(7, KEY_HEADS, DK), vs.view(7, HEADS, DV)
    pool_views = pool.clone()
    slots, has_initial = torch.tensor([1, 0]), torch.tensor([True, False])
    want = _C.gated_delta_rule_varlen(q, k, v, g, beta, packed([3, 4]), pool, slots, has_initial, True, DK**-0.5)
    got = _C.gated_delta_rule_varlen(*views, g, beta, packed([3, 4]), pool_views, slots, has_initial, True, DK**-0.5)
    assert torch.equal(got, want)
    assert torch.equal(pool_views, pool)


# ---- Mamba-2 -------------------------------------------------------------------------------------------------------

SSD_HEADS, SSD_GROUPS, SSD_HEAD_DIM, SSD_STATE = 4, 2, 38, 37  # 38 rows: two row blocks, groups of 4 and single rows


def ssd_inputs(tokens: int, num_slots: int, dtype: torch.dtype, seed: int):
    """x, dt (before its bias and softplus), A < 0, B, C, D, dt_bias, z and an fp32 state pool, in the dtypes
    Mamba-2's mixers pass: A fp32, the rest in the model's dtype."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    x = randn(tokens, SSD_HEADS, SSD_HEAD_DIM)
    dt = randn(tokens, SSD_HEADS)
    A = -torch.exp(torch.randn(SSD_HEADS, generator=generator) * 0.5)
    B = randn(tokens, SSD_GROUPS, SSD_STATE, scale=0.5)
    C = randn(tokens, SSD_GROUPS, SSD_STATE, scale=0.5)
    D, dt_bias = randn(SSD_HEADS), randn(SSD_HEADS, scale=0.5)
    z = randn(tokens, SSD_HEADS, SSD_HEAD_DIM)
    pool = torch.randn(num_slots, SSD_HEADS, SSD_HEAD_DIM, SSD_STATE, generator=generator) * 0.5
    return x, dt, A, B, C, D, dt_bias, z, pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_update_matches_transformers_selective_state_update(isa, dtype):
    generator = torch.Generator().manual_seed(30)
    num_slots, slots = scattered_slots(5, generator)
    x, dt, A, B, C, D, dt_bias, z, pool = ssd_inputs(5, num_slots, dtype, seed=31)
    want_pool = pool.clone()
    want = state_reference.mamba2_state_update_reference(x, dt, A, B, C, want_pool, slots, D, dt_bias, z, True)
    got = _C.mamba2_state_update(x, dt, A, B, C, D, dt_bias, z, True, pool, slots)
    assert_close(got, want)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5)  # fp32 in both


def test_mamba2_update_without_skip_bias_gate_or_softplus(isa):
    generator = torch.Generator().manual_seed(32)
    num_slots, slots = scattered_slots(3, generator)
    x, dt, A, B, C, _, _, _, pool = ssd_inputs(3, num_slots, torch.float32, seed=33)
    dt = dt.abs()
    want_pool = pool.clone()
    want = state_reference.mamba2_state_update_reference(x, dt, A, B, C, want_pool, slots)
    assert_close(_C.mamba2_state_update(x, dt, A, B, C, None, None, None, False, pool, slots), want)
    assert_close(pool, want_pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_scan_matches_chunked_reference_on_ragged_lengths(isa, dtype):
    generator = torch.Generator().manual_seed(34)
    num_slots, slots = scattered_slots(len(RAGGED), generator)
    x, dt, A, B, C, D, dt_bias, _, pool = ssd_inputs(sum(RAGGED), num_slots, dtype, seed=35)
    has_initial = torch.tensor([False, True, True, False, True, True])
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    before = pool.clone()
    want_pool = pool.clone()
    # 16-token chunks: the 70-token request spans five, the last one padded
    want = state_reference.mamba2_scan_varlen_reference(x, dt, A, B, C, packed(RAGGED), want_pool, slots,
                                                        has_initial, D, dt_bias, True, chunk_size=16)
    got = _C.mamba2_scan_varlen(x, dt, A, B, C, D, dt_bias, True, 0.0, float("inf"), packed(RAGGED), pool, slots,
                                has_initial)
    assert got.dtype == torch.float32  # as transformers' chunk scan, whatever the inputs
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[untouched], before[untouched])


def test_mamba2_scan_clamps_dt_to_dt_limit(isa):
    x, dt, A, B, C, D, dt_bias, _, pool = ssd_inputs(9, 2, torch.float32, seed=36)
    slots, has_initial, cu = torch.tensor([1, 0]), torch.tensor([True, False]), packed([4, 5])
    want_pool = pool.clone()
    want = state_reference.mamba2_scan_varlen_reference(x, dt, A, B, C, cu, want_pool, slots, has_initial, D,
                                                        dt_bias, True, dt_limit=(0.3, 0.9), chunk_size=4)
    got = _C.mamba2_scan_varlen(x, dt, A, B, C, D, dt_bias, True, 0.3, 0.9, cu, pool, slots, has_initial)
    assert_close(got, want)
    assert_close(pool, want_pool)


def test_mamba2_scan_run_in_chunks_equals_one_call(isa):
    """dt given softplussed already: ATen's softplus (vectorised in blocks) may round an element by its position."""
    x, dt, A, B, C, D, _, _, pool = ssd_inputs(70, 2, torch.float32, seed=37)
    dt = torch.nn.functional.softplus(dt)
    slot = torch.tensor([1])
    whole_pool = pool.clone()
    whole = _C.mamba2_scan_varlen(x, dt, A, B, C, D, None, False, 0.0, float("inf"), packed([70]), whole_pool, slot,
                                  torch.tensor([False]))
    outputs, begin = [], 0
    for i, length in enumerate([1, 3, 64, 2]):
        end = begin + length
        outputs.append(_C.mamba2_scan_varlen(x[begin:end], dt[begin:end], A, B[begin:end], C[begin:end], D, None,
                                             False, 0.0, float("inf"), packed([length]), pool, slot,
                                             torch.tensor([i > 0])))
        begin = end
    torch.testing.assert_close(torch.cat(outputs), whole, atol=0, rtol=0)  # the same arithmetic, split
    torch.testing.assert_close(pool, whole_pool, atol=0, rtol=0)


def test_mamba2_state_carries_from_prefill_through_decode_steps(isa):
    x, dt, A, B, C, D, dt_bias, _, pool = ssd_inputs(9, 3, torch.float32, seed=38)
    slots = torch.tensor([2])
    want_pool = pool.clone()
    want = state_reference.mamba2_scan_varlen_reference(x, dt, A, B, C, packed([9]), want_pool, slots,
                                                        torch.tensor([False]), D, dt_bias, True, chunk_size=4)
    steps = [_C.mamba2_scan_varlen(x[:4], dt[:4], A, B[:4], C[:4], D, dt_bias, True, 0.0, float("inf"), packed([4]),
                                   pool, slots, torch.tensor([False]))]
    for t in range(4, 9):  # the update has no clamp; dt_limit (0, inf) changes nothing after a softplus
        steps.append(_C.mamba2_state_update(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, dt_bias, None,
                                            True, pool, slots))
    assert_close(torch.cat(steps), want)
    assert_close(pool, want_pool)


# ---- Mamba-1 -------------------------------------------------------------------------------------------------------

SEL_CHANNELS, SEL_STATE = 70, 19  # 70 channels: two blocks; 19: a vector tail for every lane count


def selective_inputs(tokens: int, num_slots: int, dtype: torch.dtype, seed: int):
    """x, dt (before its bias and softplus), A < 0, B, C, D, dt_bias, z and an fp32 state pool, in the dtypes Mamba's
    mixers pass: A, D and dt_bias fp32, the rest in the model's dtype."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    x, dt = randn(tokens, SEL_CHANNELS).to(dtype), randn(tokens, SEL_CHANNELS).to(dtype)
    A = -torch.exp(randn(SEL_CHANNELS, SEL_STATE, scale=0.5))
    B, C = randn(tokens, SEL_STATE, scale=0.5).to(dtype), randn(tokens, SEL_STATE, scale=0.5).to(dtype)
    D, dt_bias = randn(SEL_CHANNELS), randn(SEL_CHANNELS, scale=0.5)
    z = randn(tokens, SEL_CHANNELS).to(dtype)
    pool = randn(num_slots, SEL_CHANNELS, SEL_STATE, scale=0.5)
    return x, dt, A, B, C, D, dt_bias, z, pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba_update_matches_transformers_selective_state_update(isa, dtype):
    generator = torch.Generator().manual_seed(40)
    num_slots, slots = scattered_slots(5, generator)
    x, dt, A, B, C, D, dt_bias, z, pool = selective_inputs(5, num_slots, dtype, seed=41)
    D = D.to(dtype)  # the update gets the mixer's D itself, in the model's dtype
    want_pool = pool.clone()
    want = state_reference.mamba_state_update_reference(x, dt, A, B, C, want_pool, slots, D, dt_bias, z, True)
    got = _C.mamba_state_update(x, dt, A, B, C, D, dt_bias, z, True, pool, slots)
    assert_close(got, want)
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba_scan_matches_reference_on_ragged_lengths(isa, dtype):
    """Requests without a state against transformers' scan, those with one against its update token by token."""
    generator = torch.Generator().manual_seed(42)
    num_slots, slots = scattered_slots(len(RAGGED), generator)
    x, dt, A, B, C, D, dt_bias, z, pool = selective_inputs(sum(RAGGED), num_slots, dtype, seed=43)
    has_initial = torch.tensor([True, False, True, False, True, False])
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    before = pool.clone()
    want_pool = pool.clone()
    want = state_reference.mamba_scan_varlen_reference(x, dt, A, B, C, packed(RAGGED), want_pool, slots, has_initial, D,
                                                       dt_bias, z, True)
    got = _C.mamba_scan_varlen(x, dt, A, B, C, D, dt_bias, z, True, packed(RAGGED), pool, slots, has_initial)
    assert got.dtype == torch.float32  # x's dtype promoted with D's (fp32), as transformers' scan
    torch.testing.assert_close(got, want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[untouched], before[untouched])


def test_mamba_scan_with_a_bf16_skip_returns_bf16(isa):
    x, dt, A, B, C, D, dt_bias, z, pool = selective_inputs(6, 2, torch.bfloat16, seed=44)
    slots, has_initial, cu = torch.tensor([0, 1]), torch.tensor([False, False]), packed([2, 4])
    want_pool = pool.clone()
    want = state_reference.mamba_scan_varlen_reference(x, dt, A, B, C, cu, want_pool, slots, has_initial, D.bfloat16(),
                                                       dt_bias, z, True)
    got = _C.mamba_scan_varlen(x, dt, A, B, C, D.bfloat16(), dt_bias, z, True, cu, pool, slots, has_initial)
    assert_close(got, want)


def test_mamba_scan_run_in_chunks_equals_one_call(isa):
    """dt given softplussed already, as in the Mamba-2 case."""
    x, dt, A, B, C, D, _, z, pool = selective_inputs(70, 2, torch.float32, seed=45)
    dt = torch.nn.functional.softplus(dt)
    slot = torch.tensor([0])
    whole_pool = pool.clone()
    whole = _C.mamba_scan_varlen(x, dt, A, B, C, D, None, z, False, packed([70]), whole_pool, slot,
                                 torch.tensor([False]))
    outputs, begin = [], 0
    for i, length in enumerate([2, 1, 65, 2]):
        end = begin + length
        outputs.append(_C.mamba_scan_varlen(x[begin:end], dt[begin:end], A, B[begin:end], C[begin:end], D, None,
                                            z[begin:end], False, packed([length]), pool, slot, torch.tensor([i > 0])))
        begin = end
    torch.testing.assert_close(torch.cat(outputs), whole, atol=0, rtol=0)
    torch.testing.assert_close(pool, whole_pool, atol=0, rtol=0)


def test_mamba_state_carries_from_prefill_through_decode_steps(isa):
    x, dt, A, B, C, D, dt_bias, z, pool = selective_inputs(9, 3, torch.float32, seed=46)
    slots = torch.tensor([1])
    want_pool = pool.clone()
    want = state_reference.mamba_scan_varlen_reference(x, dt, A, B, C, packed([9]), want_pool, slots,
                                                       torch.tensor([False]), D, dt_bias, z, True)
    steps = [_C.mamba_scan_varlen(x[:4], dt[:4], A, B[:4], C[:4], D, dt_bias, z[:4], True, packed([4]), pool, slots,
                                  torch.tensor([False]))]
    for t in range(4, 9):
        steps.append(_C.mamba_state_update(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, dt_bias,
                                           z[t:t + 1], True, pool, slots))
    assert_close(torch.cat(steps), want)
    assert_close(pool, want_pool)


# ---- the Python faces: dispatch ------------------------------------------------------------------------------------


class _Refusing:
    """Stands in for cbcore._C where a test requires the reference: any kernel call fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the C++ kernel {name} ran")


def test_reference_mode_runs_the_references(monkeypatch):
    monkeypatch.setenv("CBCORE_KERNELS", "reference")
    q, k, v, g, beta, pool = rule_inputs(2, 2, torch.float32, seed=19)
    monkeypatch.setattr(state_ops, "_state_kernels", lambda: _Refusing())
    slots = torch.tensor([1, 0])
    want_pool = pool.clone()
    want = state_reference.gated_delta_rule_recurrent_reference(q, k, v, g, beta, want_pool, slots, True)
    assert torch.equal(state_ops.gated_delta_rule_recurrent(q, k, v, g, beta, pool, slots, True), want)


def test_auto_mode_runs_the_kernel_on_cpu_tensors(monkeypatch):
    monkeypatch.setenv("CBCORE_KERNELS", "auto")
    x, pool, weight, bias = conv_inputs(4, 5, torch.float32, seed=20)
    slots = torch.tensor([4, 0, 2, 1])
    kernel_pool = pool.clone()
    want = _C.causal_conv1d_update(x, kernel_pool, slots, weight, bias, "silu")
    assert torch.equal(state_ops.causal_conv1d_update(x, pool, slots, weight, bias, "silu"), want)
    assert torch.equal(pool, kernel_pool)


def test_inputs_the_kernels_do_not_take_run_the_reference_in_auto_mode_and_raise_in_cpu_mode():
    x, pool, weight, bias = conv_inputs(3, 3, torch.float16, seed=21)
    slots, cu, has_initial = torch.tensor([0, 2]), packed([1, 2]), torch.tensor([False, True])
    want_pool = pool.clone()
    want = state_reference.causal_conv1d_varlen_reference(x, cu, want_pool, slots, has_initial, weight, bias, "silu")
    got = state_ops.causal_conv1d_varlen(x, cu, pool, slots, has_initial, weight, bias, "silu", mode="auto")
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="CBCORE_KERNELS=cpu.*float16"):
        state_ops.causal_conv1d_varlen(x, cu, pool, slots, has_initial, weight, bias, "silu", mode="cpu")


def test_the_face_reads_default_scale_from_the_head_dim():
    q, k, v, g, beta, pool = rule_inputs(2, 2, torch.float32, seed=22)
    slots = torch.tensor([0, 1])
    kernel_pool = pool.clone()
    want = _C.gated_delta_rule_recurrent(q, k, v, g, beta, kernel_pool, slots, True, DK**-0.5)
    assert torch.equal(state_ops.gated_delta_rule_recurrent(q, k, v, g, beta, pool, slots, True, mode="cpu"), want)


def test_the_mamba_faces_run_their_kernels_on_cpu_tensors():
    x, dt, A, B, C, D, dt_bias, z, pool = selective_inputs(5, 2, torch.float32, seed=49)
    slots, has_initial, cu = torch.tensor([1, 0]), torch.tensor([True, False]), packed([2, 3])
    kernel_pool = pool.clone()
    want = _C.mamba_scan_varlen(x, dt, A, B, C, D, dt_bias, z, True, cu, kernel_pool, slots, has_initial)
    got = state_ops.mamba_scan_varlen(x, dt, A, B, C, cu, pool, slots, has_initial, D, dt_bias, z, True, mode="cpu")
    assert torch.equal(got, want)
    assert torch.equal(pool, kernel_pool)


def test_mamba2_inputs_the_kernel_does_not_take_run_the_reference_in_auto_mode_and_raise_in_cpu_mode():
    x, dt, A, B, C, D, dt_bias, z, pool = ssd_inputs(2, 2, torch.float16, seed=50)
    slots = torch.tensor([1, 0])
    want_pool = pool.clone()
    want = state_reference.mamba2_state_update_reference(x, dt, A, B, C, want_pool, slots, D, dt_bias, z, True)
    got = state_ops.mamba2_state_update(x, dt, A, B, C, pool, slots, D, dt_bias, z, True, mode="auto")
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="CBCORE_KERNELS=cpu.*float16"):
        state_ops.mamba2_state_update(x, dt, A, B, C, pool, slots, D, dt_bias, z, True, mode="cpu")


# ---- argument checks -----------------------------------------------------------------------------------------------


def _conv_call(implementation: str, slots: torch.Tensor, cu: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32):
    x, pool, weight, bias = conv_inputs(3, 4, torch.float32, seed=23)
    cu = packed([1, 2]) if cu is None else cu
    has_initial = torch.tensor([True, False])
    if implementation == "kernel":
        return _C.causal_conv1d_varlen(x, cu, pool.to(dtype), slots, has_initial, weight, bias, "silu")
    return state_reference.causal_conv1d_varlen_reference(x, cu, pool, slots, has_initial, weight, bias, "silu")


@pytest.mark.parametrize("implementation", ["kernel", "reference"])
def test_a_slot_outside_the_pool_is_refused(implementation):
    with pytest.raises(ValueError, match=r"slots\[1\] is 4, outside"):
        _conv_call(implementation, torch.tensor([0, 4]))


@pytest.mark.parametrize("implementation", ["kernel", "reference"])
def test_a_slot_listed_twice_is_refused(implementation):
    with pytest.raises(ValueError, match="slots lists slot 2 twice"):
        _conv_call(implementation, torch.tensor([2, 2]))


@pytest.mark.parametrize("implementation", ["kernel", "reference"])
def test_cu_seqlens_not_covering_the_tokens_is_refused(implementation):
    with pytest.raises(ValueError, match="cu_seqlens"):
        _conv_call(implementation, torch.tensor([0, 1]), cu=torch.tensor([0, 1, 2]))


def test_a_conv_state_of_another_dtype_is_refused():
    with pytest.raises(ValueError, match="conv_state"):
        _conv_call("kernel", torch.tensor([0, 1]), dtype=torch.bfloat16)


def test_an_unknown_activation_is_refused():
    x, pool, weight, bias = conv_inputs(1, 1, torch.float32, seed=24)
    with pytest.raises(ValueError, match="activation"):
        _C.causal_conv1d_update(x, pool, torch.tensor([0]), weight, bias, "gelu")
    with pytest.raises(ValueError, match="activation"):
        state_reference.causal_conv1d_update_reference(x, pool, torch.tensor([0]), weight, bias, "gelu")


def test_delta_rule_checks_its_shapes_and_state():
    q, k, v, g, beta, pool = rule_inputs(2, 3, torch.float32, seed=25)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="value heads are not a multiple"):
        _C.gated_delta_rule_recurrent(q, k, v[:, :3], g[:, :3], beta[:, :3], pool[:, :3], slots, True, 0.1)
    with pytest.raises(ValueError, match="state must be a contiguous float32"):
        _C.gated_delta_rule_recurrent(q, k, v, g, beta, pool.to(torch.bfloat16), slots, True, 0.1)
    with pytest.raises(ValueError, match="beta must be"):
        _C.gated_delta_rule_recurrent(q, k, v, g, beta[:, :2], pool, slots, True, 0.1)
    with pytest.raises(ValueError, match="slots lists slot 1 twice"):
        _C.gated_delta_rule_recurrent(q, k, v, g, beta, pool, torch.tensor([1, 1]), True, 0.1)


def test_mamba2_kernels_check_their_arguments():
    x, dt, A, B, C, D, dt_bias, z, pool = ssd_inputs(2, 3, torch.float32, seed=47)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="groups dividing the 4 heads"):
        _C.mamba2_state_update(x, dt, A, B[:, :1].expand(2, 3, SSD_STATE), C, D, dt_bias, z, True, pool, slots)
    with pytest.raises(ValueError, match="A must be a floating-point CPU tensor"):
        _C.mamba2_state_update(x, dt, A[:3], B, C, D, dt_bias, z, True, pool, slots)
    with pytest.raises(ValueError, match="dt_bias must be None or"):
        _C.mamba2_state_update(x, dt, A, B, C, D, dt_bias[:2], z, True, pool, slots)
    with pytest.raises(ValueError, match="C must be a Float"):
        _C.mamba2_state_update(x, dt, A, B, C.bfloat16(), D, dt_bias, z, True, pool, slots)
    with pytest.raises(ValueError, match="state must be a contiguous float32"):
        _C.mamba2_state_update(x, dt, A, B, C, D, dt_bias, z, True, pool.bfloat16(), slots)
    with pytest.raises(ValueError, match="has_initial_state must be"):
        _C.mamba2_scan_varlen(x, dt, A, B, C, D, dt_bias, True, 0.0, float("inf"), packed([2]), pool, slots[:1],
                              torch.tensor([1]))


def test_mamba_kernels_check_their_arguments():
    x, dt, A, B, C, D, dt_bias, z, pool = selective_inputs(2, 3, torch.float32, seed=48)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="dt must be"):
        _C.mamba_state_update(x, dt[:, :5], A, B, C, D, dt_bias, z, True, pool, slots)
    with pytest.raises(ValueError, match="z must be"):
        _C.mamba_state_update(x, dt, A, B, C, D, dt_bias, z.t().contiguous().t(), True, pool, slots)
    with pytest.raises(ValueError, match="D must be"):
        _C.mamba_state_update(x, dt, A, B, C, D[:3], dt_bias, z, True, pool, slots)
    with pytest.raises(ValueError, match="D is Double"):
        _C.mamba_scan_varlen(x, dt, A, B, C, D.double(), dt_bias, z, True, packed([2]), pool, slots[:1],
                             torch.tensor([False]))
    with pytest.raises(ValueError, match="slots lists slot 1 twice"):
        _C.mamba_state_update(x, dt, A, B, C, D, dt_bias, z, True, pool, torch.tensor([1, 1]))


# ---- transformers' seams (cbcore/state_seams.py) -----------------------------------------------------------------


def transformers_function(module: str, name: str):
    """transformers' torch function `name` of models/<module>, unwrapped from its hub-kernel decorator."""
    return inspect.unwrap(getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name))


def test_mamba2_seams_return_what_transformers_returns_for_the_mixers_arguments():
    """The update given dt, A, D and dt_bias expanded over the head dim (as Mamba2Mixer passes them); the scan from a
    state and from none, in [batch, tokens, heads, head_dim]."""
    x, dt, A, B, C, D, dt_bias, _, pool = ssd_inputs(12, 2, torch.float32, seed=60)
    per_row = (SSD_HEADS, SSD_HEAD_DIM)
    update_args = (x[:2], dt[:2, :, None].expand(2, *per_row), A[:, None, None].expand(*per_row, SSD_STATE), B[:2],
                   C[:2], D[:, None].expand(per_row))
    update_kwargs = {"z": None, "dt_bias": dt_bias[:, None].expand(per_row), "dt_softplus": True}
    state, want_state = pool.clone(), pool.clone()
    want = transformers_function("mamba2", "mamba2_selective_state_update")(want_state, *update_args, **update_kwargs)
    got = state_seams._KERNELS["mamba2_selective_state_update"](state, *update_args, **update_kwargs)
    assert_close(got, want)
    assert_close(state, want_state)

    def scan_args(t: torch.Tensor) -> torch.Tensor:
        return t[:10].reshape(2, 5, *t.shape[1:])

    before = pool.clone()
    for initial in (None, pool):
        scan_kwargs = {"chunk_size": 4, "D": D, "dt_bias": dt_bias, "initial_states": initial, "dt_softplus": True,
                       "dt_limit": (0.0, float("inf")), "return_final_states": True, "z": None}
        args = [scan_args(t) for t in (x, dt)] + [A] + [scan_args(t) for t in (B, C)]
        want, want_final = transformers_function("mamba2", "mamba2_chunk_scan")(*args, **scan_kwargs)
        got, final = state_seams._KERNELS["mamba2_chunk_scan"](*args, **scan_kwargs)
        assert_close(got, want)
        assert_close(final, want_final)
    assert torch.equal(pool, before)  # initial_states left as it was, as transformers leaves it


def test_mamba_seams_return_what_transformers_returns_for_the_mixers_arguments():
    """The update on [batch, channels] rows; the scan on [batch, channels, tokens] (tokens contiguous, as MambaMixer's
    conv output) with B and C as transposed views, from zeros."""
    x, dt, A, B, C, D, dt_bias, z, pool = selective_inputs(12, 2, torch.float32, seed=61)
    state, want_state = pool.clone(), pool.clone()
    update_kwargs = {"z": z[:2], "dt_bias": dt_bias, "dt_softplus": True}
    want = transformers_function("mamba", "mamba_selective_state_update")(want_state, x[:2], dt[:2], A, B[:2], C[:2],
                                                                          D, **update_kwargs)
    got = state_seams._KERNELS["mamba_selective_state_update"](state, x[:2], dt[:2], A, B[:2], C[:2], D,
                                                              **update_kwargs)
    assert_close(got, want)
    assert_close(state, want_state)

    def columns(t: torch.Tensor) -> torch.Tensor:  # [2 * 6, width] -> [2, width, 6], tokens contiguous
        return t.reshape(2, 6, -1).transpose(1, 2).contiguous()

    args = (columns(x), columns(dt), A, columns(B), columns(C))
    scan_kwargs = {"D": D, "z": columns(z), "delta_bias": dt_bias, "delta_softplus": True, "return_last_state": True}
    want, want_last = transformers_function("mamba", "mamba_selective_scan")(*args, **scan_kwargs)
    got, last = state_seams._KERNELS["mamba_selective_scan"](*args, **scan_kwargs)
    assert_close(got, want)
    assert_close(last, want_last)


def test_bind_points_the_mamba_seams_at_dispatchers_and_unbind_gives_them_back():
    from transformers.models.bamba import modeling_bamba
    from transformers.models.jamba import modeling_jamba

    seams = {modeling_bamba: ("mamba2_selective_state_update", "mamba2_chunk_scan"),
             modeling_jamba: ("mamba_selective_state_update", "mamba_selective_scan")}
    originals = {(module, name): getattr(module, name) for module, names in seams.items() for name in names}
    bound = state_seams.bind({module.__name__ for module in seams})
    try:
        assert bound == {module.__name__ for module in seams}
        for (module, name), original in originals.items():
            assert getattr(module, name).cbcore_seam and getattr(module, name).__wrapped__ is original
    finally:
        state_seams.unbind(bound)
    for (module, name), original in originals.items():
        assert getattr(module, name) is original
