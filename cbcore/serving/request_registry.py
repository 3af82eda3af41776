"""`RequestRegistry`: the ids of the requests a manager holds, and whether it accepts new ones.

Callers (`add_request`, `cancel_request`, `start` / `stop` / `destroy`) and the loop thread share this, under one
lock. A request's id is live from the moment it is registered until its terminal output is delivered, children
(`req_<n>__child#<i>`) included: two live requests with one id would be indistinguishable to anyone routing outputs by
id, so a live id is refused and an automatic one skips it. Between `add_request` and the loop taking it in, a request
is also "queued" here, so that a cancel arriving then marks the request itself rather than racing the loop.
"""

from __future__ import annotations

import threading

from ..requests import RequestState, child_request_id


class RequestRegistry:
    """Live request ids, automatic id assignment, the requests queued but not taken in yet, and why new requests are
    refused now (`closed_reason`; None: accepted). Every method expects `lock` held unless it says otherwise."""

    def __init__(self) -> None:
        # Guards every field here. The manager changes its stop mode under it too, together with `closed_reason`, so a
        # request is either queued before stopping began (and served) or refused.
        self.lock = threading.Lock()
        self.closed_reason: str | None = None
        self._request_counter = 0  # n of the next automatic id "req_<n>"
        self._in_flight: set[str] = set()  # ids (children included) registered and without a terminal output yet
        self._queued: dict[str, RequestState] = {}

    def register(self, state: RequestState) -> None:
        """Give `state` its id (an automatic one when it has none) and mark its family in flight. Raises ValueError,
        registering nothing, when a caller-chosen id or one of its children's ids is in flight."""
        if not state.request_id:
            while True:
                candidate = f"req_{self._request_counter}"
                self._request_counter += 1
                if not self._family_in_flight(candidate, state.num_children):
                    state.request_id = candidate
                    break
        elif self._family_in_flight(state.request_id, state.num_children):
            raise ValueError(
                f"request {state.request_id}: duplicate request id: a request with this id is still in flight; wait "
                "for its terminal output or use another request_id"
            )
        self._in_flight.update(_family_ids(state.request_id, state.num_children))

    def unregister(self, state: RequestState) -> None:
        """`state` was registered but never queued after all: its family's ids are free again."""
        self._in_flight.difference_update(_family_ids(state.request_id, state.num_children))

    def mark_queued(self, state: RequestState) -> None:
        """`state` is on the input queue now, not taken in by the loop yet."""
        self._queued[state.request_id] = state

    def mark_cancelled_if_queued(self, request_id: str) -> bool:
        """When `request_id` is queued and not taken in yet, mark it cancelled (the loop reads the mark as it takes it
        in) and return True; else False (it is the engine's to abort, or it already ended)."""
        queued = self._queued.get(request_id)
        if queued is not None:
            queued.cancel_requested = True
        return queued is not None

    def take_in(self, state: RequestState) -> bool:
        """The loop took `state` off the input queue: it is no longer queued here. Whether a cancel marked it. Takes the
        lock itself."""
        with self.lock:
            self._queued.pop(state.request_id, None)
            return state.cancel_requested

    def ended(self, request_id: str) -> None:
        """`request_id` got its terminal output: the id is free from this moment. Takes the lock itself."""
        with self.lock:
            self._in_flight.discard(request_id)

    def in_flight_ids(self) -> set[str]:
        """A copy of the ids in flight now (children included). Takes the lock itself."""
        with self.lock:
            return set(self._in_flight)

    def _family_in_flight(self, request_id: str, num_children: int) -> bool:
        return any(rid in self._in_flight for rid in _family_ids(request_id, num_children))


def _family_ids(request_id: str, num_children: int) -> list[str]:
    """A request's id and those of its `num_return_sequences - 1` children."""
    return [request_id] + [child_request_id(request_id, index) for index in range(num_children)]
