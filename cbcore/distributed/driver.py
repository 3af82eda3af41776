"""The driver's side of tensor parallelism: `DriverRunner`, the runner that sends every operation to the other ranks
before doing it, and `DriverLink`, what the driver's loop sends and hears besides steps.

Everything the driver's runner does to the cache or through the model (a step's block copies, each forward, the
reruns that isolate a failing request among them) is sent first, as one message, and done by every rank in the same
order, so every rank's shard of the KV cache holds what the driver's holds. Sampling stays on the driver: the
tensor-parallel plan's LM head gathers the logits, so the driver sees the whole vocabulary. The other ranks need no
scheduler state: a plan carries tokens, positions and block tables (cbcore/distributed/wire.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ..plan import BlockCopies, StepPlan
from ..runner import ModelRunner
from .channel import Flag, Kind, Received
from .errors import TensorParallelError
from .group import TensorParallelGroup
from .pause import check_resumed, entry_wait_s, park_for_group_pause
from .wire import encode_copies, encode_plan

logger = logging.getLogger("cbcore")


class DriverLink:
    """The driver's end of the channel: every send, and what the other ranks said in its header (a pause or a hard
    stop asked on their side, a forward that failed there, a fatal error)."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.channel = group.channel
        self.pause_requested_elsewhere = False
        self.hard_stop_requested_by: list[int] = []
        self.last_forward_failed = False
        self._last_exchange = time.monotonic()
        # Idle, the driver still sends a heartbeat this often: the others' flags (a pause asked there) reach it, and
        # their wait for the next message never approaches cpu_group_timeout.
        self.heartbeat_interval_s = min(0.5, group.timeout_s / 4)

    def send(self, kind: Kind, payload: torch.Tensor | None = None, flags: int = 0, text: str | None = None) -> Received:
        """One exchange from the driver; raises TensorParallelError for a failure another rank reports."""
        if self.last_forward_failed:  # every rank compares it with its own (Received.group_failure)
            flags |= Flag.FORWARD_FAILED
        received = self.channel.exchange(kind, payload, flags, text, what=f"sending {kind.name}")
        self._last_exchange = time.monotonic()
        failure = received.group_failure(me=0)
        if failure is not None:  # every other rank read the same and ends too: nothing more is sent
            self.group.broken = failure
            raise TensorParallelError(failure)
        self.pause_requested_elsewhere = any(rank != 0 for rank in received.ranks_with(Flag.PAUSE_REQUESTED))
        for rank in received.ranks_with(Flag.HARD_STOP):
            if rank not in self.hard_stop_requested_by:
                self.hard_stop_requested_by.append(rank)
        return received

    def heartbeat_if_due(self) -> None:
        """Send a heartbeat when nothing was sent for `heartbeat_interval_s`."""
        if time.monotonic() - self._last_exchange >= self.heartbeat_interval_s:
            self.send(Kind.HEARTBEAT)

    def start_session(self, engine) -> None:
        """The loop begins: every rank's loop answers, and a rank whose weights changed since the last session (an
        optimizer step between two sessions of a kept manager) invalidates the driver's prefix cache too. What the
        other ranks asked in the last session (a hard stop that ended it) is forgotten."""
        self.pause_requested_elsewhere = False
        self.hard_stop_requested_by = []
        self.last_forward_failed = False
        received = self.send(Kind.START)
        if received.ranks_with(Flag.WEIGHTS_CHANGED):
            engine.notice_weight_changes(changed_elsewhere=True)

    def pause_window(self, manager, engine) -> bool:
        """Between two steps: when a caller of any rank asked for a pause, open it on every rank (see
        cbcore/distributed/pause.py). Whether it paused."""
        with manager._pause_cond:
            asked_here = manager._pause_holders > 0
        if not asked_here and not self.pause_requested_elsewhere:
            return False
        self.send(Kind.PAUSE)
        entered = park_for_group_pause(manager, entry_wait_s(self.group))
        changed = engine.notice_weight_changes()
        received = self.send(Kind.RESUME, flags=0 if entered else Flag.PAUSE_MISSED)
        self.pause_requested_elsewhere = False
        check_resumed(received, self.group)
        if not changed and received.ranks_with(Flag.WEIGHTS_CHANGED):
            engine.notice_weight_changes(changed_elsewhere=True)
        return True

    def end_session(self, error: BaseException | None) -> None:
        """The driver's loop ended: tell every rank (with the error when it crashed), unless the group is broken."""
        if self.group.broken is not None:
            return
        text = None if error is None else f"{type(error).__name__}: {error}"
        try:
            self.send(Kind.STOP, flags=Flag.FATAL if error is not None else 0, text=text)
        except TensorParallelError as failure:
            logger.error(f"cbcore: telling the tensor-parallel group that the driver's loop ended failed: {failure}")
        if error is not None:
            self.group.broken = self.group.broken or f"the driver's loop failed: {text}"


class DriverRunner(ModelRunner):
    """`ModelRunner` on the driver of a tensor-parallel group: each block copy and each forward is sent to the other
    ranks first (`DriverLink.send`), then done here; sampling is the driver's alone."""

    def __init__(self, link: DriverLink, *runner_args, **runner_kwargs) -> None:
        """`runner_args` / `runner_kwargs`: `ModelRunner`'s own (model, cache, sampler, ...)."""
        super().__init__(*runner_args, **runner_kwargs)
        self.link = link
        head = self.model.get_output_embeddings()
        self.vocab_width = getattr(head, "out_features", None) or self.model.config.get_text_config().vocab_size

    def copy_blocks(self, copies: BlockCopies) -> None:
        """Send the copies to every rank, then issue them here (`ModelRunner.copy_blocks`)."""
        if copies:
            self.link.send(Kind.COPY, encode_copies(copies))
        super().copy_blocks(copies)

    def forward(
        self, plan: StepPlan, step_hook: Callable | None = None
    ) -> tuple[torch.Tensor | None, list[int]]:
        """Send the plan to every rank, then run its forward here (every rank's forward takes part in the model's
        collectives); the logits are the whole vocabulary's, gathered by the plan's LM head."""
        self.link.send(Kind.STEP, encode_plan(plan))
        try:
            with self.link.group.counting_collectives():
                logits, emitted = super().forward(plan, step_hook)
        except BaseException as error:
            self.link.last_forward_failed = True
            if isinstance(error, Exception):
                # Before the engine blames a request for it: hear how the other ranks' forwards ended. Raises
                # TensorParallelError when the group is out of step (a rank raised before a collective this one
                # entered, and this one's error is that collective's timeout), else lets the engine isolate.
                self.link.send(Kind.HEARTBEAT, text=f"{type(error).__name__}: {error}")
            raise
        self.link.last_forward_failed = False
        if logits is not None and logits.shape[-1] != self.vocab_width:
            raise TensorParallelError(
                f"the driver's logits have {logits.shape[-1]} columns, not the vocabulary's {self.vocab_width}: the "
                "model's tensor-parallel plan leaves the LM head's output sharded; cbcore samples on the driver and "
                "needs it gathered (transformers' 'colwise_gather_output' for lm_head)"
            )
        return logits, emitted


def make_runner(group: TensorParallelGroup | None, *runner_args, **runner_kwargs) -> ModelRunner:
    """The runner of one rank, built with `ModelRunner`'s own arguments: a `DriverRunner` on a tensor-parallel
    driver, the plain `ModelRunner` elsewhere (the other ranks' runners run what the driver sends; they never
    sample)."""
    if group is not None and group.is_driver:
        return DriverRunner(group.driver_link, *runner_args, **runner_kwargs)
    return ModelRunner(*runner_args, **runner_kwargs)
