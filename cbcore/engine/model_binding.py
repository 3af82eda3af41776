"""What cbcore does to a model while it serves it, and undoes after: its attention implementation switched to
cbcore's paged attention, on CPU its `nn.Linear` layers given prepacked oneDNN weights (cbcore/linear.py), and for
a decoder that computes positions itself, the step's positions handed to its positional embeddings
(cbcore/positions.py), and for a model with stateful layers, those layers run on each request's state slot
(cbcore/state_layers.py).

All four act only inside cbcore's steps: outside them the model's own attention and linears run, so the model stays
usable (its `generate`, a training forward) while bound. `EngineCore.step()` refuses to run on an unbound model: the
forward would ignore the paged cache and give wrong tokens without an error.
"""

from __future__ import annotations

import threading

import torch

from .. import attention
from ..linear import PackedLinears
from ..model_self_check import reference_attn_implementation
from ..model_support import language_root
from ..positions import StepPositions
from ..state_layers import StateLayers


class ModelBinding:
    """Binds one model to cbcore's attention (and packed linears); `attach()` and `detach()` are idempotent and
    thread-safe."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._lock = threading.Lock()
        # The implementation the model had before `attach()` (None while detached).
        self.original_attn_implementation: str | None = None
        self._packed_linears: PackedLinears | None = None
        self._step_positions: StepPositions | None = None
        self._state_layers: StateLayers | None = None
        # Set by attach(), cleared by detach(). Not read off the config: a composite model's top-level config may
        # name another implementation than its language model's.
        self.attached = False

    def attach(self) -> None:
        """Switch the model's attention to cbcore's paged attention, on CPU pack its linear layers, hook the
        positional embeddings of a decoder that computes positions itself and bind stateful layers to their slots."""
        with self._lock:
            name = attention.register()
            current = self.model.config._attn_implementation
            if current != name and self.original_attn_implementation is None:
                self.model.set_attn_implementation(name)
                self.original_attn_implementation = current
                # Outside cbcore's steps the layers run what the model had (its eager function for an eager model,
                # and for `paged|eager`, whose own function attends bidirectionally outside transformers' batches).
                attention.mark_outside_steps_implementation(self.model, _outside_steps_implementation(current))
            if self._packed_linears is None and self.model.device.type == "cpu":
                self._packed_linears = PackedLinears.attach(self.model)
            if self._step_positions is None:
                self._step_positions = StepPositions.attach(self.model, language_root(self.model))
            if self._state_layers is None:
                self._state_layers = StateLayers.attach(self.model)
            self.attached = True

    def notice_replaced_weights(self) -> None:
        """Pack again the linear weights that were replaced by other tensors (a new `nn.Parameter` set inside
        `pause()`); weights changed in place are repacked by the packed op itself."""
        with self._lock:
            if self._packed_linears is not None:
                self._packed_linears.refresh()

    def detach(self) -> None:
        """Give the model back its own attention implementation, linear layers and positional embeddings."""
        with self._lock:
            if self._packed_linears is not None:
                self._packed_linears.detach()
                self._packed_linears = None
            if self._step_positions is not None:
                self._step_positions.detach()
                self._step_positions = None
            if self._state_layers is not None:
                self._state_layers.detach()
                self._state_layers = None
            if self.original_attn_implementation is not None:
                self.model.set_attn_implementation(self.original_attn_implementation)
                self.original_attn_implementation = None
                attention.mark_outside_steps_implementation(self.model, None)
            self.attached = False


def _outside_steps_implementation(original: str | None) -> str | None:
    """What a bound model's layers run outside cbcore's steps: the true function of its original implementation
    (cbcore/model_self_check.py), or the original itself when that has none (the self-check refuses such a model at
    `start()`, before it serves anything)."""
    try:
        return reference_attn_implementation(original)
    except ValueError:
        return original
