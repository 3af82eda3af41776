"""The stateful layers' ops in plain torch (cbcore/ops/state_ops.py says what each computes): per request, transformers'
own functions from each request's slot of a state pool, the references the C++ kernels are tested against and what
runs where no kernel applies; with the argument checks both share."""

from __future__ import annotations

import functools
import inspect
from types import SimpleNamespace

import torch

_ACTIVATIONS = (None, "silu", "swish")  # transformers' ACT2FN maps both names to SiLU


# ---- plain-torch references ------------------------------------------------------------------------------------------


@functools.cache
def _transformers() -> SimpleNamespace:
    """transformers' torch functions, unwrapped from the hub-kernel decorators so that the torch code runs even where
    the fla or causal-conv1d packages would replace it (and without its "falling back" warning)."""
    from transformers.models.mamba import modeling_mamba as mamba
    from transformers.models.mamba2 import modeling_mamba2 as mamba2
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    return SimpleNamespace(
        conv_update=inspect.unwrap(qwen3_next.causal_conv1d_update),
        conv_fn=inspect.unwrap(qwen3_next.causal_conv1d_fn),
        chunk_rule=inspect.unwrap(qwen3_next.torch_chunk_gated_delta_rule),
        recurrent_rule=inspect.unwrap(qwen3_next.torch_recurrent_gated_delta_rule),
        l2norm=qwen3_next.l2norm,
        mamba2_update=inspect.unwrap(mamba2.mamba2_selective_state_update),
        mamba2_scan=inspect.unwrap(mamba2.mamba2_chunk_scan),
        mamba_update=inspect.unwrap(mamba.mamba_selective_state_update),
        mamba_scan=inspect.unwrap(mamba.mamba_selective_scan),
    )


def causal_conv1d_update_reference(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                                   weight: torch.Tensor, bias: torch.Tensor | None = None,
                                   activation: str | None = None) -> torch.Tensor:
    """transformers' `causal_conv1d_update` per request, on a view of its slot (which it updates in place)."""
    _check_activation(activation)
    ids = _check_slots(slots, x.shape[0], conv_state.shape[0])
    out = torch.empty_like(x)
    for i, slot in enumerate(ids):
        out[i] = _transformers().conv_update(x[i, :, None][None], conv_state[slot:slot + 1], weight, bias,
                                             activation)[0, :, 0]
    return out


