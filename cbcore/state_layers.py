"""Layers with a per-request state (Mamba, Mamba-2, gated delta rule, short convolutions, linear attention) inside
cbcore's packed steps: the worker's half of the state cache (docs/design.md, "Per-request state").

transformers' stateful layers read and write their state through the cache's linear-attention API
(`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`, `has_previous_state`: the
seam every hybrid and recurrent family of transformers 5.24 and 5.25 goes through). cbcore binds there and forks
no model code:

- `StatePool`: per state tensor of every stateful layer, one `[num_slots, ...]` tensor; a request's state is its
  slot's row in each (the engine's `StateSlots` hands out the slot ids).
- `SlotStates`: what a layer is given as its `cache` inside a step: the Cache API over the pool rows of the requests
  one call covers, with transformers' semantics (a request's first chunk starts from no state; a conv state keeps the
  last `conv_kernel_size` inputs).
- `StateLayers`: while bound, each stateful module's forward, inside a cbcore step, is called on the packed batch's
  requests apart: once for all the requests that continue from a state with one token (decode rows, batched: one call
  per layer), and once per other request (a prefill chunk, a request's first token). Outside steps the module's own
  forward runs untouched.

Chunked prefill continues a request's state over several tokens, which `model.generate` never asks of a layer (it
prefills a prompt at once, then decodes one token at a time). Some layers ignore the state there: transformers'
Mamba-1 mixers (Mamba, FalconMamba, Jamba) run their multi-token selective scan from zeros. Each bound module is
therefore tested once, on its first step (`_continues_over_chunks`): a 6-token input run at once against the same
run as 3 + 3 tokens. A module that does not continue its state is given its continuation chunks one token at a time
(its decode form, which does read the state), and refused if even that differs.

The step's rows for this come from the plan (`StateStep`, built once per step by the runner, read by every layer).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from . import state_seams
from .attention import STEP_KWARG
from .lazy_zeros import zeroed_pages
from .state_specs import StateSpec, state_layer_modules
from .step_context import current_step

# Keyword arguments the decoder layers hand down that mean nothing to a stateful layer called on one request: cbcore's
# step and the packed sequence's boundaries (the layer is given each request apart).
_DROPPED_KWARGS = frozenset({STEP_KWARG, "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})

# -------------------------------------------------------------------------------------------------- pool ----


class StatePool:
    """Every stateful layer's states for `num_slots` requests: one `[num_slots, *shape]` tensor per `StateSpec`."""

    def __init__(self, specs: list[StateSpec], num_slots: int, device: torch.device) -> None:
        self.specs = specs
        self.num_slots = num_slots
        # Zero pages faulted in when first written (on the CPU, as the KV pages): slots nobody reaches cost nothing.
        self.tensors: dict[tuple[int, str, int], torch.Tensor] = {
            (s.layer_idx, s.kind, s.index): zeroed_pages((num_slots, *s.shape), s.dtype, device) for s in specs
        }
        self.layers = sorted({s.layer_idx for s in specs})
        # Per layer, its tensors by (kind, index): what each stateful layer's call reads, every step.
        self._by_layer: dict[int, dict[tuple[str, int], torch.Tensor]] = {layer: {} for layer in self.layers}
        for (layer, kind, index), tensor in self.tensors.items():
            self._by_layer[layer][(kind, index)] = tensor

    @property
    def nbytes(self) -> int:
        """Bytes of every slot of every state."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @staticmethod
    def bytes_per_slot(specs: list[StateSpec]) -> int:
        """Bytes one request's states take over every stateful layer."""
        return sum(spec.nbytes for spec in specs)

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole slots (every layer's states), (source, destination) pairs, all sources read first: a forked
        child starts from its parent's state."""
        if not pairs:
            return
        device = next(iter(self.tensors.values())).device
        sources = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        targets = torch.tensor([t for _, t in pairs], dtype=torch.long, device=device)
        for tensor in self.tensors.values():
            tensor.index_copy_(0, targets, tensor.index_select(0, sources))

    def layer_tensors(self, layer_idx: int) -> dict[tuple[str, int], torch.Tensor]:
        """(kind, index) -> pool tensor of one layer."""
        return self._by_layer.get(layer_idx, {})


# -------------------------------------------------------------------------------------------- the step ----


@dataclass(frozen=True)
class StateRow:
    """One request's share of a step, as a stateful layer sees it: its tokens `[start, start + num_tokens)` of the
    packed batch, its slot, and whether it continues from a state (it has computed tokens before this step)."""

    start: int
    num_tokens: int
    slot: int
    has_previous: bool


class StateStep:
    """The step's requests grouped for the stateful layers (built once per step, read by every layer): the decode
    group (one token each, continuing from a state) run as one batch, every other request on its own."""

    def __init__(self, pool: StatePool, rows: list[StateRow]) -> None:
        self.pool = pool
        self.rows = rows
        batched = [row for row in rows if row.num_tokens == 1 and row.has_previous]
        # Decode rows come first in the packed batch (cbcore/runner.py): the batch is then one contiguous range.
        first = batched[0].start if batched else 0
        contiguous = all(row.start == first + i for i, row in enumerate(batched))
        self.batched = batched if contiguous and len(batched) > 1 else []
        self.singles = [row for row in rows if not (row.num_tokens == 1 and row.has_previous)] if self.batched \
            else list(rows)
        device = next(iter(pool.tensors.values())).device if pool.tensors else torch.device("cpu")
        slots = [row.slot for row in self.batched]
        self.batched_slots = torch.tensor(slots, dtype=torch.long, device=device) if slots else None
        # Consecutive slots are read and written in place (a view); others through a gather and a scatter.
        self.batched_slice = (
            slice(slots[0], slots[0] + len(slots)) if slots and slots == list(range(slots[0], slots[0] + len(slots)))
            else None
        )


class SlotStates:
    """The cache a stateful layer is handed inside a step: transformers' linear-attention Cache API over the pool rows
    of the request(s) one call covers (`[batch, ...]` per state), with `LinearAttentionLayer`'s semantics for a cache
    that does not record its past. Only the layer it was made for may use it."""

    def __init__(self, layer_idx: int, tensors: dict[tuple[str, int], torch.Tensor], has_previous: bool) -> None:
        self.layer_idx = layer_idx
        self._tensors = tensors
        for (kind, _), tensor in tensors.items():
            if kind == "recurrent":
                # Marks the pool rows (a view or a gathered copy made for this call) that cbcore's delta-rule kernel
                # may advance in place (cbcore/state_seams.py): the layer stores the new state back into them anyway.
                tensor.cbcore_slot_state = True
        # Per state_idx, as transformers keeps it: set by the first conv update of a request's first chunk.
        self._has_previous: dict[int, bool] = {index: has_previous for (_, index) in tensors}
        self._written: set[tuple[str, int]] = set() if not has_previous else set(tensors)

    def _tensor(self, kind: str, layer_idx: int, state_idx: int) -> torch.Tensor:
        if layer_idx != self.layer_idx:
            raise RuntimeError(f"layer {self.layer_idx}'s state cache was asked for layer {layer_idx}'s state")
        try:
            return self._tensors[(kind, state_idx)]
        except KeyError:
            raise RuntimeError(
                f"layer {layer_idx} asked for a {kind} state {state_idx} that the start-up probe of its cache did "
                "not find"
            ) from None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The layer's conv state, or None before the request's first update (transformers: no previous state)."""
        tensor = self._tensor("conv", layer_idx, state_idx)
        return tensor if self._has_previous.get(state_idx) and ("conv", state_idx) in self._written else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The layer's recurrent state, or None before the request's first update."""
        tensor = self._tensor("recurrent", layer_idx, state_idx)
        return tensor if self._has_previous.get(state_idx) and ("recurrent", state_idx) in self._written else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """Keep the last `conv_kernel_size` inputs and return the inputs with the previous ones prepended (a first
        chunk shorter than the kernel is left-padded with zeros), as `LinearAttentionLayer.update_conv_state`."""
        tensor = self._tensor("conv", layer_idx, state_idx)
        size = tensor.shape[-1]
        if conv_kernel_size is not None and conv_kernel_size != size:
            raise RuntimeError(f"layer {layer_idx} keeps {conv_kernel_size} conv inputs, its slot {size}")
        if not self._has_previous[state_idx] or ("conv", state_idx) not in self._written:
            full = conv_states
            self._has_previous[state_idx] = True
            if full.shape[-1] < size:
                full = torch.nn.functional.pad(full, (size - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([tensor, conv_states], dim=-1)
        tensor.copy_(full[..., -size:])
        self._written.add(("conv", state_idx))
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        """Store the layer's new recurrent state and return the stored tensor."""
        tensor = self._tensor("recurrent", layer_idx, state_idx)
        if recurrent_states is not tensor:  # the kernel advanced the slot in place: nothing to copy
            tensor.copy_(recurrent_states)
        self._written.add(("recurrent", state_idx))
        return tensor

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether the layer continues from a state (every one of its states when `state_idx` is None)."""
        if layer_idx is not None and layer_idx != self.layer_idx:
            raise RuntimeError(f"layer {self.layer_idx}'s state cache was asked about layer {layer_idx}")
        if state_idx is None:
            return all(self._has_previous.values())
        return bool(self._has_previous.get(state_idx, False))

    def is_recording_past(self, layer_idx: int) -> bool:
        """Never: cbcore does not roll states back (no speculative decoding)."""
        return False

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers 5.25 counts a layer's tokens for `get_seq_length`; positions come from the step here."""

    def get_recurrent_states_to_keep(self, layer_idx: int) -> int:
        """transformers 5.25: intermediate states kept for rolling back; none."""
        return 0


class StateLayers:
    """Binds a model's stateful layers to the step's state pool while cbcore serves it (installed and removed by
    `ModelBinding`): inside a step each such module runs on the step's requests apart (`StateStep`); outside steps
    its own forward runs."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self._modules = modules
        for module in modules:
            module.forward = _bound_forward(module, module.forward)
        # Their modeling files' op functions run on cbcore's kernels inside steps (cbcore/state_seams.py).
        self._seams = state_seams.bind({type(module).__module__ for module in modules})

    @classmethod
    def attach(cls, model: torch.nn.Module) -> StateLayers | None:
        """Bind `model`'s stateful layers (None when it has none)."""
        modules = [module for _, module in state_layer_modules(model)]
        return cls(modules) if modules else None

    def detach(self) -> None:
        """Give each module its own forward back."""
        for module in self._modules:
            if "forward" in module.__dict__:
                del module.forward
        self._modules = []
        state_seams.unbind(self._seams)
        self._seams = set()


def _bound_forward(module: torch.nn.Module, forward):
    parameters = inspect.signature(forward).parameters
    cache_name = "cache" if "cache" in parameters else "cache_params" if "cache_params" in parameters else None
    names = list(parameters)
    if cache_name is None:
        raise ValueError(f"{type(module).__name__}.forward takes no `cache`: cbcore cannot hand it its state")
    # How the module continues a state over a multi-token chunk: None until tested on its first step.
    mode: dict[str, bool] = {}

    def forward_in_step(*args, **kwargs):
        step = current_step()
        states = getattr(step, "states", None)
        if states is None:  # outside cbcore's steps (or a step of a model cbcore serves without states)
            return forward(*args, **kwargs)
        arguments = dict(zip(names, args))
        arguments.update(kwargs)
        hidden = arguments.pop(names[0])
        for name in _DROPPED_KWARGS:
            arguments.pop(name, None)
        arguments[cache_name] = None
        if "attention_mask" in arguments:
            arguments["attention_mask"] = None  # no padding in a packed step
        if "one_token_at_a_time" not in mode:
            mode["one_token_at_a_time"] = not _continues_over_chunks(module, forward, hidden, arguments, cache_name,
                                                                     states.pool.layer_tensors(module.layer_idx))
        return _run_by_request(module, forward, hidden, arguments, cache_name, states, mode["one_token_at_a_time"])

    forward_in_step.__wrapped__ = forward
    return forward_in_step


# How far a module's chunked output may be from its whole-input output, relative to how much the state changes that
# output at all (the same tokens run from no state): a layer that continues its state differs by rounding (~1e-5 of
# the state's effect in fp32), one that restarts from zeros by the whole effect.
_CONTINUATION_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}


def _continues_over_chunks(module, forward, hidden: torch.Tensor, arguments: dict[str, Any], cache_name: str,
                           tensors: dict[tuple[str, int], torch.Tensor]) -> bool:
    """Whether `module` continues a state over a multi-token chunk: a seeded 6-token input run at once, then as
    3 + 3 tokens. If not, whether its one-token form does (3 + 1 + 1 + 1); RuntimeError if neither."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((1, 6, hidden.shape[-1]), generator=generator).to(hidden)

    def run(inputs: torch.Tensor, splits: list[int]) -> torch.Tensor:
        scratch = {key: torch.zeros((1, *t.shape[1:]), dtype=t.dtype, device=t.device) for key, t in tensors.items()}
        outputs, start = [], 0
        for count in splits:
            cache = SlotStates(module.layer_idx, scratch, has_previous=start > 0)
            outputs.append(forward(inputs[:, start : start + count], **{**arguments, cache_name: cache}))
            _check_output(module, outputs[-1])
            start += count
        return torch.cat(outputs, dim=1).float()[:, -3:]

    whole = run(x, [6])
    effect = float((run(x[:, 3:], [3]) - whole).abs().max())  # what the first 3 tokens' state changes
    if effect <= 1e-6 * max(1.0, float(whole.abs().max())):
        return True  # the state changes nothing measurable: either form is exact
    tolerance = _CONTINUATION_TOLERANCE.get(hidden.dtype, 0.25) * effect
    if float((run(x, [3, 3]) - whole).abs().max()) <= tolerance:
        return True
    if float((run(x, [3, 1, 1, 1]) - whole).abs().max()) <= tolerance:
        return False
    raise RuntimeError(
        f"{type(module).__name__} (layer {module.layer_idx}) does not continue its state from one chunk to the next, "
        "in its multi-token form or its one-token form; cbcore cannot split a prompt over steps for it"
    )


def _run_by_request(module, forward, hidden: torch.Tensor, arguments: dict[str, Any], cache_name: str,
                    states: StateStep, one_token_at_a_time: bool = False) -> torch.Tensor:
    """The module's output over the packed batch `[1, T, hidden]`, each request run on its own state (a
    continuation chunk one token at a time for a module whose multi-token form ignores the state)."""
    layer_idx = module.layer_idx
    tensors = states.pool.layer_tensors(layer_idx)
    pieces: list[tuple[int, torch.Tensor]] = []
    if states.batched:
        first, count = states.batched[0].start, len(states.batched)
        if states.batched_slice is not None:
            rows = {key: t[states.batched_slice] for key, t in tensors.items()}
        else:
            rows = {key: t.index_select(0, states.batched_slots) for key, t in tensors.items()}
        cache = SlotStates(layer_idx, rows, has_previous=True)
        out = forward(hidden[0, first : first + count].unsqueeze(1), **{**arguments, cache_name: cache})
        _check_output(module, out)
        if states.batched_slice is None:
            for key, t in tensors.items():
                t.index_copy_(0, states.batched_slots, rows[key])
        pieces.append((first, out.reshape(1, count, *out.shape[2:])))
    for row in states.singles:
        rows = {key: t[row.slot : row.slot + 1] for key, t in tensors.items()}
        cache = SlotStates(layer_idx, rows, has_previous=row.has_previous)
        if one_token_at_a_time and row.has_previous and row.num_tokens > 1:
            outs = []
            for index in range(row.start, row.start + row.num_tokens):
                outs.append(forward(hidden[:, index : index + 1], **{**arguments, cache_name: cache}))
                _check_output(module, outs[-1])
            out = torch.cat(outs, dim=1)
        else:
            out = forward(hidden[:, row.start : row.start + row.num_tokens], **{**arguments, cache_name: cache})
            _check_output(module, out)
        pieces.append((row.start, out))
    pieces.sort(key=lambda piece: piece[0])
    return pieces[0][1] if len(pieces) == 1 else torch.cat([piece for _, piece in pieces], dim=1)


def _check_output(module: torch.nn.Module, out) -> None:
    if not isinstance(out, torch.Tensor):
        raise RuntimeError(
            f"{type(module).__name__} returned {type(out).__name__}, not a tensor: cbcore cannot assemble its output "
            "over a packed step"
        )
