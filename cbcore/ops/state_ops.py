"""The stateful layers' ops: causal depthwise conv1d with a conv state, the gated delta rule with a recurrent state
(Qwen3.5 / Qwen3-Next's linear attention layers), and the selective scans of Mamba-1 and Mamba-2 (state space models)
with theirs. One Python face per op, picking its implementation like the attention ops in `cbcore.ops` (CBCORE_KERNELS
through `kernel_mode()`): the C++ CPU kernel of `cbcore._C` for CPU tensors it takes, the plain-torch reference
otherwise.

States live in pools `[num_slots, ...]`, one slot per request, indexed by `slots` (int64 `[requests]`); a caller
holding a `[batch, ...]` state tensor passes it with `slots = torch.arange(batch)`. The ops read and write the slots in
place. A slot listed twice in one call is refused (ValueError), as is a slot outside the pool.

Shapes (flat tensors only; packed requests as in the attention ops: request i's tokens are rows
`cu_seqlens[i]:cu_seqlens[i + 1]` of the token dimension):
    causal_conv1d_update   x [batch, C], conv_state [num_slots, C, K], weight [C, K], bias [C] | None -> [batch, C]
    causal_conv1d_varlen   x [tokens, C], cu_seqlens [N + 1], has_initial_state [N] bool, ...        -> [tokens, C]
    gated_delta_rule_recurrent  q, k [batch, Hk, Dk], v [batch, H, Dv], g, beta [batch, H],
                                state float32 [num_slots, H, Dk, Dv]                                -> [batch, H, Dv]
    gated_delta_rule_varlen     q, k [tokens, Hk, Dk], v [tokens, H, Dv], g, beta [tokens, H], cu_seqlens,
                                has_initial_state, state                                            -> [tokens, H, Dv]
    mamba2_state_update    x [batch, H, P], dt [batch, H], A [H], B, C [batch, G, N], D, dt_bias [H] | None,
                           z [batch, H, P] | None, state float32 [num_slots, H, P, N]                -> [batch, H, P]
    mamba2_scan_varlen     x [tokens, H, P], dt [tokens, H], B, C [tokens, G, N], cu_seqlens, has_initial_state,
                           A, D, dt_bias, state as above                                 -> float32 [tokens, H, P]
    mamba_state_update     x, z [batch, Din], dt [batch, Din], A [Din, N], B, C [batch, N], D, dt_bias [Din] | None,
                           state float32 [num_slots, Din, N]                                        -> [batch, Din]
    mamba_scan_varlen      x, z, dt [tokens, Din], B, C [tokens, N], cu_seqlens, has_initial_state, ... -> [tokens, Din]
H counts the value heads; Hk must divide it, value head h reading query/key head h // (H / Hk) (transformers'
functions repeat_interleave q and k to H; Qwen3-Next's layer passes them unrepeated). Likewise Mamba-2's G groups of
B and C: head h reads group h // (H / G).

Semantics: transformers' own torch functions, called per request, are the references here (Qwen3-Next's in
models/qwen3_next/modeling_qwen3_next.py for the conv and the delta rule):
  - the conv state keeps the last K inputs; a decode step (`causal_conv1d_update`) is `causal_conv1d_update` with one
    token. In a varlen call, request i's left context is its slot's state when has_initial_state[i], zeros otherwise
    (transformers' prefill pads a first chunk with zeros), its outputs are `causal_conv1d_fn` over (context, tokens),
    and the last K inputs of (context, tokens) are written back. A request with no tokens keeps its state (or gets
    zeros, without an initial state).
  - the gated delta rule runs in fp32 whatever the inputs' dtype (the state is fp32, as transformers keeps it), output
    in q's dtype: per token, q and k L2-normalised when use_qk_l2norm (x * rsqrt(sum x^2 + 1e-6)), q multiplied by
    `scale` (None: Dk ** -0.5, transformers' fixed scale), then S *= exp(g); kv = k^T S; delta = (v - kv) * beta;
    S += k delta^T; o = q^T S (`torch_recurrent_gated_delta_rule`). The varlen reference is
    `torch_chunk_gated_delta_rule` (what transformers runs on a prompt), from each slot's state or zeros.
  - Mamba-2 (models/mamba2/modeling_mamba2.py): per token, dt = dt + dt_bias, softplus'd when dt_softplus (in dt's
    dtype, as transformers), decay = exp(dt A), S = S decay + dt B x^T, y = S C + D x (times silu(z) in the update).
    The update's reference is `mamba2_selective_state_update` (dt, A, D, dt_bias expanded over the head dim, as
    Mamba-2's mixers pass them); the varlen's is `mamba2_chunk_scan` (dt also clamped to dt_limit; output in fp32,
    as transformers'), from each slot's state or zeros.
  - Mamba-1 (models/mamba/modeling_mamba.py): the same per channel, with A per channel and state element. The
    update's reference is `mamba_selective_state_update`; the varlen's is `mamba_selective_scan` for a request
    without an initial state (transformers' scan starts from zeros) and, for one with, `mamba_selective_state_update`
    token by token from its slot (how cbcore continues a Mamba-1 layer over a chunked prompt, cbcore/state_layers.py).
    The varlen output is in x's dtype promoted with D's, as `mamba_selective_scan` returns it.

The C++ kernels (csrc/state_ops/): fp32 and bf16 inputs of one dtype (the conv: x, conv state, weight and bias; the
delta rule: q, k, v, with g and beta of any float dtype), contiguous last dimensions and contiguous state pools. The
conv accumulates in fp32 and, as transformers' conv1d, rounds to the input dtype before the SiLU. The delta rule's
varlen kernel is the recurrent form, token by token (each state element loaded and stored once per token); against
the chunked reference it differs by fp32 rounding only: on 70-token requests from random states, at most ~1e-6
relative to the output's scale (tests/test_state_ops.py holds it to 1e-5). The Mamba kernels take x, B, C and z of
one dtype (dt, A, D and dt_bias of any float dtype) and keep the state in fp32. dt's bias, softplus and clamp run with
torch's own ops in dt's dtype, as transformers runs them; the rest is fp32 arithmetic, rounded to bf16 where
transformers' functions compute in bf16 (the updates' dt B and dt B x, the state before its product with C and that
product, x D where D is bf16), so that a bf16 state advances as transformers advances it, to fp32 rounding (on the
tests' inputs the bf16 updates' outputs equal transformers' bit for bit). Mamba-2's varlen kernel is the recurrent
form too: against the chunked SSD reference, ~2e-7 of the output's scale on 70-token requests and ~1e-6 on a
512-token one (its final state ~5e-6), fp32. Anything else (fp16, CUDA tensors, a strided pool) runs the reference
under `auto` and raises under `CBCORE_KERNELS=cpu`.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from .backends import KERNELS_ENV, cpu_kernels, kernel_mode
from .state_reference import (
    causal_conv1d_update_reference,
    causal_conv1d_varlen_reference,
    gated_delta_rule_recurrent_reference,
    gated_delta_rule_varlen_reference,
    mamba2_state_update_reference,
    mamba2_scan_varlen_reference,
    mamba_state_update_reference,
    mamba_scan_varlen_reference,
)

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


# ---- dispatch --------------------------------------------------------------------------------------------------------


@functools.cache
def _state_kernels() -> ModuleType | None:
    """cbcore._C when it carries the state ops (an older build does not)."""
    cpu = cpu_kernels()
    wanted = ("gated_delta_rule_varlen", "mamba_scan_varlen")
    return cpu if cpu is not None and all(hasattr(cpu, name) for name in wanted) else None


def _why_not_cpu(tensors: tuple[torch.Tensor, ...], pool: torch.Tensor, pool_dtype: torch.dtype | None,
                 parameters: tuple[torch.Tensor | None, ...] = ()) -> str | None:
    """None when the C++ kernels take these inputs (one dtype, float32 or bfloat16), this pool and these parameters
    (any float dtype: dt, A, D, dt_bias), else the reason."""
    if _state_kernels() is None:
        return "cbcore._C has no state-op kernels (reinstall cbcore to build them)"
    if any(t.device.type != "cpu" for t in (*tensors, pool, *(p for p in parameters if p is not None))):
        return "tensors are not on the CPU"
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _KERNEL_DTYPES:
        return f"input dtypes {sorted(map(str, dtypes))} (supported: all float32 or all bfloat16)"
    wanted = pool_dtype or next(iter(dtypes))
    if pool.dtype != wanted:
        return f"the state pool is {pool.dtype}, not {wanted}"
    if not pool.is_contiguous():
        return "the state pool is not contiguous"
    return None


def _use_kernel(op: str, mode: str | None, why_not: str | None) -> bool:
    """Whether `op` runs its C++ kernel under `mode` (None: CBCORE_KERNELS now): auto and cpu run it where it takes
    the inputs; cpu raises where it does not; every other mode runs the reference."""
    mode = mode or kernel_mode()
    if mode not in ("auto", "cpu"):
        return False
    if why_not is not None and mode == "cpu":
        raise RuntimeError(f"{KERNELS_ENV}=cpu but {op} cannot use its C++ kernel: {why_not}")
    return why_not is None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with a contiguous last dimension, which the kernels need (a split of a fused projection already has it)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         mode: str | None = None) -> torch.Tensor:
    """One new token per request through a causal depthwise conv1d with state: x `[batch, C]`, conv_state
    `[num_slots, C, K]` (updated in place), weight `[C, K]`; transformers' `causal_conv1d_update` for seq_len 1.
    Returns `[batch, C]` in x's dtype. `mode`: the kernel mode an engine resolved (None: read CBCORE_KERNELS now)."""
    parts = (x, weight) if bias is None else (x, weight, bias)
    if _use_kernel("causal_conv1d_update", mode, _why_not_cpu(parts, conv_state, None)):
        return _state_kernels().causal_conv1d_update(_rows(x), conv_state, slots, weight, bias, activation)
    return causal_conv1d_update_reference(x, conv_state, slots, weight, bias, activation)