def causal_conv1d_varlen_reference(x: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                                   slots: torch.Tensor, has_initial_state: torch.Tensor, weight: torch.Tensor,
                                   bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """Per request: the context (the slot's state, or nothing: a first chunk shorter than K is left-padded with zeros,
    as transformers' `update_conv_state`) followed by the tokens, through transformers' `causal_conv1d_fn`; the last K
    inputs written back to the slot."""
    _check_activation(activation)
    requests = _requests(cu_seqlens, x.shape[0], slots, conv_state.shape[0], has_initial_state)
    width = conv_state.shape[-1]
    out = torch.empty_like(x)
    for slot, begin, end, initial in requests:
        tokens = x[begin:end].t()[None]  # [1, C, L]
        if initial:
            full = torch.cat([conv_state[slot:slot + 1], tokens.to(conv_state.dtype)], dim=-1)
        else:
            full = torch.nn.functional.pad(tokens, (max(width - tokens.shape[-1], 0), 0))
        conv_state[slot].copy_(full[0, :, -width:])
        if end > begin:
            out[begin:end] = _transformers().conv_fn(full, weight, bias, activation)[0, :, -(end - begin):].t()
    return out


def _rule_inputs(q: torch.Tensor, k: torch.Tensor, use_qk_l2norm: bool, scale: float | None
                 ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """q, k and the l2norm flag to hand transformers' functions, whose scale is fixed at Dk ** -0.5: another scale is
    folded into q after normalising it here (in fp32, as they do)."""
    if scale is None:
        return q, k, use_qk_l2norm
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _transformers().l2norm(q, dim=-1, eps=1e-6), _transformers().l2norm(k, dim=-1, eps=1e-6)
    return q * (scale * q.shape[-1] ** 0.5), k, False


def gated_delta_rule_recurrent_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                         beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                                         use_qk_l2norm: bool = False, scale: float | None = None) -> torch.Tensor:
    """transformers' `torch_recurrent_gated_delta_rule` per request (one token), from its slot's state, the final state
    written back."""
    ids = _check_slots(slots, q.shape[0], state.shape[0])
    out = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    q_in, k_in, l2norm = _rule_inputs(q, k, use_qk_l2norm, scale)
    for i, slot in enumerate(ids):
        o, final = _transformers().recurrent_rule(
            q_in[i:i + 1, None], k_in[i:i + 1, None], v[i:i + 1, None], g[i:i + 1, None], beta[i:i + 1, None],
            initial_state=state[slot:slot + 1], output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        out[i] = o[0, 0]
        state[slot].copy_(final[0])
    return out


def gated_delta_rule_varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor,
                                      slots: torch.Tensor, has_initial_state: torch.Tensor,
                                      use_qk_l2norm: bool = False, scale: float | None = None) -> torch.Tensor:
    """transformers' `torch_chunk_gated_delta_rule` per request, from its slot's state (or zeros without
    has_initial_state), the final state written back."""
    requests = _requests(cu_seqlens, q.shape[0], slots, state.shape[0], has_initial_state)
    out = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    q_in, k_in, l2norm = _rule_inputs(q, k, use_qk_l2norm, scale)
    for slot, begin, end, initial in requests:
        if begin == end:
            if not initial:
                state[slot].zero_()
            continue
        o, final = _transformers().chunk_rule(
            q_in[None, begin:end], k_in[None, begin:end], v[None, begin:end], g[None, begin:end],
            beta[None, begin:end], initial_state=state[slot:slot + 1] if initial else None,
            output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        out[begin:end] = o[0]
        state[slot].copy_(final[0])
    return out


def mamba2_state_update_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                  C: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                                  D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                                  z: torch.Tensor | None = None, dt_softplus: bool = False) -> torch.Tensor:
    """transformers' `mamba2_selective_state_update` per request, on a view of its slot (which it updates in place),
    with dt, A, D and dt_bias expanded over the head dim as Mamba-2's mixers pass them."""
    ids = _check_slots(slots, x.shape[0], state.shape[0])
    per_row = tuple(x.shape[1:])  # (H, P)
    A_rows = A[:, None, None].expand(*per_row, B.shape[-1])
    D_rows = D[:, None].expand(per_row) if D is not None else None
    bias_rows = dt_bias[:, None].expand(per_row) if dt_bias is not None else None
    out = torch.empty_like(x)
    for i, slot in enumerate(ids):
        out[i] = _transformers().mamba2_update(
            state[slot:slot + 1], x[i:i + 1], dt[i:i + 1, :, None].expand(1, *per_row), A_rows, B[i:i + 1],
            C[i:i + 1], D_rows, dt_bias=bias_rows, dt_softplus=dt_softplus, z=z[i:i + 1] if z is not None else None)[0]
    return out


def mamba2_scan_varlen_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                 C: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                                 has_initial_state: torch.Tensor, D: torch.Tensor | None = None,
                                 dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                                 dt_limit: tuple[float, float] = (0.0, float("inf")),
                                 chunk_size: int = 256) -> torch.Tensor:
    """transformers' `mamba2_chunk_scan` per request, from its slot's state (or zeros without has_initial_state), the
    final state written back. chunk_size: the reference's chunk length (the result depends on it by rounding only)."""
    requests = _requests(cu_seqlens, x.shape[0], slots, state.shape[0], has_initial_state)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for slot, begin, end, initial in requests:
        if begin == end:
            if not initial:
                state[slot].zero_()
            continue
        o, final = _transformers().mamba2_scan(
            x[None, begin:end], dt[None, begin:end], A, B[None, begin:end], C[None, begin:end], chunk_size, D=D,
            dt_bias=dt_bias, initial_states=state[slot:slot + 1] if initial else None, dt_softplus=dt_softplus,
            dt_limit=dt_limit, return_final_states=True)
        out[begin:end] = o[0]
        state[slot].copy_(final[0])
    return out


