"""The manager's background generation loop: the one thread that steps the engine, and how callers pause it.

Each iteration, between two steps: park while anyone holds the pause, take in the new requests (a request cancelled
while it was queued ends CANCELLED without being admitted), apply the cancellations, stop when asked, else run one step
and deliver its outputs. A terminal output frees its request id the moment it is delivered. The loop never vanishes
silently: an exception fails every request it holds, is kept in `background_thread_status.fatal_error` and closes the
manager to new requests until the next `start()`. Whatever way it ends, the loop itself hands the model back, as the
last thing it does, when no step can be in flight any more.

Under tensor parallelism (cbcore/distributed/) the driver's loop is this one, with four additions: it starts each
session with the other ranks, sends a heartbeat when idle, opens pauses on every rank, and tells them when it ends;
a hard stop asked on another rank stops it. The other ranks run `run_follower_loop` instead.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from ..distributed.channel import Flag, Kind, Received
from ..distributed.errors import TensorParallelError
from ..distributed.pause import check_resumed, entry_wait_s, park_for_group_pause
from ..distributed.wire import decode_copies, decode_plan
from ..requests import GenerationOutput, RequestState, RequestStatus

logger = logging.getLogger("cbcore")


class StopMode:
    """What the loop does when it next looks: keep serving, or stop (after the queued requests, or at once). It only
    ever moves towards HARD while the loop runs."""

    RUNNING = 0
    FLUSH = 1  # finish everything queued, then stop
    HARD = 2  # fail whatever is pending, stop now


class BackgroundThreadStatus:
    """What transformers' own code reads of a manager's loop (its serving layer's `CBGenerateManager` checks
    `manager.background_thread_status.fatal_error` before each request): the error that killed the loop, or None."""

    def __init__(self) -> None:
        self.fatal_error: BaseException | None = None


class GenerationLoop:
    """The half of `ContinuousBatchingManager` that runs on its loop thread, and `pause()`, the loop's one public
    control besides start and stop. The state it shares with the callers' half (the engine, the queues, the request
    registry, the wake-up event, the stop mode, the pause condition) is created by `ContinuousBatchingManager.__init__`;
    of the manager's lifecycle it calls `is_running`, `_refuse_if_destroyed`, `_restore_attn` and `_release`."""

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Pause the loop for the `with` block, e.g. to update the model's weights in place. The block is entered once
        the loop is parked between two steps; on exit it resumes with its cache and in-flight requests intact
        (nothing is drained, nothing lost). Several threads may hold the pause at once; the loop resumes when the last
        one leaves. Raises RuntimeError when no loop is running, or when the loop ends (stopped or crashed) before it
        could park: it never waits for a loop that is gone.

        Under tensor parallelism every rank must enter it (as in transformers): the group's loops park together. A
        rank whose caller does not enter within half of `cpu_group_timeout` ends every rank's loop with a
        `TensorParallelError` saying so (cbcore/distributed/pause.py), rather than leave the others waiting."""
        self._refuse_if_destroyed("pause")
        if not self.is_running():
            raise RuntimeError("Cannot pause generation while no generation loop is running.")
        thread = self._generation_thread
        with self._pause_cond:
            self._pause_holders += 1
        try:
            self._wake_up_loop.set()
            with self._pause_cond:
                # Poll the thread too: a loop that dies between two notifications would otherwise be waited on forever.
                while not self._loop_parked:
                    if thread is None or not thread.is_alive():
                        raise RuntimeError(
                            "The generation loop stopped before it could pause."
                        ) from self.background_thread_status.fatal_error
                    self._pause_cond.wait(timeout=0.05)
            self._pause_owner.depth = getattr(self._pause_owner, "depth", 0) + 1
            try:
                yield
            finally:
                self._pause_owner.depth -= 1
        finally:
            with self._pause_cond:
                self._pause_holders -= 1
                self._pause_cond.notify_all()

    def _run_generation_loop(self, use_inference_mode: bool, num_threads: int) -> None:
        group = self._tensor_parallel
        if group is not None and not group.is_driver:  # another rank of a tensor-parallel group: the driver's steps
            return run_follower_loop(self, use_inference_mode, num_threads)
        link = group.driver_link if group is not None else None
        # The caller's torch thread count, set explicitly in this thread, so the loop runs with the caller's choice
        # rather than whatever OpenMP gives a new thread (bench/test_bench_linear.py::test_threads compares the two;
        # the slowdown a fresh thread showed was the caller's OpenMP team: docs/design.md, "Threads").
        torch.set_num_threads(num_threads)
        engine = self.engine
        self._steps_at_start = engine.counters["steps"]
        failure: BaseException | None = None
        try:
            with torch.inference_mode(use_inference_mode), (
                group.bounded_model_collectives() if group is not None else nullcontext()
            ):
                engine.notice_weight_changes()  # since the last session of a kept manager
                if link is not None:
                    link.start_session(engine)
                while True:
                    if self._park_while_paused():
                        engine.notice_weight_changes()  # weights change only inside a pause (or between sessions)
                    self._take_new_requests()
                    self._apply_cancellations()
                    if link is not None and link.hard_stop_requested_by:
                        self._hard_stop_asked_elsewhere(link.hard_stop_requested_by)
                    if self._stop_mode == StopMode.HARD:
                        self._end_all("the manager was stopped with hard_stop=True before this request finished")
                        break
                    if not engine.has_work():
                        # add_request is refused once stop() began (same lock), so an empty queue stays empty.
                        if self._stop_mode == StopMode.FLUSH and self.input_queue.empty():
                            break
                        self._wake_up_loop.wait(timeout=0.1)
                        self._wake_up_loop.clear()
                        if link is not None:
                            link.heartbeat_if_due()
                        continue
                    self._deliver(engine.step())
                    if link is not None:  # a step that ran no forward sent nothing
                        link.heartbeat_if_due()
        except BaseException as error:  # noqa: BLE001 - the loop must report, not vanish
            failure = error
            logger.exception("cbcore generation loop crashed")
            with self._requests.lock:
                self.background_thread_status.fatal_error = error
                self._requests.closed_reason = (
                    f"the generation loop died ({type(error).__name__}: {error}); call start() again"
                )
            self._engine_needs_rebuild = True
            try:
                self._end_all(f"the generation loop crashed: {type(error).__name__}: {error}")
            except BaseException:  # noqa: BLE001 - still hand the model back and wake every waiter below
                logger.exception("cbcore: failing the pending requests after a crash failed")
        finally:
            if link is not None:  # every other rank's loop ends with this one (and with its error)
                link.end_session(failure)
            # Only now, with no step in flight, may the model be handed back (stop(block=False) returns earlier).
            self._restore_attn()
            if self._destroyed:  # destroyed while it finished (after stop(block=False))
                self._release()
            with self._pause_cond:
                self._pause_cond.notify_all()
            self.output_router.wake_all()

    def _hard_stop_asked_elsewhere(self, ranks: list[int]) -> None:
        """stop(hard_stop=True) on another tensor-parallel rank stops the whole group at once."""
        with self._requests.lock:
            if self._requests.closed_reason is None:
                self._requests.closed_reason = f"stop(hard_stop=True) was called on tensor-parallel rank(s) {ranks}"
            self._stop_mode = StopMode.HARD

    def _park_while_paused(self) -> bool:
        """Between two steps: while anyone holds the pause, stay parked (and say so). Whether it parked. On a
        tensor-parallel driver the pause is the group's (cbcore/distributed/pause.py)."""
        group = self._tensor_parallel
        if group is not None:
            return group.driver_link.pause_window(self, self.engine)
        with self._pause_cond:
            if not self._pause_holders:
                return False
            self._loop_parked = True
            self._pause_cond.notify_all()
            self._pause_cond.wait_for(lambda: self._pause_holders == 0)
            self._loop_parked = False
            return True

    def _take_new_requests(self) -> None:
        """Move every queued request into the engine (which checks its prompt), or end it CANCELLED when a cancel
        marked it while it was queued. `add_request` checked every field, so admitting one cannot raise; if it does
        all the same, that request alone fails (nothing of it is in the scheduler yet), not the loop."""
        while True:
            try:
                state = self.input_queue.get_nowait()
            except queue.Empty:
                return
            if not isinstance(state, RequestState):  # not from add_request: there is no request to end
                logger.error(f"cbcore: dropped {type(state).__name__} found on the input queue: only add_request / "
                             "add_requests queue requests")
                continue
            if self._requests.take_in(state):
                self._deliver(self.engine.end_unadmitted(state, RequestStatus.CANCELLED))
                continue
            try:
                outputs = self.engine.add_request(state)
            except Exception as error:  # noqa: BLE001 - one request's admission must not end the loop
                logger.exception(f"cbcore: admitting request {state.request_id} raised")
                state.error = f"request {state.request_id}: admitting it raised {type(error).__name__}: {error}"
                outputs = self.engine.end_unadmitted(state, RequestStatus.FAILED)
            self._deliver(outputs)

    def _apply_cancellations(self) -> None:
        """Abort every request whose cancel arrived after the loop had taken it in. `cancel_request` lets only str ids
        through; anything else found here (put on the queue by other code) is dropped with a log line, never allowed
        to end the loop and every request in flight with it."""
        while True:
            try:
                request_id = self.cancel_queue.get_nowait()
            except queue.Empty:
                return
            if not isinstance(request_id, str):
                logger.error(f"cbcore: dropped a cancel of {request_id!r} ({type(request_id).__name__}): request ids "
                             "are strs, so no request has it")
                continue
            self._deliver(self.engine.abort(request_id))

    def _end_all(self, reason: str) -> None:
        """Fail every request still held (queued here, waiting or running), keeping their partial tokens."""
        queued = []
        while True:
            try:
                state = self.input_queue.get_nowait()
            except queue.Empty:
                break
            self._requests.take_in(state)
            queued.append(state)
        if self.engine is not None:
            self._deliver(self.engine.fail_all(reason, queued))

    def _deliver(self, outputs: list[GenerationOutput]) -> None:
        """Hand the engine's outputs to the router; a terminal output frees its id from this moment."""
        for output in outputs:
            if output.is_finished():
                self._requests.ended(output.request_id)
            self.output_router.deliver(output)


