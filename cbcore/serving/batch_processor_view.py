"""`manager.batch_processor`: the part of transformers' `ContinuousBatchProcessor` that code driving a manager reads.

transformers' serving layer reads its manager's internals for its statistics line (transformers 5.25's
`CBGenerateRunner.state()`: `len(batch_processor.scheduler.active_requests)`,
`len(batch_processor.scheduler.waiting_requests)` and `batch_processor.cache.compute_free_capacity()`; 5.24's
`CBGenerateManager.scheduler` hands out `batch_processor.scheduler`). cbcore's engine is built differently, so the
manager answers with this read-only view of its engine rather than an object of transformers' shape. Reads come from
another thread than the loop's: each takes one snapshot of a container (a single C-level copy under the GIL), so
it can be a step old but never half-updated.
"""

from __future__ import annotations

from ..engine import EngineCore
from ..requests import RequestState


class SchedulerView:
    """transformers' `Scheduler.active_requests` / `waiting_requests`: request id -> request, as of the last step."""

    def __init__(self, engine: EngineCore) -> None:
        self._engine = engine

    @property
    def active_requests(self) -> dict[str, RequestState]:
        """The requests admitted into the batch (holding blocks), as transformers counts them."""
        return {state.request_id: state for state in list(self._engine.scheduler.running)}

    @property
    def waiting_requests(self) -> dict[str, RequestState]:
        """The requests taken in but not admitted yet (new, or preempted and waiting to resume)."""
        return {state.request_id: state for state in list(self._engine.scheduler.waiting)}


class CacheView:
    """transformers' `PagedAttentionCache.compute_free_capacity`."""

    def __init__(self, engine: EngineCore) -> None:
        self._engine = engine

    def compute_free_capacity(self, relative: bool = True) -> int | float:
        """The KV cache's free room: a fraction of the whole (`relative`, transformers' default) or bytes. Blocks
        that only the prefix cache holds count as free, since the scheduler reclaims them on demand."""
        cache = self._engine.cache
        free_blocks = cache.allocator.num_available
        if relative:
            return free_blocks / cache.num_blocks
        return free_blocks * (cache.nbytes // cache.num_blocks)


class BatchProcessorView:
    """`manager.batch_processor` once the engine is built: its `scheduler` and `cache`, as transformers names them."""

    def __init__(self, engine: EngineCore) -> None:
        self.scheduler = SchedulerView(engine)
        self.cache = CacheView(engine)
