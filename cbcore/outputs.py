"""Routing outputs from the loop thread to callers: a queue that can be read in arrival order or per request.

transformers keeps one `queue.Queue` and, when `get_result(request_id)` pops someone else's result, puts it back and
returns None at once. cbcore's `get_result(request_id, timeout)` instead waits (up to the timeout) for a result of
*that* request, leaving the others in place and in order (the README's "Differences from transformers").
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .requests import GenerationOutput


class OutputRouter:
    """Thread-safe store of delivered outputs, readable in arrival order or by request id."""

    def __init__(self) -> None:
        self._outputs: deque[GenerationOutput] = deque()
        self._cond = threading.Condition()
        self._handlers: dict[str, tuple[Callable[[GenerationOutput], Any], asyncio.AbstractEventLoop]] = {}

    def register_handler(
        self, request_id: str, callback: Callable[[GenerationOutput], Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Route this request's outputs to `callback`, called on `loop`; removed after the terminal output."""
        with self._cond:
            self._handlers[request_id] = (callback, loop)

    def deliver(self, output: GenerationOutput) -> None:
        """Called by the loop thread for every snapshot and terminal output."""
        with self._cond:
            handler = self._handlers.get(output.request_id)
            if handler is not None and output.is_finished():
                del self._handlers[output.request_id]
            if handler is None:
                self._outputs.append(output)
                self._cond.notify_all()
                return
        callback, loop = handler
        loop.call_soon_threadsafe(callback, output)

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
