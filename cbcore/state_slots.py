"""State slots: which requests hold which rows of the worker's state pool (cbcore/state_layers.py), for models whose
layers keep a per-request recurrent or convolutional state. The engine's half of the state cache (docs/design.md,
"Per-request state"): ids only, over the C++ `SlotAllocator` (csrc/allocator/slot_allocator.h).

A slot follows its request like its blocks do (`PagedKVCache` calls in here from the same places):

- taken at admission (`take`), with one more reserved per child a `num_return_sequences` parent will fork, so that
  a fork never waits for a slot;
- kept across prefill chunks and steps;
- a forked child gets a reserved slot and a copy of its parent's state (`fork`; the copy is in the step's
  `BlockCopies.state_copies`, issued by the worker before the forward);
- kept while its request is swapped out (the state is small next to the request's K/V and a preemption frees blocks,
  not slots), released when it is preempted to be recomputed (its state is rebuilt from its tokens);
- released on any end (finished, cancelled, failed).

The number of slots bounds the running requests, as vLLM's `max_num_seqs` does: a request waits for a free slot at
admission.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ._C import SlotAllocator
from .requests import RequestState


class StateSlots:
    """Slot ids of the requests that hold state, and the slot copies decided this step."""

    def __init__(self, num_slots: int) -> None:
        self.allocator = SlotAllocator(num_slots)
        self.copies: list[tuple[int, int]] = []  # (parent slot, child slot) of this step's forks

    @property
    def num_slots(self) -> int:
        """Slots in all."""
        return self.allocator.num_slots

    @property
    def num_free(self) -> int:
        """Slots nobody holds."""
        return self.allocator.num_free

    @staticmethod
    def needed(state: RequestState) -> int:
        """Slots `state` takes at admission: its own (unless it kept one while swapped out) and its children's."""
        own = 0 if state.state_slot is not None else 1
        return own + (state.num_children - len(state.child_state_slots) if state.num_children else 0)

    def can_take(self, state: RequestState) -> bool:
        """Whether `state` can be admitted as far as slots go."""
        return self.needed(state) <= self.allocator.num_free

    def take(self, state: RequestState) -> None:
        """Give an admitted request its slot and reserve its children's; call `can_take` first."""
        count = self.needed(state)
        if not count:
            return
        slots = self.allocator.allocate(count)
        if state.state_slot is None:
            state.state_slot = slots.pop(0)
        state.child_state_slots.extend(slots)

    def fork(self, parent: RequestState, child: RequestState) -> None:
        """Give a forked child one of its parent's reserved slots, to start from a copy of the parent's state."""
        child.state_slot = parent.child_state_slots.pop(0)
        self.copies.append((parent.state_slot, child.state_slot))

    def release_reserved(self, parent: RequestState) -> None:
        """Free the slots a parent reserved for children it did not fork (cancelled before their fork)."""
        if parent.child_state_slots:
            self.allocator.free(parent.child_state_slots)
            parent.child_state_slots = []

    def release(self, state: RequestState) -> None:
        """Free every slot the request holds (its state is forgotten)."""
        slots = ([state.state_slot] if state.state_slot is not None else []) + state.child_state_slots
        if slots:
            self.allocator.free(slots)
        state.state_slot = None
        state.child_state_slots = []

    def take_copies(self) -> list[tuple[int, int]]:
        """This step's slot copies, for its plan."""
        copies, self.copies = self.copies, []
        return copies

    def check(self, live_requests: Iterable[RequestState]) -> None:
        """The allocator's invariants, and each slot held exactly by the requests that say they hold it."""
        holders = Counter()
        for state in live_requests:
            if state.state_slot is not None:
                holders[state.state_slot] += 1
            holders.update(state.child_state_slots)
        self.allocator.check_holders(dict(holders))
