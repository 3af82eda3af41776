"""`ContinuousMixin` and `enable(model)`: transformers' continuous-batching entry points, served by cbcore.

`enable(model)` binds `init_continuous_batching`, `continuous_batching_context_manager`, `generate_batch` and
`destroy_cached_continuous_batching_manager` onto one model instance, with transformers 5.24's signatures, so code
written for transformers' continuous batching runs unchanged on cbcore.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from . import request_inputs
from .config import ContinuousBatchingConfig
from .linear import release_packed
from .serving.manager import ContinuousBatchingManager
from .requests import GenerationOutput

logger = logging.getLogger("cbcore")


class ContinuousMixin:
    """The three entry points of transformers' continuous batching, each built on the one before."""

    @torch.no_grad()
    def init_continuous_batching(
        self,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        workload_hints: WorkloadHints | None = None,
    ) -> ContinuousBatchingManager:
        """A manager for this model (the cached one if `persistent_manager` kept one). Not started yet. Arguments of
        the wrong type raise TypeError, whether or not a cached manager is returned."""
        request_inputs.manager_configs(
            "init_continuous_batching", generation_config, continuous_batching_config, workload_hints
        )
        cached = getattr(self, "_cached_continuous_batching_manager", None)
        if isinstance(cached, ContinuousBatchingManager):
            if not cached._destroyed:
                return cached  # its start() switches the attention again
            del self._cached_continuous_batching_manager
        gen_config = generation_config if generation_config is not None else self.generation_config
        if gen_config is None:
            raise ValueError("A GenerationConfig must be provided or set in the model.")
        if continuous_batching_config is None:
            continuous_batching_config = getattr(gen_config, "continuous_batching_config", None)
        return ContinuousBatchingManager(self, gen_config, continuous_batching_config, workload_hints)

    def destroy_cached_continuous_batching_manager(self) -> None:
        """Destroy the manager kept by `persistent_manager=True`, if any, and free the packed linear weights kept
        for the next manager (cbcore/linear.py: `release_packed`)."""
        cached = getattr(self, "_cached_continuous_batching_manager", None)
        if isinstance(cached, ContinuousBatchingManager):
            cached.destroy()
            del self._cached_continuous_batching_manager
        release_packed(self)

    def continuous_batching_context_manager(
        self,
        generation_config: GenerationConfig | None = None,
        block: bool = True,
        timeout: float | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        persistent_manager: bool = False,
        warmup: bool = True,
        workload_hints: WorkloadHints | None = None,
    ) -> AbstractContextManager[ContinuousBatchingManager]:
        """A started manager for the `with` block; stopped (and destroyed unless `persistent_manager`) on exit. With
        `block=False` the exit does not wait: the loop finishes the requests in flight with cbcore's attention, then
        hands the model back and releases the cache by itself. The arguments are checked here, at the call (a `block`
        refused only on exit would leave the manager running)."""
        what = "continuous_batching_context_manager"
        request_inputs.manager_configs(what, generation_config, continuous_batching_config, workload_hints)
        block = request_inputs.flag(block, f"{what}: block")
        timeout = request_inputs.timeout_seconds(timeout, f"{what}: timeout")
        persistent_manager = request_inputs.flag(persistent_manager, f"{what}: persistent_manager")
        request_inputs.flag(warmup, f"{what}: warmup")
        return _serving_session(self, generation_config, block, timeout, continuous_batching_config,
                                persistent_manager, workload_hints)

    @torch.no_grad()
    def generate_batch(
        self,
        inputs: list[list[int]],
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        record_timestamps: bool = False,
        progress_bar: bool = False,
        persistent_manager: bool = False,
        warmup: bool = True,
        **kwargs,
    ) -> dict[str, GenerationOutput]:
        """Generate for every prompt; returns `{request_id: GenerationOutput}` in input order (`req_0`, `req_1`, ...).

        `max_new_tokens` may be passed as a keyword, as in transformers; any other keyword raises a TypeError
        (transformers silently ignores them). `warmup=False` does not skip compiling ahead: the manager's `start()`
        always compiles a compiled step before the first request, so no request pays for compilation.

        Under tensor parallelism (`torchrun`, a model loaded with a tensor-parallel plan) every rank calls it with the
        same arguments; the driver (rank 0) returns the outputs, the other ranks serve its steps and return `{}`.
        """
        max_new_tokens = kwargs.pop("max_new_tokens", None)
        if kwargs:
            raise TypeError(f"generate_batch got unexpected keyword arguments {sorted(kwargs)}")
        # Checked before any manager is built: a None or a string among the prompts is named by its index.
        inputs = request_inputs.batch_of_token_ids(inputs, "generate_batch")
        max_new_tokens = request_inputs.max_new_tokens(max_new_tokens, "generate_batch: max_new_tokens")
        request_inputs.manager_configs("generate_batch", generation_config, continuous_batching_config, None)
        record_timestamps = request_inputs.flag(record_timestamps, "generate_batch: record_timestamps")
        progress_bar = request_inputs.flag(progress_bar, "generate_batch: progress_bar")
        persistent_manager = request_inputs.flag(persistent_manager, "generate_batch: persistent_manager")
        warmup = request_inputs.flag(warmup, "generate_batch: warmup")
        if not inputs:
            return {}
        gen_config = self.generation_config if generation_config is None else generation_config
        max_new_tokens = gen_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        hints = WorkloadHints(
            max_prompt_length=max(len(ids) for ids in inputs),
            max_generated_length=max_new_tokens if max_new_tokens is not None else 0,
            num_requests=len(inputs),
        )
        num_return_sequences = gen_config.num_return_sequences or 1
        num_requests = len(inputs) * num_return_sequences
        results: dict[str, GenerationOutput] = {}
        request_ids: list[str] = []
        with self.continuous_batching_context_manager(
            generation_config=generation_config,
            continuous_batching_config=continuous_batching_config,
            block=True,
            timeout=None,
            persistent_manager=persistent_manager,
            warmup=warmup,
            workload_hints=hints,
        ) as manager:
            request_ids = manager.add_requests(inputs, max_new_tokens=max_new_tokens, record_timestamps=record_timestamps)
            if request_ids is None:
                # Not the tensor-parallel driver: the outputs are the driver's. Leaving the block stops this manager,
                # which on such a rank waits for the driver to end the session.
                return {}
            with tqdm(total=num_requests, disable=not progress_bar, desc=f"Solving {num_requests} requests", unit="request") as bar:
                while len(results) < num_requests:
                    result = manager.get_result(timeout=1)
                    if result is None:
                        if not manager.is_running():
                            logger.error("Generation thread terminated unexpectedly.")
                            break
                        continue
                    if result.is_finished():
                        results[result.request_id] = result
                        bar.update(1)
        # Input order; for num_return_sequences, a request's children first, then the request itself (transformers).
        ordered = {}
        for request_id in request_ids:
            family = [f"{request_id}__child#{i}" for i in range(num_return_sequences - 1)] + [request_id]
            ordered.update({rid: results[rid] for rid in family if rid in results})
        missing = [rid for rid in request_ids if rid not in ordered]
        if missing:
            logger.error(f"Requests {missing} not found in results.")
        failed = [rid for rid, out in ordered.items() if out.error is not None]
        if failed:
            logger.error(f"Requests {failed} failed during generation.")
        return ordered


@contextmanager
def _serving_session(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None,
    block: bool,
    timeout: float | None,
    continuous_batching_config: ContinuousBatchingConfig | None,
    persistent_manager: bool,
    workload_hints: WorkloadHints | None,
) -> Generator[ContinuousBatchingManager]:
    """`continuous_batching_context_manager`'s `with` block, its arguments checked."""
    manager = model.init_continuous_batching(generation_config, continuous_batching_config, workload_hints)
    # `warmup` is accepted for transformers' signature: start() builds the engine and compiles the step ahead itself
    # whenever warmup() has not, binding the model once for both (warmup() then start() would pack the linear weights
    # twice, a tenth of a second per generate_batch on the default model).
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager)
        if not persistent_manager:
            manager.destroy()


_ENTRY_POINTS = (
    "init_continuous_batching",
    "destroy_cached_continuous_batching_manager",
    "continuous_batching_context_manager",
    "generate_batch",
)


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Bind cbcore's continuous-batching entry points onto `model` (this instance only) and return it."""
    for name in _ENTRY_POINTS:
        setattr(model, name, types.MethodType(getattr(ContinuousMixin, name), model))
    return model
