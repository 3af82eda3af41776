"""`pause()` across a tensor-parallel group: every rank parks its loop, and every rank's callers must enter it.

The driver opens the window (a PAUSE message) when a thread of any rank asks for a pause: its own, or another
rank's, whose request reaches it in the flags of the next exchange. Each rank then waits for its own caller to enter
`pause()`, parks while the caller holds it, and joins the RESUME exchange once it is released. A rank whose caller did
not enter within half of `cpu_group_timeout` says so in RESUME, and every rank ends with the same error (the other
half of the timeout bounds the exchange itself), so a pause entered on one rank only fails clearly on all of them
instead of hanging. As in transformers, the time spent inside the pause is not bounded, but once one rank has left it
the others must leave it within `cpu_group_timeout`.
"""

from __future__ import annotations

from .channel import Flag, Received
from .errors import TensorParallelError
from .group import TensorParallelGroup


def entry_wait_s(group: TensorParallelGroup) -> float:
    """How long a rank waits for its own caller to enter a pause the group opened."""
    return group.timeout_s / 2


def park_for_group_pause(manager, wait_s: float) -> bool:
    """Wait up to `wait_s` for a caller of this rank to enter `pause()`, then park until every caller released it
    (the manager's pause state, as its own loop parks: cbcore/serving/generation_loop.py). Whether one entered."""
    cond = manager._pause_cond
    with cond:
        if not cond.wait_for(lambda: manager._pause_holders > 0, timeout=wait_s):
            return False
        manager._loop_parked = True
        cond.notify_all()
        cond.wait_for(lambda: manager._pause_holders == 0)
        manager._loop_parked = False
    return True


def check_resumed(received: Received, group: TensorParallelGroup) -> None:
    """After RESUME: raise, on every rank alike, when some rank's caller never entered the pause."""
    missed = received.ranks_with(Flag.PAUSE_MISSED)
    if missed:
        entered = [rank for rank in range(group.size) if rank not in missed]
        # Every rank saw the same RESUME and ends its loop here: nothing more is sent on the group.
        group.broken = f"pause() was not entered on rank(s) {missed}"
        raise TensorParallelError(
            f"pause() was entered on tensor-parallel rank(s) {entered} but not on rank(s) {missed} within "
            f"{entry_wait_s(group):g}s (half of cpu_group_timeout={group.timeout_s:g}s): under tensor parallelism "
            "every rank must enter pause(); the group's loops end"
        )