def mamba_state_update_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                 C: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                                 D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                                 z: torch.Tensor | None = None, dt_softplus: bool = False) -> torch.Tensor:
    """transformers' `mamba_selective_state_update` per request, on a view of its slot (which it updates in place)."""
    ids = _check_slots(slots, x.shape[0], state.shape[0])
    out = torch.empty_like(x)
    for i, slot in enumerate(ids):
        out[i] = _transformers().mamba_update(
            state[slot:slot + 1], x[i:i + 1], dt[i:i + 1], A, B[i:i + 1], C[i:i + 1], D, dt_bias=dt_bias,
            dt_softplus=dt_softplus, z=z[i:i + 1] if z is not None else None)[0]
    return out


def mamba_scan_varlen_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                C: torch.Tensor, cu_seqlens: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                                has_initial_state: torch.Tensor, D: torch.Tensor | None = None,
                                dt_bias: torch.Tensor | None = None, z: torch.Tensor | None = None,
                                dt_softplus: bool = False) -> torch.Tensor:
    """Per request: without has_initial_state, transformers' `mamba_selective_scan` (which starts from zeros), its
    last state written to the slot; with it, transformers' `mamba_selective_state_update` token by token from the
    slot (the scan takes no state). Output in x's dtype promoted with D's, as `mamba_selective_scan` returns it."""
    requests = _requests(cu_seqlens, x.shape[0], slots, state.shape[0], has_initial_state)
    out_dtype = torch.promote_types(x.dtype, D.dtype) if D is not None else x.dtype
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    for slot, begin, end, initial in requests:
        if initial:
            for t in range(begin, end):
                out[t] = _transformers().mamba_update(
                    state[slot:slot + 1], x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, dt_bias=dt_bias,
                    dt_softplus=dt_softplus, z=z[t:t + 1] if z is not None else None)[0]
            continue
        if begin == end:
            state[slot].zero_()
            continue

        def columns(t: torch.Tensor) -> torch.Tensor:  # rows [tokens, width] -> transformers' [1, width, tokens]
            return t[begin:end].t()[None]

        o, last = _transformers().mamba_scan(
            columns(x), columns(dt), A, columns(B), columns(C), D=D, z=columns(z) if z is not None else None,
            delta_bias=dt_bias, delta_softplus=dt_softplus, return_last_state=True)
        out[begin:end] = o[0].t()
        state[slot].copy_(last[0])
    return out


# ---- argument checks (the references'; the kernels check the same in C++) --------------------------------------------


def _requests(cu_seqlens: torch.Tensor, num_tokens: int, slots: torch.Tensor, num_slots: int,
              has_initial_state: torch.Tensor) -> list[tuple[int, int, int, bool]]:
    """A varlen call's requests, checked: (slot, first row, end row, whether it starts from its slot's state)."""
    bounds = _check_cu_seqlens(cu_seqlens, num_tokens)
    ids = _check_slots(slots, len(bounds) - 1, num_slots)
    initial = _check_has_initial_state(has_initial_state, len(ids))
    return [(slot, bounds[i], bounds[i + 1], initial[i]) for i, slot in enumerate(ids)]


def _check_slots(slots: torch.Tensor, count: int, num_slots: int) -> list[int]:
    if slots.dim() != 1 or slots.dtype != torch.int64 or slots.shape[0] != count:
        raise ValueError(f"slots must be int64 [{count}] (one per request), got {slots.dtype} {tuple(slots.shape)}")
    ids = slots.tolist()
    for i, slot in enumerate(ids):
        if not 0 <= slot < num_slots:
            raise ValueError(f"slots[{i}] is {slot}, outside the state pool's [0, {num_slots})")
    if len(set(ids)) != len(ids):
        twice = next(s for s in ids if ids.count(s) > 1)
        raise ValueError(f"slots lists slot {twice} twice; each request needs a slot of its own")
    return ids


def _check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> list[int]:
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64 [requests + 1], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != num_tokens or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to {num_tokens} (the packed tokens), got {bounds}")
    return bounds


def _check_has_initial_state(has_initial_state: torch.Tensor, count: int) -> list[bool]:
    if has_initial_state.dtype != torch.bool or tuple(has_initial_state.shape) != (count,):
        raise ValueError(f"has_initial_state must be bool [{count}], got {has_initial_state.dtype} "
                         f"{tuple(has_initial_state.shape)}")
    return has_initial_state.tolist()


def _check_activation(activation: str | None) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
