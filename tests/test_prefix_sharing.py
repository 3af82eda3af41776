"""Prefix sharing: full blocks already in the prefix cache are reused, not recomputed, and outputs do not change."""

from __future__ import annotations

import cbcore
from conftest import (
    assert_engine_clean,
    collect_outputs,
    greedy_config,
    random_prompts,
    reference_tokens,
    run_engine,
    tiny_model,
)

PAGE = 16
SHARED_BLOCKS = 3


def shared_prefix_workload() -> tuple[list[int], list[list[int]]]:
    """A first prompt, then four more that start with its first three full blocks (48 tokens)."""
    prefix = random_prompts([PAGE * SHARED_BLOCKS], seed=11)[0]
    suffixes = random_prompts([5, 9, 1, 13, 20], seed=12)
    first = prefix + suffixes[0]
    followers = [prefix + suffix for suffix in suffixes[1:]]
    return first, followers


def serve_first_then_followers(allow_block_sharing: bool):
    """Run the first prompt to completion, then the followers together; return outputs and the stopped manager."""
    model = tiny_model("llama_gqa")
    first, followers = shared_prefix_workload()
    config = cbcore.ContinuousBatchingConfig(page_size=PAGE, num_blocks=64, allow_block_sharing=allow_block_sharing)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(8), config)
    manager.start()
    try:
        request_ids = [manager.add_request(first)]
        outputs = collect_outputs(manager, request_ids)
        follower_ids = manager.add_requests(followers)
        outputs.update(collect_outputs(manager, follower_ids))
        request_ids += follower_ids
    finally:
        manager.stop()
    assert_engine_clean(manager)
    return [first] + followers, [outputs[rid] for rid in request_ids], manager


def test_shared_prefix_is_not_recomputed_and_outputs_are_unchanged() -> None:
    prompts, with_sharing, manager_on = serve_first_then_followers(allow_block_sharing=True)
    _, without_sharing, manager_off = serve_first_then_followers(allow_block_sharing=False)

    shared_tokens = PAGE * SHARED_BLOCKS * 4  # each of the 4 followers reuses the first prompt's 3 full blocks
    assert manager_on.prefix_hit_tokens == shared_tokens
    assert manager_off.prefix_hit_tokens == 0
    computed_on = manager_on.stats()["computed_prompt_tokens"]
    computed_off = manager_off.stats()["computed_prompt_tokens"]
    assert computed_off == sum(len(p) for p in prompts)
    assert computed_on == computed_off - shared_tokens

    model = tiny_model("llama_gqa")
    for prompt, on, off in zip(prompts, with_sharing, without_sharing):
        want = reference_tokens(model, prompt, greedy_config(8))
        assert on.generated_tokens == want
        assert off.generated_tokens == want


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    """A prompt made only of cached full blocks shares all but the last block, so its last position gives logits."""
    model = tiny_model("qwen2")
    prompt = random_prompts([PAGE * 2], seed=5)[0]
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(6), cbcore.ContinuousBatchingConfig(page_size=PAGE, num_blocks=16))
    manager.start()
    try:
        first = collect_outputs(manager, [manager.add_request(prompt)])
        second = collect_outputs(manager, [manager.add_request(prompt)])
    finally:
        manager.stop()
    assert manager.prefix_hit_tokens == PAGE  # one block of two: the last one is recomputed
    want = reference_tokens(model, prompt, greedy_config(6))
    assert list(first.values())[0].generated_tokens == want
    assert list(second.values())[0].generated_tokens == want
    assert_engine_clean(manager)


def test_cached_blocks_are_evicted_for_new_requests_when_memory_runs_out() -> None:
    """Blocks left in the prefix cache never block new work: they are evicted (LRU) when free blocks run out."""
    model = tiny_model("llama_gqa")
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=12)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(4), config)
    manager.start()
    try:
        for prompt in random_prompts([30, 31, 29, 33], seed=21):  # each fills most of the cache on its own
            output = collect_outputs(manager, [manager.add_request(prompt)])
            assert list(output.values())[0].generated_tokens == reference_tokens(model, prompt, greedy_config(4))
    finally:
        manager.stop()
    assert manager.cache.allocator.stats()["evictions"] > 0
    assert_engine_clean(manager)


def test_requests_arriving_together_compute_their_shared_prefix_once() -> None:
    """transformers hashes blocks only after the forward, so requests admitted together each compute the prefix;
    cbcore admits the first and lets the others start from its blocks once they are committed."""
    model = tiny_model("qwen2")
    first, followers = shared_prefix_workload()
    prompts = [first] + followers
    config = cbcore.ContinuousBatchingConfig(page_size=PAGE, num_blocks=64)
    outputs, manager = run_engine(model, prompts, greedy_config(6), config)
    stats = manager.stats()
    assert stats["computed_prompt_tokens"] == sum(len(p) for p in prompts) - PAGE * SHARED_BLOCKS * (len(prompts) - 1)
    assert stats["prefix_hit_tokens"] == PAGE * SHARED_BLOCKS * (len(prompts) - 1)
    assert stats["deferred_admissions"] > 0
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(6))


