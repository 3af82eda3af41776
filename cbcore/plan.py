"""The step plan: what the scheduler decided, in ids and ints only, for the worker to execute.

`Scheduler.schedule()` decides on `RequestState`s (its own records) and hands the worker a `StepPlan`: per request
the tokens to run, the position of the first, the blocks it holds and whether its last row emits a token; plus the
step's block copies as block-id pairs. Nothing in a plan is a tensor or a live object, so it is what a tensor-parallel
driver broadcasts to the other ranks, and what a compiled or graph-captured step is built from.

Block copies are decided while scheduling (a fork's copy-on-write block, a preempted request's swap-out, a resumed
one's swap-in, a prefix block kept in or brought back from the host tier) and issued by the worker in one batched call
per direction before the step's forward (`ModelRunner.copy_blocks`), in this order:

1. device to host: a block being swapped out, or evicted into the host tier, may be handed out again in the same
   step (to a fork's copy, a swap-in, a growing request): its old K/V is copied out before anything overwrites it;
2. device to device: the forks' copy-on-write blocks (all sources read before any destination is written), and their
   state slots' copies (models with stateful layers);
3. host to device: swap-ins and host-tier bring-backs, into blocks whose old K/V was copied out in 1.

The one dependency the other way, a child forked and then swapped out in the same step (its block written in 2 and
read in 1), cannot arise: the scheduler preempts a child forked this step by recompute, never by swap.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockCopies:
    """One step's block copies as (source, destination) block-id pairs, by direction."""

    # Copy-on-write: a forked child's copy of its parent's partial last block.
    device_to_device: list[tuple[int, int]] = field(default_factory=list)
    # (device block, host block): swap-outs of preempted requests, prefix blocks kept in the host tier.
    device_to_host: list[tuple[int, int]] = field(default_factory=list)
    # (host block, device block): swap-ins of resumed requests, host-tier blocks brought back on a prefix hit.
    host_to_device: list[tuple[int, int]] = field(default_factory=list)
    # (parent slot, child slot): a forked child's copy of its parent's per-request state (models with stateful
    # layers, cbcore/state_slots.py), issued with the device-to-device copies.
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.device_to_device or self.device_to_host or self.host_to_device or self.state_copies)


@dataclass(slots=True)
class PlannedRequest:
    """One request's share of a step: run `token_ids` at positions `start, start + 1, ...` over `block_table` (a
    copy: the request's own table may grow before the next step). Slotted, not frozen: a step plans hundreds."""

    request_id: str
    token_ids: list[int]
    start: int  # the position of token_ids[0]: the tokens the request has computed so far
    block_table: list[int]
    emits_token: bool  # the last row reaches the end of the request's known tokens: it yields the next token
    state_slot: int | None = None  # its row of the state pool (models with stateful layers)
    # Prompt logprobs (a request with `prompt_logprobs`): the rows at positions [score_from, score_to) score the prompt
    # tokens after them, `score_targets` (driver only), each with its `score_top` most likely alternatives.
    score_from: int = 0
    score_to: int = 0
    score_targets: list[int] = field(default_factory=list)
    score_top: int = 0

    @property
    def num_tokens(self) -> int:
        """Query tokens of this request in the step."""
        return len(self.token_ids)


@dataclass
class StepPlan:
    """Everything the worker needs to run one step: the requests in the order the scheduler chose, and the copies."""

    requests: list[PlannedRequest] = field(default_factory=list)
    copies: BlockCopies = field(default_factory=BlockCopies)

    @property
    def num_tokens(self) -> int:
        """Query tokens in the step."""
        return sum(request.num_tokens for request in self.requests)
