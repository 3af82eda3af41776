"""The loop of a rank that is not the driver: it runs what the driver sends, and nothing else.

It replaces the manager's generation loop on those ranks (`GenerationLoop._run_generation_loop` hands over to
`run_follower_loop`). Each exchange carries this rank's flags to the driver (a pause or a hard stop asked here, the
outcome of its last forward); the driver's message says what to do: run a plan's forward (its logits are dropped:
the driver samples), issue block copies, park for a pause, or end. A forward that raises is reported and the loop goes
on, because the driver reruns parts of a failing step to isolate its culprit and every rank must rerun them too; the
next exchange ends the group instead when that forward raised here alone, or before a collective the driver entered
(each exchange carries how many collectives every rank's last forward issued). Any other error ends the loop, and
is reported to the driver first, so no rank waits for this one.

Requests never reach this rank: `add_request` returns None here, the outputs are the driver's.
"""

from __future__ import annotations

import logging

import torch

from ..serving.generation_loop import StopMode
from .channel import Flag, Kind, Received
from .errors import TensorParallelError
from .pause import check_resumed, entry_wait_s, park_for_group_pause
from .wire import decode_copies, decode_plan

logger = logging.getLogger("cbcore")


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
