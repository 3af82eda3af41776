"""Routing outputs from the loop thread to callers: a queue that can be read in arrival order or per request.

transformers keeps one `queue.Queue` and, when `get_result(request_id)` pops someone else's result, puts it back and
returns None at once. cbcore's `get_result(request_id, timeout)` instead waits (up to the timeout) for a result of
*that* request, leaving the others in place and in order (DESIGN.md §7).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from .requests import GenerationOutput


class OutputRouter:
    """Thread-safe store of delivered outputs, readable in arrival order or by request id."""

    def __init__(self) -> None:
        self._outputs: deque[GenerationOutput] = deque()
        self._cond = threading.Condition()

    def deliver(self, output: GenerationOutput) -> None:
        """Called by the loop thread for every snapshot and terminal output."""
        with self._cond:
            self._outputs.append(output)
            self._cond.notify_all()

    def wake_all(self) -> None:
        """Wake waiting readers so they can notice that the loop stopped."""
        with self._cond:
            self._cond.notify_all()

    def empty(self) -> bool:
        """Whether nothing is waiting to be read."""
        with self._cond:
            return not self._outputs

    def get(self, request_id: str | None, timeout: float | None, producer_alive) -> GenerationOutput | None:
        """Pop the oldest output (of `request_id` when given), waiting up to `timeout` seconds (None: forever) while
        `producer_alive()` says more can still come. Returns None on timeout or when nothing more can come."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                found = self._pop_first(request_id)
                if found is not None:
                    return found
                if not producer_alive():
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                # Wake periodically too: the producer may die without notifying (a crash in the loop thread).
                self._cond.wait(timeout=0.1 if remaining is None else min(remaining, 0.1))

    def _pop_first(self, request_id: str | None) -> GenerationOutput | None:
        if not self._outputs:
            return None
        if request_id is None:
            return self._outputs.popleft()
        for index, output in enumerate(self._outputs):
            if output.request_id == request_id:
                del self._outputs[index]
                return output
        return None
