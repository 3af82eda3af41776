"""What a manager's engine holds and has done: its parts (cache, scheduler, runner, the view transformers' serving
layer reads), its invariants checked, its counters, and the counts transformers' manager exposes as attributes
(`current_batch`, `prefix_hit_tokens`, `num_preemptions`)."""

from __future__ import annotations

from ..cache import PagedKVCache
from ..runner import ModelRunner
from ..scheduler import Scheduler
from .batch_processor_view import BatchProcessorView


class EngineInspection:
    """The part of `ContinuousBatchingManager` that reads its engine's state for the caller (`engine` and the loop's
    step count at start are the manager's)."""

    @property
    def batch_processor(self) -> BatchProcessorView | None:
        """What transformers' serving layer reads of its manager's batch processor (the scheduler's active and waiting
        requests, the cache's free capacity: `batch_processor_view.py`); None until the engine is built, as
        transformers' attribute is None until its processor is."""
        return BatchProcessorView(self.engine) if self.engine is not None else None

    @property
    def cache(self) -> PagedKVCache | None:
        """The engine's paged KV cache (None until the engine is built)."""
        return self.engine.cache if self.engine is not None else None

    @property
    def scheduler(self) -> Scheduler | None:
        """The engine's scheduler (None until the engine is built)."""
        return self.engine.scheduler if self.engine is not None else None

    @property
    def runner(self) -> ModelRunner | None:
        """The engine's model runner (None until the engine is built)."""
        return self.engine.runner if self.engine is not None else None

    def check_invariants(self) -> None:
        """Assert the allocator's invariants and that block refcounts equal the block tables holding them. Call it
        when the loop is stopped (the loop thread owns the engine state while it runs)."""
        if self.engine is not None:
            self.engine.check()

    def stats(self) -> dict[str, int | float]:
        """Counters to log, since the engine was built: steps; computed, prompt, recomputed and generated tokens;
        blocks free / cached (unused) / used; prefix-cache lookups, hits, hit rate and prompt tokens it saved;
        evictions; preemptions (swapped or recomputed); swaps out / in with bytes, host blocks free (for swap, counting
        the tier's), and the host tier's blocks kept, hits and drops (with `cpu_offload_space`); admissions deferred to
        share an in-flight prefix; for a model with stateful layers, its state slots (all, free) and their bytes;
        structured output's steps and seconds spent on its masks. Safe to call from any thread (a snapshot that may
        be one step stale while the loop runs); empty before the engine is built."""
        return self.engine.stats() if self.engine is not None else {}

    @property
    def current_batch(self) -> int:
        """Steps (forwards) run since the loop last started, as transformers' attribute of that name counts them."""
        return self.engine.counters["steps"] - self._steps_at_start if self.engine is not None else 0

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache instead of being computed."""
        return self.scheduler.num_prefix_hit_tokens if self.scheduler else 0

    @property
    def num_preemptions(self) -> int:
        """How many times a running request was preempted to make room."""
        return self.scheduler.num_preemptions if self.scheduler else 0
