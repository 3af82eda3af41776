"""transformers' stateful op functions run on cbcore's kernels inside cbcore's steps (cbcore/ops/state_ops.py).

transformers routes the ops of its gated delta-net layers (Qwen3.5, Qwen3-Next, OLMo-hybrid), of its Mamba-1 and
Mamba-2 mixers (Mamba, FalconMamba, Jamba, Zamba; Mamba-2, Bamba, Falcon-H1, NemotronH, GraniteMoeHybrid, Zamba2)
and of every short causal convolution through module-level functions of each modeling file, the seams its own hub
kernels replace:
`causal_conv1d_update`, `causal_conv1d_fn`, `torch_recurrent_gated_delta_rule`, `torch_chunk_gated_delta_rule`,
`mamba2_selective_state_update`, `mamba2_chunk_scan`, `mamba_selective_state_update`, `mamba_selective_scan`. While a
model with such layers is bound, those names in its modeling files point to dispatchers: inside a cbcore step (the
stateful layer runs on one request, or on the batched decode rows, with a `SlotStates` cache:
cbcore/state_layers.py) they call cbcore's C++ kernels; anywhere else, and for inputs a kernel does not take, the
function transformers had. Outside steps the model computes exactly what it did.

A function is bound only where its source is the same as its reference's in the transformers that is imported (the
function of that name in Qwen3-Next's modeling file for the conv and the delta rule, in Mamba-2's for the Mamba-2 ops,
in Mamba's for the Mamba-1 ops): the semantics the kernels implement and are tested against (tests/test_state_ops.py).
A modeling file with a function of its own keeps it.

Differences from transformers' torch code: the delta rule's and Mamba-2's prompt forms run token by token (the
recurrent form) rather than in chunks, the same mathematics summed in another order (~1e-6 of the output's scale in
fp32); the sweep and the hybrid tests hold cbcore's tokens and logprobs to `model.generate`'s. A state handed to the
delta rule or to Mamba-2's scan from a slot (`SlotStates` marks it) is advanced in place and returned, where
transformers' function returns a new tensor: the layer stores the returned state into that same slot, so the copy in
and the copy back would be two passes over the state for nothing. Mamba-1's scan starts from zeros, as transformers'
(a continuation chunk of a Mamba-1 layer runs one token at a time, through the update: cbcore/state_layers.py).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
from collections.abc import Callable

import torch

from .step_context import current_step
from .ops import state_ops

# Each seam's reference modeling file: the function of that name there is what its kernel implements.
_QWEN3_NEXT = "transformers.models.qwen3_next.modeling_qwen3_next"
_MAMBA2 = "transformers.models.mamba2.modeling_mamba2"
_MAMBA = "transformers.models.mamba.modeling_mamba"
_REFERENCES = {
    "causal_conv1d_update": _QWEN3_NEXT,
    "causal_conv1d_fn": _QWEN3_NEXT,
    "torch_recurrent_gated_delta_rule": _QWEN3_NEXT,
    "torch_chunk_gated_delta_rule": _QWEN3_NEXT,
    "mamba2_selective_state_update": _MAMBA2,
    "mamba2_chunk_scan": _MAMBA2,
    "mamba_selective_state_update": _MAMBA,
    "mamba_selective_scan": _MAMBA,
}

_lock = threading.Lock()
# modeling module name -> (how many bound models use it, {name: the function transformers had})
_bound: dict[str, tuple[int, dict[str, object]]] = {}


def _source(function) -> str | None:
    """The source of a seam function: unwrapped from decorators, or the `forward` of transformers 5.25's function
    modules (`kernels`' wrappers)."""
    target = inspect.unwrap(function)
    if isinstance(target, torch.nn.Module):
        target = type(target).forward
    try:
        return inspect.getsource(target)
    except (OSError, TypeError):
        return None


@functools.cache
def _reference_source(name: str) -> str | None:
    """The source of seam `name`'s reference function (None where it has none: then nothing equals it)."""
    reference = getattr(importlib.import_module(_REFERENCES[name]), name, None)
    return None if reference is None else _source(reference)


def _in_state_step() -> bool:
    return getattr(current_step(), "states", None) is not None


def bind(module_names: set[str]) -> set[str]:
    """Point the seam functions of these modeling files at the dispatchers (counted per file: several models may be
    bound at once). Returns the files bound, for `unbind`."""
    bound = set()
    with _lock:
        for name in module_names:
            module = sys.modules.get(name)
            if module is None:
                continue
            if name in _bound:
                count, originals = _bound[name]
                _bound[name] = (count + 1, originals)
                bound.add(name)
                continue
            originals = {}
            for function_name in _REFERENCES:
                original = getattr(module, function_name, None)
                reference = _reference_source(function_name)
                if original is None or reference is None or _source(original) != reference:
                    continue
                originals[function_name] = original
                setattr(module, function_name, _dispatcher(original, _KERNELS[function_name]))
            if originals:
                _bound[name] = (1, originals)
                bound.add(name)
    return bound


def unbind(module_names: set[str]) -> None:
    """Give the last model bound to a modeling file's seams its functions back."""
    with _lock:
        for name in module_names:
            count, originals = _bound[name]
            if count > 1:
                _bound[name] = (count - 1, originals)
                continue
            module = sys.modules[name]
            for function_name, original in originals.items():
                setattr(module, function_name, original)
            del _bound[name]


def _dispatcher(original, kernel: Callable) -> Callable:
    def dispatch(*args, **kwargs):
        if _in_state_step():
            result = kernel(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return original(*args, **kwargs)

    dispatch.__wrapped__ = original
    dispatch.cbcore_seam = True
    return dispatch


def _arange(count: int, device: torch.device) -> torch.Tensor:
    return torch.arange(count, dtype=torch.long, device=device)


def _conv_update(hidden_states, conv_state, weight, bias=None, activation=None, **kwargs):
    """`causal_conv1d_update`: hidden_states `[B, C, 1]`, conv_state `[B, C, K]` updated in place -> `[B, C, 1]`."""
    if hidden_states.shape[-1] != 1 or not conv_state.is_contiguous():
        return NotImplemented
    batch = hidden_states.shape[0]
    out = state_ops.causal_conv1d_update(hidden_states[..., 0], conv_state, _arange(batch, conv_state.device), weight,
                                         bias, activation)
    return out.unsqueeze(-1)


def _conv_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """`causal_conv1d_fn`: hidden_states `[B, C, L]` (any previous inputs already prepended), zeros to the left."""
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        return NotImplemented
    batch, channels, length = hidden_states.shape
    device = hidden_states.device
    rows = hidden_states.transpose(1, 2).reshape(batch * length, channels)
    scratch = torch.zeros((batch, channels, weight.shape[-1]), dtype=hidden_states.dtype, device=device)
    out = state_ops.causal_conv1d_varlen(
        rows, torch.arange(0, (batch + 1) * length, length, dtype=torch.long, device=device), scratch,
        _arange(batch, device), torch.zeros(batch, dtype=torch.bool, device=device), weight, bias, activation)
    return out.view(batch, length, channels).transpose(1, 2)


def _state_to_advance(initial_state: torch.Tensor) -> torch.Tensor:
    """The fp32 state the kernel advances: a slot's rows themselves (the layer stores the result back into them), else
    a copy, as transformers leaves `initial_state` as it was."""
    if (getattr(initial_state, "cbcore_slot_state", False) and initial_state.dtype == torch.float32
            and initial_state.is_contiguous()):
        return initial_state
    return initial_state.to(torch.float32).contiguous().clone()


def _recurrent_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):
    """`torch_recurrent_gated_delta_rule` for one token per row (q, k `[B, 1, Hk, Dk]`, v `[B, 1, H, Dv]`)."""
    if query.shape[1] != 1 or initial_state is None or kwargs.get("cu_seqlens") is not None:
        return NotImplemented
    state = _state_to_advance(initial_state)
    batch = query.shape[0]
    out = state_ops.gated_delta_rule_recurrent(query[:, 0], key[:, 0], value[:, 0], g[:, 0], beta[:, 0], state,
                                               _arange(batch, state.device), use_qk_l2norm_in_kernel)
    return out.unsqueeze(1), (state if output_final_state else None)


def _chunk_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
    """`torch_chunk_gated_delta_rule` over each row's tokens (q, k `[B, T, Hk, Dk]`, v `[B, T, H, Dv]`), run by the
    varlen kernel token by token."""
    if kwargs.get("cu_seqlens") is not None:
        return NotImplemented
    batch, length, heads, v_dim = value.shape
    k_dim = key.shape[-1]
    device = value.device
    if initial_state is None:
        state = torch.zeros((batch, heads, k_dim, v_dim), dtype=torch.float32, device=device)
    else:
        state = _state_to_advance(initial_state)
    flat = [t.reshape(batch * length, *t.shape[2:]) for t in (query, key, value, g, beta)]
    out = state_ops.gated_delta_rule_varlen(
        *flat, torch.arange(0, (batch + 1) * length, length, dtype=torch.long, device=device), state,
        _arange(batch, device), torch.full((batch,), initial_state is not None, dtype=torch.bool, device=device),
        use_qk_l2norm_in_kernel)
    return out.view(batch, length, heads, v_dim), (state if output_final_state else None)


def _is_pool(state: torch.Tensor, *shape: int) -> bool:
    """Whether the kernels can advance `state` in place: a contiguous fp32 `[batch, *shape]`."""
    return state.dtype == torch.float32 and state.is_contiguous() and tuple(state.shape[1:]) == shape


def _shaped(t: torch.Tensor | None, *shape: int) -> bool:
    """Whether an optional argument is absent or of this shape."""
    return t is None or tuple(t.shape) == shape


def _per_head(t: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """t as `[heads]` when it holds one value per head: `[heads]`, or `[heads, ...]` expanded over the other dims (a
    zero stride), as Mamba-2's mixers pass A, D and dt_bias to the update. None otherwise."""
    if t is None or t.dim() == 0 or t.shape[0] != heads:
        return None
    if any(size > 1 and stride != 0 for size, stride in zip(t.shape[1:], t.stride()[1:])):
        return None
    return t[(slice(None),) + (0,) * (t.dim() - 1)]


def _mamba2_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs):
    """`mamba2_selective_state_update`: state `[B, H, P, N]` updated in place, x and z `[B, H, P]`, B and C
    `[B, G, N]`, dt `[B, H, P]`, A `[H, P, N]`, D and dt_bias `[H, P]`, these four expanded from one value per head
    (as Mamba-2's mixers pass them; the kernel's form) -> `[B, H, P]`."""
    if hidden_states.dim() != 3 or B.dim() != 3 or dt.dim() != 3:
        return NotImplemented
    batch, heads, head_dim = hidden_states.shape
    groups, state_size = B.shape[1:]
    if (groups == 0 or heads % groups or not _shaped(C, batch, groups, state_size)
            or not _shaped(z, batch, heads, head_dim) or not _is_pool(state, heads, head_dim, state_size)
            or tuple(dt.shape) != (batch, heads, head_dim) or (head_dim > 1 and dt.stride(2) != 0)):
        return NotImplemented
    parameters = [_per_head(t, heads) for t in (A, D, dt_bias)]
    if any(reduced is None and given is not None for reduced, given in zip(parameters, (A, D, dt_bias))):
        return NotImplemented
    A_heads, D_heads, bias_heads = parameters
    return state_ops.mamba2_state_update(hidden_states, dt[:, :, 0], A_heads, B, C, state,
                                         _arange(batch, state.device), D_heads, bias_heads, z, dt_softplus)


def _mamba2_scan(hidden_states, dt, A, B, C, chunk_size=None, D=None, dt_bias=None, initial_states=None,
                 dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """`mamba2_chunk_scan` over each row's tokens (x `[B, T, H, P]`, dt `[B, T, H]`, B and C `[B, T, G, N]`, A, D and
    dt_bias `[H]`), run by the varlen kernel token by token; fp32 output, as transformers'. transformers' function
    ignores a `z`; one given goes to it."""
    if any(kwargs.get(name) is not None for name in ("z", "seq_idx", "cu_seqlens")):
        return NotImplemented
    if hidden_states.dim() != 4 or B.dim() != 4:
        return NotImplemented
    batch, length, heads, head_dim = hidden_states.shape
    groups, state_size = B.shape[2:]
    if (groups == 0 or heads % groups or tuple(B.shape[:2]) != (batch, length)
            or not _shaped(C, batch, length, groups, state_size) or not _shaped(dt, batch, length, heads)
            or not all(_shaped(t, heads) for t in (A, D, dt_bias))):
        return NotImplemented
    device = hidden_states.device
    if initial_states is None:
        state = torch.empty((batch, heads, head_dim, state_size), dtype=torch.float32, device=device)
    elif tuple(initial_states.shape) != (batch, heads, head_dim, state_size):
        return NotImplemented
    elif return_final_states:
        state = _state_to_advance(initial_states)
    else:  # transformers leaves initial_states as it was, and no one would see the advanced state
        state = initial_states.to(torch.float32).contiguous().clone()
    tokens = batch * length
    out = state_ops.mamba2_scan_varlen(
        hidden_states.reshape(tokens, heads, head_dim), dt.reshape(tokens, heads), A,
        B.reshape(tokens, groups, state_size), C.reshape(tokens, groups, state_size),
        torch.arange(0, (batch + 1) * length, length, dtype=torch.long, device=device), state,
        _arange(batch, device), torch.full((batch,), initial_states is not None, dtype=torch.bool, device=device),
        D, dt_bias, dt_softplus, dt_limit)
    out = out.view(batch, length, heads, head_dim)
    return (out, state) if return_final_states else out


def _mamba_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs):
    """`mamba_selective_state_update`: state `[B, Din, N]` updated in place, x, dt and z `[B, Din]`, A `[Din, N]`, B
    and C `[B, N]`, D and dt_bias `[Din]` -> `[B, Din]`."""
    if hidden_states.dim() != 2 or A.dim() != 2:
        return NotImplemented
    batch, channels = hidden_states.shape
    state_size = A.shape[1]
    if (not _shaped(A, channels, state_size) or not _shaped(dt, batch, channels) or not _shaped(z, batch, channels)
            or not _shaped(B, batch, state_size) or not _shaped(C, batch, state_size)
            or not _shaped(D, channels) or not _shaped(dt_bias, channels) or not _is_pool(state, channels, state_size)):
        return NotImplemented
    return state_ops.mamba_state_update(hidden_states, dt, A, B, C, state, _arange(batch, state.device), D, dt_bias,
                                        z, dt_softplus)


def _mamba_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                return_last_state=False, **kwargs):
    """`mamba_selective_scan` over each row's tokens from zeros, as transformers' (x, dt and z `[B, Din, T]`, B and C
    `[B, N, T]`, A `[Din, N]`, D and delta_bias `[Din]`), by the varlen kernel. Its `use_mambapy` and
    `use_associative_scan` paths compute the same scan in another order."""
    if hidden_states.dim() != 3 or A.dim() != 2:
        return NotImplemented
    batch, channels, length = hidden_states.shape
    state_size = A.shape[1]
    if (not _shaped(A, channels, state_size) or not _shaped(dt, batch, channels, length)
            or not _shaped(z, batch, channels, length) or not _shaped(B, batch, state_size, length)
            or not _shaped(C, batch, state_size, length) or not _shaped(D, channels)
            or not _shaped(delta_bias, channels)):
        return NotImplemented
    device = hidden_states.device
    tokens = batch * length

    def rows(t: torch.Tensor, width: int) -> torch.Tensor:  # [B, width, T] -> the kernel's [B * T, width]
        return t.transpose(1, 2).reshape(tokens, width)

    state = torch.empty((batch, channels, state_size), dtype=torch.float32, device=device)
    out = state_ops.mamba_scan_varlen(
        rows(hidden_states, channels), rows(dt, channels), A, rows(B, state_size), rows(C, state_size),
        torch.arange(0, (batch + 1) * length, length, dtype=torch.long, device=device), state,
        _arange(batch, device), torch.zeros(batch, dtype=torch.bool, device=device), D, delta_bias,
        rows(z, channels) if z is not None else None, delta_softplus)
    out = out.view(batch, length, channels).transpose(1, 2)
    return (out, state) if return_last_state else out


_KERNELS = {
    "causal_conv1d_update": _conv_update,
    "causal_conv1d_fn": _conv_fn,
    "torch_recurrent_gated_delta_rule": _recurrent_rule,
    "torch_chunk_gated_delta_rule": _chunk_rule,
    "mamba2_selective_state_update": _mamba2_update,
    "mamba2_chunk_scan": _mamba2_scan,
    "mamba_selective_state_update": _mamba_update,
    "mamba_selective_scan": _mamba_scan,
}
