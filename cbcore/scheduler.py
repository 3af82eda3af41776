"""Scheduling: which requests run this step, how many tokens each, and which blocks they get.

The scheduler decides and touches no tensors. Its output, a `ScheduledBatch`, says for each request how many of its
uncomputed tokens run this step, and lists the step's block copies; `ScheduledBatch.plan()` turns it into the
`StepPlan` of ids and ints (cbcore/plan.py) that the runner turns into tensors. A prefill chunk, the rest of a prompt after a
prefix-cache hit, a decode step and the recompute of a preempted request are all "run the next n tokens".

Budgets per step: query tokens (`max_batch_tokens`, long prompts are split: chunked prefill), requests
(`max_requests_per_batch`), and free blocks. When a running request needs a block and none is free, the allocator
first evicts cached blocks nobody uses (LRU); if that is not enough, the most recently admitted request is preempted:
its blocks are released and it goes back to the head of the queue, to be recomputed (prompt + generated so far) later,
with unchanged output. A request preempted before is not chosen again until it has generated a new token (no thrash).

Two orders (cbcore/scheduling_orders.py), as in transformers: "fifo" runs decodes first, then unfinished prefills,
then new requests; "prefill_first" runs unfinished prefills first, then decodes, then new requests. New requests are
admitted in arrival order and a request waiting for memory is never overtaken, so a large request cannot starve. The
one exception: a request whose prompt starts with blocks that a running prefill is computing right now waits for them
(and shares them) while the requests behind it go ahead.

Priorities (a request's `priority` kwarg, vLLM's: lower first, default 0): running requests get the step's budget in
(priority, policy order) order, the waiting queue is kept in (priority, arrival) order, a preempted request goes back
first among its priority, and a victim is chosen among the least urgent running requests first, never one more urgent
than the request that needs the blocks. With every priority equal (the default) this is exactly the order above.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .cache import PagedKVCache
from .plan import BlockCopies, PlannedRequest, StepPlan
from .requests import RequestState, RequestStatus, child_request_id
from .sampling import PRIORITY_KWARG, SEED_KWARG
from .scheduling_orders import SchedulingOrder, is_prefilling


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: run `num_tokens` tokens starting at its `num_computed_tokens`."""

    state: RequestState
    num_tokens: int

    @property
    def emits_token(self) -> bool:
        """Whether this step reaches the end of the request's known tokens, so its last row yields the next token."""
        return self.state.num_computed_tokens + self.num_tokens == self.state.num_tokens


