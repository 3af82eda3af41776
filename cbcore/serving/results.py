"""Reading a manager's outputs, on the caller's thread: the next output (of one request, or of any), iteration over
one request's snapshots or over everything, and handlers called on an asyncio loop (cbcore/outputs.py routes them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

from .. import request_inputs
from ..requests import GenerationOutput


class ResultReading:
    """The half of `ContinuousBatchingManager` that callers read outputs with. The output router and the loop's
    state it reads are created by `ContinuousBatchingManager.__init__`."""

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], Any]) -> None:
        """Deliver this request's outputs (every snapshot when streaming, else the final one) by calling
        `callback(output)` on the running asyncio loop, through `call_soon_threadsafe`. Must be called from inside
        that loop. The handler is removed after the terminal output. Outputs exist on the tensor-parallel driver
        only: on another rank nothing is registered (no output would ever call it)."""
        request_id = request_inputs.known_request_id(request_id, "register_result_handler: request_id")
        if not callable(callback):
            raise TypeError(f"register_result_handler: callback must be callable, got {type(callback).__name__}")
        if not self.is_tp_driver:
            return
        loop = asyncio.get_running_loop()
        self.output_router.register_handler(request_id, callback, loop)

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of `request_id` when given), waiting up to `timeout` seconds. None on timeout, or when
        the loop is not running and nothing is left to read. Unlike transformers, asking for one request never
        returns None just because another request's output came first."""
        if request_id is not None:
            request_id = request_inputs.known_request_id(request_id, "get_result: request_id")
        timeout = request_inputs.timeout_seconds(timeout, "get_result: timeout")
        return self.output_router.get(request_id, timeout, self.is_running)

    def __iter__(self) -> Generator[GenerationOutput]:
        """Yield outputs as they arrive, while the loop runs."""
        while self.is_running() or not self.output_router.empty():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str) -> Generator[GenerationOutput]:
        """Yield the outputs of one request (snapshots when streaming) until its terminal output. A `request_id` that
        is not a str raises TypeError here, at the call, not at the first `next()`."""
        return self._outputs_of(request_inputs.known_request_id(request_id, "request_id_iter: request_id"))

    def _outputs_of(self, request_id: str) -> Generator[GenerationOutput]:
        while self.is_running() or not self.output_router.empty():
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return
