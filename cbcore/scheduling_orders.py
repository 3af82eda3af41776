"""The policies that order a step's running requests for its budget: `fifo` (decodes first, then unfinished prefills)
and `prefill_first` (the reverse), transformers' two schedulers, each with transformers' default safety margin."""

from __future__ import annotations

from .requests import RequestState


class SchedulingOrder:
    """Policy: the order in which running requests get the step's budget."""

    name = "base"
    default_safety_margin = 0.0

    def running_order(self, running: list[RequestState]) -> list[RequestState]:
        """Running requests in the order they should be served."""
        raise NotImplementedError


class FifoOrder(SchedulingOrder):
    """Decoding requests first (their latency), then unfinished prefills; arrival order within each."""

    name = "fifo"
    default_safety_margin = 0.15  # transformers' FIFOScheduler default

    def running_order(self, running: list[RequestState]) -> list[RequestState]:
        return [s for s in running if not is_prefilling(s)] + [s for s in running if is_prefilling(s)]


class PrefillFirstOrder(SchedulingOrder):
    """Unfinished prefills first (time to first token), then decoding requests."""

    name = "prefill_first"
    default_safety_margin = 0.0  # transformers' PrefillFirstScheduler default

    def running_order(self, running: list[RequestState]) -> list[RequestState]:
        return [s for s in running if is_prefilling(s)] + [s for s in running if not is_prefilling(s)]


SCHEDULING_ORDERS: dict[str, type[SchedulingOrder]] = {"fifo": FifoOrder, "prefill_first": PrefillFirstOrder}


def is_prefilling(state: RequestState) -> bool:
    """Whether the request still has prompt (or recomputed) tokens to run beyond its next one, or has generated none."""
    return state.num_uncomputed_tokens > 1 or not state.generated_tokens