@dataclass
class ScheduledBatch:
    """The scheduler's decision for one step."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    # Requests preempted while making room this step (already back in the waiting queue).
    preempted: list[RequestState] = field(default_factory=list)
    # Requests that hit the cache's capacity on their own: they end now (finished, bounded by the cache).
    filled_the_cache: list[RequestState] = field(default_factory=list)
    # Children created this step for `num_return_sequences` (already running).
    forked: list[RequestState] = field(default_factory=list)
    # Requests that cannot go on, with the reason (they end FAILED).
    failed: list[tuple[RequestState, str]] = field(default_factory=list)
    # The block copies the decisions imply, issued by the worker before the step's forward.
    copies: BlockCopies = field(default_factory=BlockCopies)

    @property
    def num_tokens(self) -> int:
        """Query tokens in the step."""
        return sum(item.num_tokens for item in self.requests)

    def plan(self) -> StepPlan:
        """The step in ids and ints: what the worker executes (read before the requests advance)."""
        requests = []
        for item in self.requests:
            state = item.state
            start, end = state.num_computed_tokens, state.num_computed_tokens + item.num_tokens
            tokens = state.all_tokens
            planned = PlannedRequest(state.request_id, tokens[start:end], start, state.block_table[:],
                                     end == len(tokens), state.state_slot)
            first = state.next_prompt_row
            if first is not None:  # rows that score the prompt's tokens, up to the last prompt token's (it emits)
                low, high = max(start, first), min(end, len(state.initial_tokens) - 1)
                if low < high:
                    planned.score_from, planned.score_to, planned.score_top = low, high, state.prompt_logprobs
                    planned.score_targets = tokens[low + 1 : high + 1]
            requests.append(planned)
        return StepPlan(requests, self.copies)


def _priority(state: RequestState) -> int:
    return state.logit_processor_kwargs.get(PRIORITY_KWARG, 0)


def _is_protected(state: RequestState) -> bool:
    """Preempted before, and no new token since: preempting it again would only repeat the same work."""
    return state.num_preemptions > 0 and len(state.generated_tokens) <= state.generated_at_last_preemption


class Scheduler:
    """Owns the waiting queue and the running list; produces one `ScheduledBatch` per step."""

    def __init__(
        self,
        cache: PagedKVCache,
        order: SchedulingOrder,
        max_batch_tokens: int,
        max_requests_per_batch: int,
        safety_margin: float | None = None,
        prompt_scoring_rows: int = 2**31 - 1,
    ) -> None:
        """`prompt_scoring_rows`: the most prompt tokens a request with `prompt_logprobs` runs in one step (each
        such row's logits are kept, `[rows, vocab]`: the cap bounds that memory)."""
        self.cache = cache
        self.prompt_scoring_rows = prompt_scoring_rows
        self.order = order
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.safety_margin = order.default_safety_margin if safety_margin is None else safety_margin
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # in admission order: the last one is preempted first
        # Counters, read by tests, benchmarks and `ContinuousBatchingManager.stats()`.
        self.num_prefix_hit_tokens = 0
        self.num_preemptions = 0
        self.num_deferred_admissions = 0
        self.num_swap_preemptions = 0

    # ---- queue management --------------------------------------------------------------------------------------

    def add(self, state: RequestState) -> None:
        """Queue a validated request: behind every waiting request of its priority or a more urgent one."""
        priority = _priority(state)
        if not self.waiting or _priority(self.waiting[-1]) <= priority:
            self.waiting.append(state)  # the common case (equal priorities): arrival order
            return
        index = next(i for i, other in enumerate(self.waiting) if _priority(other) > priority)
        self.waiting.insert(index, state)

    def _requeue(self, state: RequestState) -> None:
        """Put a preempted request back first among its priority (before later arrivals of the same priority)."""
        priority = _priority(state)
        index = next((i for i, other in enumerate(self.waiting) if _priority(other) >= priority), len(self.waiting))
        self.waiting.insert(index, state)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def live_requests(self) -> list[RequestState]:
        """Every request the scheduler holds."""
        return list(self.waiting) + self.running

    def finish(self, state: RequestState) -> None:
        """Forget a request that ended (finished, failed, cancelled) and release its blocks."""
        if state in self.running:
            self.running.remove(state)
        elif state in self.waiting:
            self.waiting.remove(state)
        self.cache.release(state)

    # ---- the step ----------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Choose this step's requests and token counts, allocating (or preempting for) the blocks they need."""
        batch = ScheduledBatch()
        token_budget = self.max_batch_tokens
        scheduled: set[int] = set()  # ids of states already in the batch: never chosen as preemption victims

        for state in [s for s in self.running if s.num_children and s.num_uncomputed_tokens == 1]:
            if state not in batch.preempted:  # not preempted by an earlier fork
                self._fork(state, batch)

        page = self.cache.page_size
        order = self.order.running_order(self.running)
        if any(_priority(state) for state in order):
            order.sort(key=_priority)  # stable: the policy's order within a priority
        for state in order:
            if token_budget == 0 or len(batch.requests) == self.max_requests_per_batch:
                break
            if batch.preempted and state in batch.preempted:  # preempted earlier in this loop (identity comparison)
                continue
            num_tokens = self._chunk(state, min(self._tokens_before_fork(state), token_budget))
            if num_tokens == 0:  # waits for its children to be forked (next step)
                continue
            end = state.num_computed_tokens + num_tokens
            # Most decode steps stay inside the request's last block: no block to find, nobody to preempt.
            fits = -(-end // page) <= len(state.block_table)
            if not fits and not self._make_room(state, end, scheduled, batch):
                continue
            batch.requests.append(ScheduledRequest(state, num_tokens))
            scheduled.add(id(state))
            token_budget -= num_tokens

        self._admit_waiting(batch, token_budget, scheduled)
        batch.copies = self.cache.take_copies()
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, token_budget: int, scheduled: set[int]) -> None:
        """Admit queued requests in arrival order while budgets last. A request that cannot get its blocks stops
        admission (it is never overtaken for memory); a request whose next prompt blocks a running prefill is about
        to compute waits for them instead (it is skipped, and shares them next time)."""
        for state in list(self.waiting):
            if token_budget == 0 or len(batch.requests) >= self.max_requests_per_batch:
                break
            if batch.requests and not self._within_safety_margin():
                break  # keep headroom for the running requests' growth
            swapped = bool(state.host_blocks)
            slots = self.cache.state_slots
            if slots is not None and not slots.can_take(state):
                break  # waits for a state slot (a running request's end frees one)
            if (not swapped and self.cache.allow_prefix_sharing and state.next_prompt_row is None
                    and self._prefix_in_flight(state)):
                self.num_deferred_admissions += 1
                continue
            hit_tokens = 0
            if swapped:
                num_tokens = self._chunk(state, min(self._tokens_before_fork(state), token_budget))
                if not self.cache.can_grow(state, state.num_computed_tokens + num_tokens):
                    break
                self.cache.swap_in(state, state.num_computed_tokens + num_tokens)
            else:
                # A pure lookup: nothing is referenced or counted unless the request is admitted now. The hit counts
                # the host tier's blocks too: each comes back into a fresh device block, which the admission reserves.
                hit = self.cache.peek_prefix(state)
                shared = hit.num_blocks * self.cache.page_size
                end = shared + self._chunk(state, min(self._tokens_before_fork(state) - shared, token_budget))
                if not self.cache.can_admit(hit, end):
                    break  # it waits at the head of the queue; the next step looks again
                hit_tokens = self.cache.take_prefix(state, hit)
                # Never past the end reserved for: the take may skip fewer tokens than the peek saw.
                num_tokens = min(end - state.num_computed_tokens, token_budget)
                self.cache.grow(state, state.num_computed_tokens + num_tokens)
            if slots is not None:
                slots.take(state)
            self.waiting.remove(state)
            self.num_prefix_hit_tokens += hit_tokens
            state.num_prefix_hit_tokens = hit_tokens
            if state.status == RequestStatus.PENDING:
                state.status = RequestStatus.PREFILLING
            self.running.append(state)
            if num_tokens:  # zero: a parent whose prompt is all cached but its last token forks first, next step
                batch.requests.append(ScheduledRequest(state, num_tokens))
                scheduled.add(id(state))
                token_budget -= num_tokens

    def _prefix_in_flight(self, state: RequestState) -> bool:
        """Whether a running request is computing full prompt blocks that `state` could share but that are not in
        the prefix cache yet. transformers hashes blocks only after the forward, so requests arriving together each
        compute their shared prefix; here the later ones wait until the first one's blocks are committed, then
        share them (`peek_prefix` / `take_prefix`). Only prefilling requests are compared, first token first, so this is cheap."""
        page = self.cache.page_size
        shareable_blocks = (state.num_tokens - 1) // page
        if shareable_blocks == 0:
            return False
        tokens = state.all_tokens
        for other in self.running:
            if other.num_computed_tokens >= shareable_blocks * page or not is_prefilling(other):
                continue
            if other.all_tokens[0] != tokens[0]:
                continue
            shared = 0
            while shared < shareable_blocks and (shared + 1) * page <= other.num_tokens and (
                other.all_tokens[shared * page : (shared + 1) * page] == tokens[shared * page : (shared + 1) * page]
            ):
                shared += 1
            if shared and other.num_computed_tokens < shared * page:
                return True
        return False

    def _chunk(self, state: RequestState, num_tokens: int) -> int:
        """`num_tokens`, capped for a request still scoring its prompt (`prompt_scoring_rows`)."""
        if state.prompt_logprobs is not None and state.next_prompt_row is not None:
            return min(num_tokens, self.prompt_scoring_rows)
        return num_tokens

    @staticmethod
    def _tokens_before_fork(state: RequestState) -> int:
        """Tokens the request may run now: a parent with children to fork stops before its last prompt token, so
        every child shares the prompt's K/V and computes that last token (and samples) on its own."""
        return state.num_uncomputed_tokens - (1 if state.num_children else 0)

    def _fork(self, parent: RequestState, batch: ScheduledBatch) -> None:
        """Create the parent's `num_return_sequences - 1` children, sharing its computed blocks (a partial last
        block is copied: copy on write), right after it in admission order."""
        blocks_needed = parent.num_children * self.cache.blocks_to_fork(parent)
        while self.cache.allocator.num_available < blocks_needed:
            victim = next((r for r in reversed(self.running) if r is not parent), None)
            if victim is None:
                self.running.remove(parent)
                batch.failed.append((parent, (
                    f"num_return_sequences={parent.num_children + 1} needs {blocks_needed} more blocks to fork its "
                    f"children, but the cache has {self.cache.num_blocks} blocks in all; raise num_blocks"
                )))
                return
            self._preempt(victim, batch)
        position = self.running.index(parent) + 1
        for index in range(parent.num_children):
            if index in parent.cancelled_children:  # cancelled before its fork; it already has its output
                continue
            child = parent.fork_child(child_request_id(parent.request_id, index))
            if SEED_KWARG in child.logit_processor_kwargs:  # each child draws its own reproducible sequence
                child.logit_processor_kwargs[SEED_KWARG] += index + 1
            self.cache.fork(parent, child)
            self.running.insert(position, child)
            position += 1
            batch.forked.append(child)
        parent.num_children = 0
        if self.cache.state_slots is not None:  # slots reserved for children cancelled before their fork
            self.cache.state_slots.release_reserved(parent)

    def _within_safety_margin(self) -> bool:
        available = self.cache.allocator.num_available
        return available >= self.safety_margin * self.cache.num_blocks

    def _make_room(self, state: RequestState, num_tokens: int, scheduled: set[int], batch: ScheduledBatch) -> bool:
        """Grow `state` to `num_tokens` tokens, preempting the most recently admitted unscheduled requests if needed.

        Returns False when `state` cannot run this step; it is then preempted itself (others hold the blocks), or
        waits holding its blocks if it is protected from preemption, or, when it alone exceeds the whole cache, is
        listed in `filled_the_cache` (it ends FINISHED, bounded by the cache's capacity).
        """
        while not self.cache.can_grow(state, num_tokens):
            victim = self._choose_victim(state, scheduled)
            if victim is None:
                break
            self._preempt(victim, batch)
        if self.cache.can_grow(state, num_tokens):
            self.cache.grow(state, num_tokens)
            return True
        if len(self.running) == 1 and not scheduled:
            self.running.remove(state)
            batch.filled_the_cache.append(state)
        elif not _is_protected(state):
            self._preempt(state, batch)
        # A protected request keeps its blocks and waits: the requests in this step will free some.
        return False

    def _choose_victim(self, state: RequestState, scheduled: set[int]) -> RequestState | None:
        """Policy: the most recently admitted request not already in this step's batch, among the least urgent
        (highest `priority`) first and never one more urgent than `state`, skipping requests that were preempted
        before and have not generated a token since (so a request cannot thrash). A request that is itself protected
        may preempt protected ones: someone must make progress. None: `state` should yield instead."""
        priority = _priority(state)
        candidates = [r for r in reversed(self.running)
                      if r is not state and id(r) not in scheduled and _priority(r) >= priority]
        candidates.sort(key=_priority, reverse=True)  # stable: most recently admitted first within a priority
        for candidate in candidates:
            if not _is_protected(candidate):
                return candidate
        if _is_protected(state) and candidates:
            return candidates[0]
        return None

    def _preempt(self, state: RequestState, batch: ScheduledBatch) -> None:
        """Take a running request's blocks and queue it first: swapped out to the host when the cache's swap policy
        says so (it resumes where it was), otherwise released, to be recomputed from its tokens so far."""
        self.running.remove(state)
        # A child forked in this step is recomputed, not swapped: its copy-on-write block is only written by this
        # step's copies, after the swap-outs read their blocks (cbcore/plan.py), so a swap-out would save stale K/V.
        forked_now = any(state is child for child in batch.forked)
        if not forked_now and self.cache.can_swap_out(state):
            self.cache.swap_out(state)
            self.num_swap_preemptions += 1
        else:
            self.cache.release(state)
        state.generated_at_last_preemption = len(state.generated_tokens)
        state.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(state)
        batch.preempted.append(state)

    def recompute(self, state: RequestState) -> None:
        """Send a running request back to the head of its priority in the queue, its blocks and state slot released:
        it computes its tokens so far again (a step's failure left its recurrent state untrustworthy)."""
        self.running.remove(state)
        self.cache.release(state)
        self._requeue(state)

    def on_step_done(self, batch: ScheduledBatch) -> None:
        """Advance every scheduled request past the tokens it just computed and cache its completed blocks."""
        for item in batch.requests:
            item.state.num_computed_tokens += item.num_tokens
            self.cache.commit_full_blocks(item.state)
