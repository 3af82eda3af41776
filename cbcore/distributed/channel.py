"""`StepChannel`: the messages between the driver and the other ranks of a tensor-parallel group.

Every message is one *exchange* on the CPU group, which every rank enters:

1. a header, MAX-reduced over the ranks: `[kind, payload length, flags of rank 0, ..., flags of rank n-1,
   collectives of rank 0's last forward, ..., of rank n-1's, inline room]`. The driver writes the kind and the
   length, each rank its own flags (a pause or a hard stop asked on that rank, the outcome of its last forward, a
   fatal error) and how many collectives its last forward issued on the model's group. So the driver hears from
   every rank at every message, a rank that does not take part makes the others fail within `cpu_group_timeout`
   instead of waiting forever, and a forward that raised on one rank before a collective the others entered (the
   model's group out of step) ends the group on every rank;
2. the payload (an int64 tensor, cbcore/distributed/wire.py): inside the header's inline room when it fits, else
   broadcast from the driver after it. The room is the last STEP's payload length rounded up to a power of two (at
   most `MAX_INLINE`), which every rank derives alike from what it received, so a steady stream of steps costs one
   collective each instead of two. Carrying data in a MAX-reduce is exact because every int of the wire format is
   >= 0 and the other ranks write zeros;
3. when a rank flagged an error, its text, broadcast from that rank (rare: failures only).

Kinds: START (a loop began), STEP (a plan to run), COPY (block copies to issue), HEARTBEAT (the driver is idle but
alive; it lets the others' flags reach it), PAUSE (every rank parks), RESUME (every rank left its pause), STOP (the
driver's loop ended; with FATAL when it crashed). A step costs one exchange: one collective when its plan fits the
inline room (bench/results/tp_broadcast.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .group import TensorParallelGroup


class Kind(enum.IntEnum):
    """What the driver sends."""

    NONE = 0  # written by the other ranks: the MAX takes the driver's
    START = 1
    STEP = 2
    COPY = 3
    HEARTBEAT = 4
    PAUSE = 5
    RESUME = 6
    STOP = 7


class Flag(enum.IntFlag):
    """What each rank says about itself in every header."""

    PAUSE_REQUESTED = 1  # a thread of this rank holds (or waits for) pause()
    HARD_STOP = 2  # stop(hard_stop=True) was called on this rank
    FORWARD_FAILED = 4  # this rank's last STEP raised (a non-driver's text follows, once; the driver's flag stays)
    FATAL = 8  # this rank's loop is ending on an error (its text follows); it takes part in no other exchange
    PAUSE_MISSED = 16  # in RESUME: pause() was not entered on this rank in time
    WEIGHTS_CHANGED = 32  # in START and RESUME: this rank's parameters changed in place since it last looked
    HAS_TEXT = 64  # an error text from this rank follows the header


@dataclass
class Received:
    """One exchange as every rank sees it."""

    kind: Kind
    payload: list[int] | None
    flags: list[int]  # by tensor-parallel rank
    forward_collectives: list[int] = field(default_factory=list)  # by rank: collectives its last forward issued
    texts: dict[int, str] = field(default_factory=dict)  # by rank, for the ranks that sent one

    def ranks_with(self, flag: Flag) -> list[int]:
        """The ranks that set `flag`."""
        return [rank for rank, flags in enumerate(self.flags) if flags & flag]

    def group_failure(self, me: int) -> str | None:
        """Why this exchange ends the group, the same on every rank that reads it (so no rank acts on a message
        the others drop): another rank's loop is failing (FATAL); the last forward issued different numbers of
        collectives on different ranks, so the model's process group is out of step; or a plan's forward raised on
        some rank but not on the driver (whose own FORWARD_FAILED says how its last forward ended), so that rank's
        KV shard cannot be trusted. None when the group goes on (a forward that raised alike on every rank: the
        driver isolates its culprit)."""
        fatal = [rank for rank in self.ranks_with(Flag.FATAL) if rank != me]
        if fatal:
            return f"tensor-parallel rank(s) {fatal} failed: {self.texts_of(fatal)}"
        if len(set(self.forward_collectives)) > 1:
            counts = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(self.forward_collectives))
            texted = self.ranks_with(Flag.HAS_TEXT)
            return (
                f"the last forward issued different numbers of collectives on the tensor-parallel ranks ({counts}): it "
                "raised on some rank before a collective the others entered, so the model's process group is out "
                "of step and cannot be used again" + (f"; {self.texts_of(texted)}" if texted else "")
            )
        failed = [rank for rank in self.ranks_with(Flag.FORWARD_FAILED) if rank != 0]
        if failed and not self.flags[0] & Flag.FORWARD_FAILED:
            return f"the forward raised on tensor-parallel rank(s) {failed} but not on the driver: {self.texts_of(failed)}"
        return None

    def texts_of(self, ranks: list[int]) -> str:
        """The error texts of `ranks`, for a message."""
        return "; ".join(f"rank {rank}: {self.texts.get(rank, '(no message)')}" for rank in ranks)


# The most payload ints a header carries inline (512 KiB): beyond it the payload goes in a broadcast of its own.
MAX_INLINE = 1 << 16


class StepChannel:
    """The exchanges of one tensor-parallel group (see the module docstring). Not thread-safe: one thread per rank
    uses it at a time (the loop thread; before the loop starts, the thread that starts it)."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self._inline = 0  # the header's inline room of the next exchange; the same on every rank
        self._header = torch.zeros(2 + 2 * group.size, dtype=torch.int64)

    def exchange(
        self,
        kind: Kind = Kind.NONE,
        payload: torch.Tensor | None = None,
        flags: int = 0,
        text: str | None = None,
        what: str = "a step",
    ) -> Received:
        """Enter one exchange: the driver gives `kind` and `payload`; every rank gives its `flags` and, on a
        failure, its `text`. Raises TensorParallelError when the group is broken or does not answer in time."""
        group = self.group
        if group.broken is not None:
            raise group.failed(what, RuntimeError(f"the group is unusable: {group.broken}"))
        counts = 2 + group.size  # where the forwards' collective counts begin
        start = counts + group.size  # where the inline room begins
        if self._header.numel() != start + self._inline:
            self._header = torch.zeros(start + self._inline, dtype=torch.int64)
        header = self._header
        header.zero_()
        length = 0 if payload is None else payload.numel()
        if group.is_driver:
            header[0] = int(kind)
            header[1] = length
            if 0 < length <= self._inline:
                header[start : start + length] = payload
        header[2 + group.rank] = int(flags) | (Flag.HAS_TEXT if text is not None else 0)
        header[counts + group.rank] = group.last_forward_collectives
        try:
            dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group.cpu_group)
            kind, length = Kind(int(header[0])), int(header[1])
            received = Received(kind, None, header[2:counts].tolist(), header[counts:start].tolist())
            if 0 < length <= self._inline:
                received.payload = header[start : start + length].tolist()
            elif length:
                buffer = payload if group.is_driver else torch.empty(length, dtype=torch.int64)
                dist.broadcast(buffer, src=group.root, group=group.cpu_group)
                received.payload = buffer.tolist()
            if kind == Kind.STEP:  # the next step's plan is likely about as long as this one
                self._inline = min(1 << max(length - 1, 0).bit_length(), MAX_INLINE)
            for rank in received.ranks_with(Flag.HAS_TEXT):
                holder = [text if rank == group.rank else None]
                dist.broadcast_object_list(holder, src=group.global_ranks[rank], group=group.cpu_group)
                received.texts[rank] = str(holder[0])
        except RuntimeError as error:  # gloo's timeout and lost-peer errors (DistBackendError is a RuntimeError)
            raise group.failed(what, error) from error
        return received
