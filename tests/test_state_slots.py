"""The state cache's parts on their own: the C++ `SlotAllocator` through its binding, `StateSlots` (a slot follows its
request through admission, fork and release), and `SlotStates`, whose answers must be those of transformers'
`LinearAttentionLayer` for the same sequence of calls."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import LinearAttentionLayer

from cbcore._C import SlotAllocator
from cbcore.requests import RequestState
from cbcore.state_layers import SlotStates, StatePool
from cbcore.state_specs import StateSpec
from cbcore.state_slots import StateSlots


def test_the_allocator_refuses_bad_calls_and_changes_nothing() -> None:
    allocator = SlotAllocator(3)
    held = allocator.allocate(2)
    assert held == [0, 1]
    with pytest.raises(RuntimeError, match="only 1 of 3 state slots are free"):
        allocator.allocate(2)
    with pytest.raises(ValueError, match="slot 5 is outside"):
        allocator.free([5])
    with pytest.raises(ValueError, match="fewer than the 2 released"):
        allocator.free([0, 0])
    with pytest.raises(ValueError, match="slot 2 is free"):
        allocator.share([2])
    assert allocator.num_free == 1 and allocator.refcount(0) == 1
    allocator.check_holders({0: 1, 1: 1})


def test_the_allocator_check_names_a_leak() -> None:
    allocator = SlotAllocator(2)
    allocator.allocate(1)
    with pytest.raises(RuntimeError, match="no holder names it: a leak"):
        allocator.check_holders({})
    allocator._corrupt_refcount_for_testing(1, 1)
    with pytest.raises(RuntimeError, match="slot 1 has refcount 1 but is in the free list"):
        allocator.check()


def _request(name: str, children: int = 0) -> RequestState:
    return RequestState(request_id=name, initial_tokens=[1, 2, 3], num_children=children)


def test_a_parent_reserves_its_childrens_slots_at_admission() -> None:
    slots = StateSlots(4)
    parent = _request("p", children=2)
    assert StateSlots.needed(parent) == 3 and slots.can_take(parent)
    slots.take(parent)
    assert parent.state_slot == 0 and parent.child_state_slots == [1, 2]
    children = [_request(f"c{i}") for i in range(2)]
    for child in children:
        slots.fork(parent, child)
    assert [c.state_slot for c in children] == [1, 2] and parent.child_state_slots == []
    assert slots.take_copies() == [(0, 1), (0, 2)] and slots.take_copies() == []
    slots.check([parent, *children])
    for state in (parent, *children):
        slots.release(state)
    assert slots.num_free == 4
    slots.check([])


def test_admission_waits_for_slots() -> None:
    slots = StateSlots(2)
    slots.take(_request("a"))
    assert not slots.can_take(_request("b", children=1))  # needs 2, 1 free
    assert slots.can_take(_request("c"))


def test_a_swapped_out_request_keeps_its_slot_and_takes_none_again() -> None:
    slots = StateSlots(2)
    state = _request("a")
    slots.take(state)
    assert StateSlots.needed(state) == 0  # re-admitted after a swap-out: it still holds its slot
    slots.take(state)
    assert slots.num_free == 1


def test_unforked_reservations_are_released() -> None:
    slots = StateSlots(3)
    parent = _request("p", children=2)
    slots.take(parent)
    slots.release_reserved(parent)
    assert slots.num_free == 2 and parent.state_slot == 0
    with pytest.raises(RuntimeError, match="slot 1 has refcount 0|leak|holder"):
        slots.check([_request("stranger")])


@pytest.mark.parametrize("chunks", [[1, 1, 1], [2, 5, 1], [3], [7, 2], [1, 6, 1, 1]])
def test_slot_states_answer_as_transformers_linear_attention_layer(chunks: list[int]) -> None:
    """The same conv and recurrent updates through transformers' layer and through a pool row give the same returned
    inputs, the same stored states and the same `get_*` answers, chunk after chunk (shorter and longer than the
    kernel)."""
    channels, kernel = 3, 4
    generator = torch.Generator().manual_seed(sum(chunks))
    theirs = LinearAttentionLayer()
    pool = StatePool([StateSpec(0, "conv", 0, (channels, kernel), torch.float32),
                      StateSpec(0, "recurrent", 0, (2, 2), torch.float32)], num_slots=3, device=torch.device("cpu"))
    pool.tensors[(0, "conv", 0)].fill_(7.0)  # a slot handed out again: its old contents must never show
    slot = 1
    done = 0
    for count in chunks:
        rows = {key: t[slot : slot + 1] for key, t in pool.layer_tensors(0).items()}
        ours = SlotStates(0, rows, has_previous=done > 0)
        assert (ours.get_conv_state(0) is None) == (not theirs.has_previous_state[0])
        x = torch.randn((1, channels, count), generator=generator)
        got = ours.update_conv_state(x, 0, conv_kernel_size=kernel)
        want = theirs.update_conv_state(x, conv_kernel_size=kernel)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(ours.get_conv_state(0), theirs.conv_states[0], rtol=0, atol=0)
        recurrent = torch.randn((1, 2, 2), generator=generator)
        ours.update_recurrent_state(recurrent, 0)
        theirs.update_recurrent_state(recurrent)
        torch.testing.assert_close(ours.get_recurrent_state(0), theirs.recurrent_states[0], rtol=0, atol=0)
        done += count