def causal_conv1d_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                         has_initial_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str | None = None, mode: str | None = None) -> torch.Tensor:
    """Packed requests through a causal depthwise conv1d with state: x `[tokens, C]`, request i's rows
    `cu_seqlens[i]:cu_seqlens[i + 1]`, its left context its slot's state when has_initial_state[i] (else zeros), the
    last K inputs written back to the slot. Returns `[tokens, C]`. See the module docstring."""
    parts = (x, weight) if bias is None else (x, weight, bias)
    if _use_kernel("causal_conv1d_varlen", mode, _why_not_cpu(parts, conv_state, None)):
        return _state_kernels().causal_conv1d_varlen(_rows(x), cu_seqlens, conv_state, slots, has_initial_state,
                                                     weight, bias, activation)
    return causal_conv1d_varlen_reference(x, cu_seqlens, conv_state, slots, has_initial_state, weight, bias,
                                          activation)


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                               use_qk_l2norm: bool = False, scale: float | None = None,
                               mode: str | None = None) -> torch.Tensor:
    """One token per request of the gated delta rule, each from its slot's fp32 state (updated in place): q, k
    `[batch, Hk, Dk]`, v `[batch, H, Dv]`, g (log decay) and beta `[batch, H]`; transformers'
    `torch_recurrent_gated_delta_rule` with `initial_state`. scale None: Dk ** -0.5. Returns `[batch, H, Dv]` in q's
    dtype."""
    if _use_kernel("gated_delta_rule_recurrent", mode, _why_not_cpu((q, k, v), state, torch.float32)):
        return _state_kernels().gated_delta_rule_recurrent(_rows(q), _rows(k), _rows(v), g, beta, state, slots,
                                                           use_qk_l2norm, _scale(q, scale))
    return gated_delta_rule_recurrent_reference(q, k, v, g, beta, state, slots, use_qk_l2norm, scale)


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            cu_seqlens: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                            has_initial_state: torch.Tensor, use_qk_l2norm: bool = False, scale: float | None = None,
                            mode: str | None = None) -> torch.Tensor:
    """Packed requests of the gated delta rule: q, k `[tokens, Hk, Dk]`, v `[tokens, H, Dv]`, g and beta
    `[tokens, H]`; each request from its slot's state (zeros without has_initial_state), its final state written back.
    Returns `[tokens, H, Dv]` in q's dtype. The kernel runs token by token, the reference chunked (see the module
    docstring for how far they differ)."""
    if _use_kernel("gated_delta_rule_varlen", mode, _why_not_cpu((q, k, v), state, torch.float32)):
        return _state_kernels().gated_delta_rule_varlen(_rows(q), _rows(k), _rows(v), g, beta, cu_seqlens, state,
                                                        slots, has_initial_state, use_qk_l2norm, _scale(q, scale))
    return gated_delta_rule_varlen_reference(q, k, v, g, beta, cu_seqlens, state, slots, has_initial_state,
                                             use_qk_l2norm, scale)


