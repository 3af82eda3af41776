"""transformers' stateful op functions run on cbcore's kernels inside cbcore's steps (cbcore/ops/state_ops.py).

transformers routes the ops of its gated delta-net layers (Qwen3.5, Qwen3-Next, OLMo-hybrid) and of every short
causal convolution (Mamba's, Mamba-2's, LFM2's, the delta-nets') through module-level functions of each modeling file,
the seams its own hub kernels replace: `causal_conv1d_update`, `causal_conv1d_fn`, `torch_recurrent_gated_delta_rule`,
`torch_chunk_gated_delta_rule`. While a model with such layers is bound, those names in its modeling files point to
dispatchers: inside a cbcore step (the stateful layer runs on one request, or on the batched decode rows, with a
`SlotStates` cache: cbcore/state_layers.py) they call cbcore's C++ kernels; anywhere else, and for inputs a kernel
does not take, the function transformers had. Outside steps the model computes exactly what it did.

A function is bound only where its source is the same as Qwen3-Next's function of that name in the transformers that
is imported: the semantics the kernels implement and are tested against (tests/test_state_ops.py). A modeling file
with a function of its own keeps it.

Differences from transformers' torch code: the delta rule's prompt form runs token by token (the recurrent form)
rather than in 64-token chunks, the same mathematics summed in another order (~1e-6 of the output's scale in fp32);
the sweep and the hybrid tests hold cbcore's tokens and logprobs to `model.generate`'s. A state handed to the delta
rule from a slot (`SlotStates` marks it) is advanced in place and returned, where transformers' function returns a new
tensor: the layer stores the returned state into that same slot, so the copy in and the copy back would be two passes
over the state for nothing.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from collections.abc import Callable

import torch

from .attention import current_step
from .ops import state_ops

# The reference modeling file: the function of each name there is what the kernels implement.
_REFERENCE_MODULE = "transformers.models.qwen3_next.modeling_qwen3_next"
_NAMES = ("causal_conv1d_update", "causal_conv1d_fn", "torch_recurrent_gated_delta_rule",
          "torch_chunk_gated_delta_rule")

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


def _in_state_step() -> bool:
    return getattr(current_step(), "states", None) is not None


def bind(module_names: set[str]) -> set[str]:
    """Point the seam functions of these modeling files at the dispatchers (counted per file: several models may be
    bound at once). Returns the files bound, for `unbind`."""
    reference = importlib.import_module(_REFERENCE_MODULE)
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
            for function_name in _NAMES:
                original = getattr(module, function_name, None)
                if original is None or _source(original) != _source(getattr(reference, function_name)):
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


_KERNELS = {
    "causal_conv1d_update": _conv_update,
    "causal_conv1d_fn": _conv_fn,
    "torch_recurrent_gated_delta_rule": _recurrent_rule,
    "torch_chunk_gated_delta_rule": _chunk_rule,
}
