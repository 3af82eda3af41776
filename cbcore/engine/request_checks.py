"""What the engine checks of a request or a step before it runs: a new request's prompt against the vocabulary, the
cache and the model's positions (the problem ends that request alone), and, in debug mode, that every block a step
writes is its request's alone."""

from __future__ import annotations

from ..cache import PagedKVCache
from ..requests import RequestState
from ..sampling_controls import token_problem
from ..scheduler import ScheduledBatch


def prompt_problem(state: RequestState, vocab: int, position_limit: int | None, cache: PagedKVCache,
                   model_name: str) -> str | None:
    """What is wrong with a new request's prompt, or None (an unbounded request's token limit is then set to the
    end of the model's position table). The arguments' types were checked by `add_request`, so nothing here can
    raise."""
    prompt = state.initial_tokens
    if not prompt:
        return "empty prompt: input_ids must hold at least one token"
    bad = next((t for t in prompt if t < 0 or t >= vocab), None)
    if bad is not None:
        return f"token id {bad} is outside the vocabulary [0, {vocab})"
    problem = token_problem(state.sampling_controls, vocab)
    if problem is not None:
        return problem
    if state.grammar_problem is not None:
        return state.grammar_problem
    capacity = cache.capacity_tokens
    if len(prompt) > capacity:
        return (
            f"prompt has {len(prompt)} tokens, but the cache holds at most {capacity} tokens per request "
            f"(num_blocks={cache.num_blocks} x page_size={cache.page_size}); raise num_blocks or shorten the prompt"
        )
    # A longer max_new_tokens is accepted, as transformers accepts it: the request ends FINISHED when it alone
    # fills the cache (the scheduler's `filled_the_cache`).
    if position_limit is not None:
        # Positions 0 .. len(prompt) + max_new_tokens - 2 are fed (the last token is never fed back).
        longest = len(prompt) + (state.max_new_tokens - 1 if state.max_new_tokens is not None else 0)
        if longest > position_limit:
            return (
                f"prompt has {len(prompt)} tokens and may generate {state.max_new_tokens} more, but "
                f"{model_name} has {position_limit} positions; shorten the prompt or lower max_new_tokens"
            )
        if state.max_new_tokens is None:  # unbounded: end at the end of the position table
            state.new_tokens_limit = min(state.new_tokens_limit, position_limit - len(prompt) + 1)
    return None


def check_step_writes(batch: ScheduledBatch, cache: PagedKVCache) -> None:
    """Debug mode: every block the step writes is inside the cache, in its request's table, and held by that
    request alone (a shared block written would corrupt another request's K/V: copy-on-write must have run)."""
    page, allocator = cache.page_size, cache.allocator
    for item in batch.requests:
        state = item.state
        start, end = state.num_computed_tokens, state.num_computed_tokens + item.num_tokens
        if cache.blocks_for(end) > len(state.block_table):
            raise AssertionError(f"{state.request_id}: {end} tokens but {len(state.block_table)} blocks")
        for block in state.block_table[start // page : cache.blocks_for(end)]:
            if not 0 <= block < cache.num_blocks or allocator.refcount(block) != 1:
                raise AssertionError(
                    f"{state.request_id} writes block {block} (refcount "
                    f"{allocator.refcount(block) if 0 <= block < cache.num_blocks else 'n/a'}) this step")