def _maybe_rows(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _rows(t)


def mamba2_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        state: torch.Tensor, slots: torch.Tensor, D: torch.Tensor | None = None,
                        dt_bias: torch.Tensor | None = None, z: torch.Tensor | None = None,
                        dt_softplus: bool = False, mode: str | None = None) -> torch.Tensor:
    """One token per request of Mamba-2's selective state update, each from its slot's fp32 state (updated in place):
    x `[batch, H, P]`, dt `[batch, H]` (one per head), A `[H]`, B and C `[batch, G, N]`, D and dt_bias `[H]`, z
    `[batch, H, P]` (the gate); transformers' `mamba2_selective_state_update`. Returns `[batch, H, P]` in x's dtype."""
    inputs = (x, B, C) if z is None else (x, B, C, z)
    if _use_kernel("mamba2_state_update", mode, _why_not_cpu(inputs, state, torch.float32, (dt, A, D, dt_bias))):
        return _state_kernels().mamba2_state_update(_rows(x), dt, A, _rows(B), _rows(C), D, dt_bias, _maybe_rows(z),
                                                    dt_softplus, state, slots)
    return mamba2_state_update_reference(x, dt, A, B, C, state, slots, D, dt_bias, z, dt_softplus)


def mamba2_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       cu_seqlens: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                       has_initial_state: torch.Tensor, D: torch.Tensor | None = None,
                       dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                       dt_limit: tuple[float, float] = (0.0, float("inf")), mode: str | None = None) -> torch.Tensor:
    """Packed requests of Mamba-2's scan: x `[tokens, H, P]`, dt `[tokens, H]`, B and C `[tokens, G, N]`; each request
    from its slot's state (zeros without has_initial_state), its final state written back; dt clamped to dt_limit
    after its bias and softplus. Returns fp32 `[tokens, H, P]`, as transformers' `mamba2_chunk_scan`. The kernel runs
    token by token, the reference in chunks (see the module docstring for how far they differ)."""
    if _use_kernel("mamba2_scan_varlen", mode, _why_not_cpu((x, B, C), state, torch.float32, (dt, A, D, dt_bias))):
        return _state_kernels().mamba2_scan_varlen(_rows(x), dt, A, _rows(B), _rows(C), D, dt_bias, dt_softplus,
                                                   float(dt_limit[0]), float(dt_limit[1]), cu_seqlens, state, slots,
                                                   has_initial_state)
    return mamba2_scan_varlen_reference(x, dt, A, B, C, cu_seqlens, state, slots, has_initial_state, D, dt_bias,
                                        dt_softplus, dt_limit)


