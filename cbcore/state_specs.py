"""Which layers of a model keep a per-request state through transformers' cache API (a Mamba or delta-rule mixer, a
short convolution, linear attention), and the state tensors each keeps per request (`StateSpec`), read off the cache
of the model's own forward. The pool that holds them and the step that runs them: cbcore/state_layers.py."""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import dataclass

import torch

# The Cache API calls that mark a module as a stateful layer bound through the cache, found in the source of its
# class (transformers 5.24's mixers call them from `forward` or the torch path it dispatches to) or of a function of
# its modeling file that the class calls with the cache (5.25's `causal_conv1d_forward`, `mamba_scan_forward`).
_STATE_API_CALLS = ("get_conv_state(", "update_conv_state(", "get_recurrent_state(", "update_recurrent_state(")

_source_cache: dict[type, bool] = {}
_state_functions_cache: dict[str, frozenset[str]] = {}


def _state_functions(module_name: str) -> frozenset[str]:
    """Names of the top-level functions of a modeling file that call the cache's state API."""
    if module_name not in _state_functions_cache:
        names: set[str] = set()
        try:
            source = inspect.getsource(sys.modules[module_name])
            for node in ast.parse(source).body:
                if isinstance(node, ast.FunctionDef):
                    body = ast.get_source_segment(source, node) or ""
                    if any(call in body for call in _STATE_API_CALLS):
                        names.add(node.name)
        except (OSError, TypeError, KeyError, SyntaxError):
            pass
        _state_functions_cache[module_name] = frozenset(names)
    return _state_functions_cache[module_name]


def is_state_layer(module: torch.nn.Module) -> bool:
    """Whether `module`'s class keeps a per-request state through transformers' cache API (and has the `layer_idx`
    that names its state in the cache)."""
    cls = type(module)
    if cls not in _source_cache:
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            source = ""
        calls = _STATE_API_CALLS + tuple(f"{name}(" for name in _state_functions(cls.__module__))
        _source_cache[cls] = any(call in source for call in calls)
    return _source_cache[cls] and isinstance(getattr(module, "layer_idx", None), int)


def state_layer_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every stateful layer of `model`, outermost only (a mixer, not the layers inside it)."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        if is_state_layer(module):
            found.append((name, module))
    return found


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of one layer, per request: a conv state (the last inputs of a causal convolution) or a
    recurrent state (an SSM's, a delta rule's, linear attention's), as transformers' cache holds it."""

    layer_idx: int
    kind: str  # "conv" or "recurrent"
    index: int  # transformers' `state_idx`: a layer may keep several states of a kind
    shape: tuple[int, ...]  # without the batch dim
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one request's copy."""
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


def probe_state_specs(model: torch.nn.Module) -> list[StateSpec]:
    """The state tensors `model`'s stateful layers keep per request, read off the cache of the model's own forward
    (batch 1) for two prompt lengths. ValueError when a state's shape depends on the prompt's length (a conv state
    sized by the first prefill): a fixed slot could not hold it."""
    seen: dict[tuple[int, str, int], StateSpec] = {}
    for length in (2, 5):
        specs = _probe_once(model, length)
        for spec in specs:
            key = (spec.layer_idx, spec.kind, spec.index)
            if key in seen and seen[key] != spec:
                raise ValueError(
                    f"layer {spec.layer_idx}'s {spec.kind} state has shape {seen[key].shape} after a 2-token prompt "
                    f"but {spec.shape} after a 5-token one; cbcore's state slots need a fixed shape"
                )
            seen[key] = spec
    return sorted(seen.values(), key=lambda s: (s.layer_idx, s.kind, s.index))


def _probe_once(model: torch.nn.Module, length: int) -> list[StateSpec]:
    device = model.device
    input_ids = torch.ones((1, length), dtype=torch.long, device=device)
    with torch.inference_mode():
        output = model(input_ids=input_ids, use_cache=True)
    cache = getattr(output, "past_key_values", None)
    specs: list[StateSpec] = []
    for layer_idx, layer in enumerate(getattr(cache, "layers", None) or []):
        for kind in ("conv", "recurrent"):
            states = getattr(layer, f"{kind}_states", None)
            if not isinstance(states, dict):
                continue
            for index, tensor in states.items():
                if isinstance(tensor, torch.Tensor):
                    if tensor.shape[0] != 1:
                        raise ValueError(f"layer {layer_idx}'s {kind} state has batch dim {tensor.shape[0]}, not 1")
                    specs.append(StateSpec(layer_idx, kind, index, tuple(tensor.shape[1:]), tensor.dtype))
    return specs
