"""Positions for decoders that compute them themselves (BART-family: BART, mBART, PLBart, MVP, Marian, Pegasus,
Blenderbot, BigBird-Pegasus, TrOCR).

cbcore packs several requests into one sequence and prefills long prompts in chunks, so a token's position is not
its index in the packed batch: every step hands the model each token's own position (`position_ids`). These
decoders take no `position_ids`: they build `arange(seq_len) + cache_length` and give it to a positional embedding
whose forward is `forward(input, cache_length=0, position_ids=None)` (transformers' idiom for "positions from a cache
length, unless given"). Inside a cbcore step such a module gets the step's positions instead, through a forward
pre-hook; outside the steps the hook does nothing, so the model's own forward and `generate` are untouched.

`model_support` accepts a model without `position_ids` only when its positions come from such modules, and the
start-up self-check verifies the numbers (a chunked prefill and mixed steps would expose any position computed
elsewhere).
"""

from __future__ import annotations

import inspect

import torch

from .step_context import current_step, tracing_compiled_step


class _TracedPositions:
    """The step's positions inside a trace of the compiled step (cbcore/compiled_step.py sets `value` around the
    model call): the hook cannot read the thread-local step there, which would make the graph guard on each step's
    metadata object, so it reads the positions the compiled function was given instead."""

    value: torch.Tensor | None = None


TRACED_POSITIONS = _TracedPositions()

# The parameters that mark a positional embedding computing positions from a cache length unless given them.
_POSITION_PARAMETERS = frozenset({"cache_length", "position_ids"})


def cache_length_position_embeddings(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module under `root` whose forward takes both `cache_length` and `position_ids`."""
    found = []
    for name, module in root.named_modules():
        try:
            parameters = inspect.signature(type(module).forward).parameters
        except (TypeError, ValueError):
            continue
        if _POSITION_PARAMETERS <= set(parameters):
            found.append((name, module))
    return found


def _position_index(module: torch.nn.Module) -> int:
    """Index of `position_ids` among the forward's positional arguments after `self`."""
    names = list(inspect.signature(type(module).forward).parameters)
    return names.index("position_ids") - 1


class StepPositions:
    """Hands each cache-length positional embedding of a model the step's positions inside cbcore's steps."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self._handles = [
            module.register_forward_pre_hook(self._hook(_position_index(module)), with_kwargs=True)
            for module in modules
        ]

    @classmethod
    def attach(cls, model: torch.nn.Module, root: torch.nn.Module) -> StepPositions | None:
        """Hook `root`'s cache-length positional embeddings when `model`'s forward takes no `position_ids` (None when
        there is nothing to hook)."""
        if "position_ids" in inspect.signature(model.forward).parameters:
            return None
        modules = [module for _, module in cache_length_position_embeddings(root)]
        return cls(modules) if modules else None

    @staticmethod
    def _hook(index: int):
        def give_step_positions(module, args, kwargs):
            if tracing_compiled_step():
                positions = TRACED_POSITIONS.value
            else:
                positions = getattr(current_step(), "positions", None)
            if positions is None:  # outside cbcore's steps (or a shape probe): the model's own positions
                return None
            if len(args) > index:
                args = (*args[:index], positions, *args[index + 1 :])
            else:
                kwargs = {**kwargs, "position_ids": positions}
            return args, kwargs

        return give_step_positions

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