def mamba_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       state: torch.Tensor, slots: torch.Tensor, D: torch.Tensor | None = None,
                       dt_bias: torch.Tensor | None = None, z: torch.Tensor | None = None,
                       dt_softplus: bool = False, mode: str | None = None) -> torch.Tensor:
    """One token per request of Mamba-1's selective state update, each from its slot's fp32 state (updated in place):
    x, dt and z `[batch, Din]`, A `[Din, N]`, B and C `[batch, N]`, D and dt_bias `[Din]`; transformers'
    `mamba_selective_state_update`. Returns `[batch, Din]` in x's dtype."""
    inputs = (x, B, C) if z is None else (x, B, C, z)
    if _use_kernel("mamba_state_update", mode, _why_not_cpu(inputs, state, torch.float32, (dt, A, D, dt_bias))):
        return _state_kernels().mamba_state_update(_rows(x), dt, A, _rows(B), _rows(C), D, dt_bias, _maybe_rows(z),
                                                   dt_softplus, state, slots)
    return mamba_state_update_reference(x, dt, A, B, C, state, slots, D, dt_bias, z, dt_softplus)


def mamba_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      cu_seqlens: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                      has_initial_state: torch.Tensor, D: torch.Tensor | None = None,
                      dt_bias: torch.Tensor | None = None, z: torch.Tensor | None = None, dt_softplus: bool = False,
                      mode: str | None = None) -> torch.Tensor:
    """Packed requests of Mamba-1's selective scan: x, dt and z `[tokens, Din]`, B and C `[tokens, N]`; each request
    from its slot's state (zeros without has_initial_state), its final state written back. Returns `[tokens, Din]` in
    x's dtype promoted with D's, as transformers' `mamba_selective_scan` (the module docstring names the references)."""
    inputs = (x, B, C) if z is None else (x, B, C, z)
    if _use_kernel("mamba_scan_varlen", mode, _why_not_cpu(inputs, state, torch.float32, (dt, A, D, dt_bias))):
        return _state_kernels().mamba_scan_varlen(_rows(x), dt, A, _rows(B), _rows(C), D, dt_bias, _maybe_rows(z),
                                                  dt_softplus, cu_seqlens, state, slots, has_initial_state)
    return mamba_scan_varlen_reference(x, dt, A, B, C, cu_seqlens, state, slots, has_initial_state, D, dt_bias, z,
                                       dt_softplus)