def test_stats_report_blocks_and_prefix_hits() -> None:
    _, outputs, manager = serve_first_then_followers(allow_block_sharing=True)
    stats = manager.stats()
    assert stats["blocks_used"] == 0
    assert stats["blocks_free"] + stats["blocks_cached"] == stats["num_blocks"] == 64
    assert stats["prefix_hits"] == SHARED_BLOCKS * 4
    assert 0 < stats["prefix_hit_rate"] <= 1
    assert stats["generated_tokens"] == sum(len(output.generated_tokens) for output in outputs)
    assert stats["recomputed_tokens"] == 0 and stats["preemptions"] == 0


def test_a_request_waiting_at_the_head_of_the_queue_is_looked_up_once_when_admitted() -> None:
    """The prefix lookup is pure until admission: a request that waits many steps for memory does not inflate
    `prefix_lookups` / `prefix_hits`, nor reorder the cache's LRU list, while it waits."""
    from cbcore.engine import EngineCore
    from cbcore.requests import RequestState

    model = tiny_model("llama_gqa")
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(8),
                                               # No safety margin: the waiter reaches the prefix lookup every
                                               # step (a margin would stop admission before it).
                                               cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=14,
                                                                               safety_margin=0.0))
    manager.warmup()
    engine: EngineCore = manager.engine
    engine.binding.attach()
    try:
        prefix = random_prompts([8], seed=13)[0]
        engine.add_request(RequestState("warm", prefix + [5], max_new_tokens=1, eos_token_id=-1))
        while engine.has_work():
            engine.step()  # its two full blocks are now cached and unused
        # The hog takes 11 of the 12 free blocks (and the 12th as it grows); the waiter needs two fresh blocks
        # besides its two cached ones, so it waits until the hog ends.
        hog = RequestState("hog", random_prompts([44], seed=14)[0], max_new_tokens=4, eos_token_id=-1)
        waiter = RequestState("waiter", prefix + [7, 9, 11, 13, 15, 17], max_new_tokens=2, eos_token_id=-1)
        engine.add_request(hog)
        engine.add_request(waiter)
        engine.step()  # admits the hog (one lookup: a miss); the waiter cannot fit
        assert hog.block_table and not waiter.block_table
        before = engine.stats()
        waited = 0
        while not waiter.block_table:
            engine.step()  # the hog holds the cache: the waiter is looked at every step, admitted only at the end
            waited += 1
        after = engine.stats()
        while engine.has_work():
            engine.step()
    finally:
        engine.binding.detach()
    assert waited >= 3
    assert after["prefix_lookups"] - before["prefix_lookups"] == 3  # its two shared blocks and the miss after them
    assert after["prefix_hits"] - before["prefix_hits"] == 2
    assert waiter.num_prefix_hit_tokens == 8
    engine.check()


def test_a_weight_change_forgets_prefixes_that_running_requests_still_hold() -> None:
    """After a weight change no K/V computed before is shared, even from blocks a running request holds, nor is any
    block committed chained on them; the holder keeps its own K/V (one prefix index: the C++ allocator's)."""
    import torch

    from cbcore.cache import PagedKVCache
    from cbcore.cache_shape import CacheShape
    from cbcore.requests import RequestState

    cache = PagedKVCache(CacheShape(1, 1, 8, torch.float32), num_blocks=8, page_size=2, device=torch.device("cpu"))
    holder = RequestState(request_id="holder", initial_tokens=[1, 2, 3, 4, 5, 6, 7], max_new_tokens=4)
    cache.grow(holder, 4)
    holder.num_computed_tokens = 4
    cache.commit_full_blocks(holder)
    follower = RequestState(request_id="follower", initial_tokens=[1, 2, 3, 4, 9], max_new_tokens=4)
    assert len(cache.peek_prefix(follower).blocks) == 2  # shared before the change
    assert cache.invalidate_prefixes() == 2
    assert cache.peek_prefix(follower).blocks == ()
    holder.num_computed_tokens = 6  # its next block completes after the change
    cache.grow(holder, 6)
    cache.commit_full_blocks(holder)
    assert cache.allocator.num_cached == 0  # chained on forgotten K/V: never committed
    cache.check([holder])
    cache.release(holder)
    assert cache.allocator.num_free == 8