# ---- The loop of the other ranks of a tensor-parallel group ---------------------------------------------------------
# The loop of a rank that is not the driver: it runs what the driver sends, and nothing else.
#
# It replaces the manager's generation loop on those ranks (`GenerationLoop._run_generation_loop` hands over to
# `run_follower_loop`). Each exchange carries this rank's flags to the driver (a pause or a hard stop asked here, the
# outcome of its last forward); the driver's message says what to do: run a plan's forward (its logits are dropped:
# the driver samples), issue block copies, park for a pause, or end. A forward that raises is reported and the loop goes
# on, because the driver reruns parts of a failing step to isolate its culprit and every rank must rerun them too; the
# next exchange ends the group instead when that forward raised here alone, or before a collective the driver entered
# (each exchange carries how many collectives every rank's last forward issued). Any other error ends the loop, and
# is reported to the driver first, so no rank waits for this one.
#
# Requests never reach this rank: `add_request` returns None here, the outputs are the driver's.


def run_follower_loop(manager, use_inference_mode: bool, num_threads: int) -> None:
    """The loop thread of a non-driver rank of `manager`'s tensor-parallel group, until the driver's loop ends."""
    torch.set_num_threads(num_threads)
    engine = manager.engine
    group = manager._tensor_parallel
    channel = group.channel
    carried, text = 0, None  # what the next exchange reports about the last one
    try:
        with torch.inference_mode(use_inference_mode), group.bounded_model_collectives():
            if engine.notice_weight_changes():
                carried = Flag.WEIGHTS_CHANGED
            while True:
                received = channel.exchange(flags=carried | _asked_here(manager), text=text,
                                            what="waiting for the driver's next message")
                carried, text = 0, None
                _raise_for_failures(received, group)
                kind = received.kind
                if kind == Kind.STEP:
                    try:
                        with group.counting_collectives():
                            engine.runner.forward(decode_plan(received.payload))
                    except Exception as error:  # noqa: BLE001 - reported; the driver decides (see the docstring)
                        logger.warning(f"cbcore: tensor-parallel rank {group.rank}: a step's forward raised {error!r}")
                        carried, text = Flag.FORWARD_FAILED, f"{type(error).__name__}: {error}"
                elif kind == Kind.COPY:
                    engine.runner.copy_blocks(decode_copies(received.payload))
                elif kind == Kind.PAUSE:
                    entered = park_for_group_pause(manager, entry_wait_s(group))
                    flags = (0 if entered else Flag.PAUSE_MISSED)
                    if engine.notice_weight_changes():
                        flags |= Flag.WEIGHTS_CHANGED
                    resumed = channel.exchange(flags=flags, what="leaving a pause")
                    _raise_for_failures(resumed, group)
                    if resumed.kind != Kind.RESUME:
                        raise TensorParallelError(f"the driver sent {resumed.kind.name} during a pause, not RESUME")
                    check_resumed(resumed, group)
                elif kind == Kind.STOP:
                    return
                elif kind not in (Kind.START, Kind.HEARTBEAT):
                    raise TensorParallelError(f"tensor-parallel rank {group.rank} got an unknown message {kind!r}")
    except BaseException as error:  # noqa: BLE001 - the loop must report, not vanish
        logger.exception(f"cbcore: tensor-parallel rank {group.rank}: the loop failed")
        with manager._requests.lock:
            manager.background_thread_status.fatal_error = error
            manager._requests.closed_reason = f"the generation loop died ({type(error).__name__}: {error})"
        manager._engine_needs_rebuild = True
        if group.broken is None and not isinstance(error, TensorParallelError):
            try:  # tell the driver, so that it fails its requests now rather than wait for this rank
                channel.exchange(flags=Flag.FATAL, text=f"{type(error).__name__}: {error}", what="reporting a failure")
            except TensorParallelError:
                pass
        group.broken = group.broken or f"rank {group.rank}'s loop failed: {type(error).__name__}: {error}"
    finally:
        manager._restore_attn()
        if manager._destroyed:
            manager._release()
        with manager._pause_cond:
            manager._pause_cond.notify_all()
        manager.output_router.wake_all()


def _asked_here(manager) -> int:
    """This rank's standing requests: a caller waiting for (or holding) a pause, a hard stop."""
    flags = 0
    with manager._pause_cond:
        if manager._pause_holders:
            flags |= Flag.PAUSE_REQUESTED
    if manager._stop_mode == StopMode.HARD:
        flags |= Flag.HARD_STOP
    return flags


def _raise_for_failures(received: Received, group) -> None:
    """The exchange ends the group (another rank's loop is failing, the driver's with its STOP, or a forward
    raised here but not on the driver): this rank's loop ends with it, before acting on the message."""
    failure = received.group_failure(me=group.rank)
    if failure is not None:
        group.broken = failure
        raise TensorParallelError(failure)
