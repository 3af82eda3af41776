"""Swap to host under memory pressure: preempted requests are copied out and back in instead of recomputed, on a
machine without a GPU too; outputs never change, nothing fails, nothing leaks (allocator and host pool checked)."""

from __future__ import annotations

import pytest

import cbcore
from cbcore.swap import SwapPolicy
from conftest import greedy_config, random_prompts, reference_tokens, run_engine, tiny_model

# 10 blocks of 4 tokens for 10 requests of up to 22 + 12 tokens: far too small to hold them together.
TIGHT = dict(page_size=4, num_blocks=10, max_batch_tokens=32)
PROMPT_LENGTHS = [5, 12, 9, 17, 3, 22, 8, 14, 11, 6]


def serve(swap: bool):
    model = tiny_model("llama_gqa")
    prompts = random_prompts(PROMPT_LENGTHS, seed=80)
    config = cbcore.ContinuousBatchingConfig(**TIGHT, cpu_offload_space=0.01 if swap else 0.0)
    outputs, manager = run_engine(model, prompts, greedy_config(12), config)
    for prompt, output in zip(prompts, outputs.values()):
        assert output.status == cbcore.RequestStatus.FINISHED, output.error
        assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(12))
    return outputs, manager.stats()


def test_swap_keeps_outputs_and_recomputes_nothing_while_the_pool_has_room() -> None:
    _, stats = serve(swap=True)
    assert stats["preemptions"] > 0
    assert stats["swap_preemptions"] == stats["preemptions"]
    assert stats["swap_outs"] == stats["swap_ins"] == stats["preemptions"]
    assert stats["swap_bytes_out"] == stats["swap_bytes_in"] > 0
    assert stats["recomputed_tokens"] == 0
    assert stats["host_blocks_free"] == stats["host_blocks"]


def test_without_swap_the_same_outputs_come_from_recompute() -> None:
    with_swap, _ = serve(swap=True)
    without_swap, stats = serve(swap=False)
    assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0
    assert "swap_outs" not in stats
    assert [o.generated_tokens for o in with_swap.values()] == [o.generated_tokens for o in without_swap.values()]


def test_a_full_host_pool_falls_back_to_recompute() -> None:
    model = tiny_model("llama_gqa")
    prompts = random_prompts(PROMPT_LENGTHS, seed=80)
    bytes_per_block = 2 * 2 * 4 * 2 * 16 * 4  # K+V x layers x page x kv_heads x head_dim x fp32
    config = cbcore.ContinuousBatchingConfig(**TIGHT, cpu_offload_space=2 * bytes_per_block / 2**30)
    outputs, manager = run_engine(model, prompts, greedy_config(12), config)
    stats = manager.stats()
    assert stats["host_blocks"] == 2
    assert stats["recompute_preemptions"] > 0  # requests needing more than 2 host blocks were recomputed
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(12))


def test_cancelling_a_swapped_out_request_frees_its_host_blocks() -> None:
    model = tiny_model("llama_gqa")
    manager = cbcore.ContinuousBatchingManager(
        model, greedy_config(40), cbcore.ContinuousBatchingConfig(**TIGHT, cpu_offload_space=0.01)
    )
    manager.start()
    try:
        ids = manager.add_requests(random_prompts(PROMPT_LENGTHS, seed=81))
        for request_id in ids[::2]:
            manager.cancel_request(request_id)
        finals = {}
        while len(finals) < len(ids):
            output = manager.get_result(timeout=60)
            assert output is not None
            if output.is_finished():
                finals[output.request_id] = output
    finally:
        manager.stop()
    manager.check_invariants()
    assert manager.stats()["host_blocks_free"] == manager.stats()["host_blocks"]


def test_policy_swaps_when_copying_beats_recomputing() -> None:
    policy = SwapPolicy(bytes_per_token=1000, host_copy_bytes_per_s=1e9)  # 2 us per token for out + in
    assert policy.prefer_swap(num_tokens=100, num_block_tokens=112)  # nothing measured yet: swap
    policy.observe_prefill(num_tokens=1000, seconds=0.1)  # 10k tokens/s: 100 us per token to recompute
    assert policy.prefer_swap(num_tokens=100, num_block_tokens=112)
    policy = SwapPolicy(bytes_per_token=1000, host_copy_bytes_per_s=1e9)
    policy.observe_prefill(num_tokens=10_000_000, seconds=1.0)  # a fast accelerator: 0.1 us per token
    assert not policy.prefer_swap(num_tokens=100, num_block_tokens=112)


def test_offload_space_too_small_for_one_block_is_a_clear_error() -> None:
    manager = cbcore.ContinuousBatchingManager(
        tiny_model("qwen2"), greedy_config(3), cbcore.ContinuousBatchingConfig(page_size=4, cpu_offload_space=1e-9)
    )
    with pytest.raises(ValueError, match="cpu_offload_space"):
        manager.warmup()


TRANSFORMERS_OFFLOAD_SCRIPT = """
import sys
from transformers import ContinuousBatchingConfig
from conftest import greedy_config, random_prompts, tiny_model
model = tiny_model("llama_gqa")
try:
    type(model).generate_batch(model, random_prompts([5, 9], seed=82), generation_config=greedy_config(4),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=8, cpu_offload_space=0.01))
except RuntimeError as error:
    print("raised:", error)
    sys.exit(0)
sys.exit(1)
"""


def test_offload_works_without_a_gpu_where_transformers_raises_at_start_up() -> None:
    import subprocess
    import sys
    from pathlib import Path

    import torch

    model = tiny_model("llama_gqa")
    prompts = random_prompts([5, 9], seed=82)
    if not torch.cuda.is_available():
        # In a fresh process: transformers pins its pool through CUDA, which fails without a driver (an earlier
        # import of a CUDA extension in this process may have changed what pinning does).
        result = subprocess.run([sys.executable, "-c", TRANSFORMERS_OFFLOAD_SCRIPT], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
    cbcore.enable(model)
    outputs = model.generate_batch(prompts, generation_config=greedy_config(4),
                                   continuous_batching_config=cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=8,
                                                                                              cpu_offload_space=0.01))
    for prompt, output in zip(prompts, outputs.values()):
        assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(4))


def test_an_evicted_prefix_comes_back_from_the_host_tier_with_unchanged_output() -> None:
    model = tiny_model("llama_gqa")
    prefix = random_prompts([24], seed=83)[0]  # 6 full blocks of 4
    first, later = prefix + [7, 8], prefix + [9]
    fillers = random_prompts([30, 29], seed=84)  # each needs most of the 12-block cache: the prefix gets evicted
    config = cbcore.ContinuousBatchingConfig(page_size=4, num_blocks=12, cpu_offload_space=0.01)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(4), config)
    manager.start()
    try:
        outputs = {}
        for prompt in [first, *fillers, later]:
            request_id = manager.add_request(prompt)
            outputs[request_id] = (prompt, manager.get_result(request_id, timeout=60))
    finally:
        manager.stop()
    manager.check_invariants()
    stats = manager.stats()
    assert stats["evictions"] > 0 and stats["host_tier_kept"] > 0
    assert stats["host_tier_hits"] == 6  # the later request's whole shared prefix came back from the host
    assert stats["prefix_hit_tokens"] >= 24
    for prompt, output in outputs.values():
        assert output.status == cbcore.RequestStatus.FINISHED
        assert output.generated_tokens == reference_tokens(model, prompt, greedy_config(4))


def test_a_block_evicted_into_the_host_tier_and_reused_by_a_fork_keeps_its_old_kv_in_the_tier() -> None:
    """One step can evict a cached prefix block into the host tier (a copy out) and hand the same block to a fork's
    copy-on-write (a copy in): the copy out must read the old K/V first, or the tier would keep the parent's partial
    block under the prefix's tokens and a later hit would bring back wrong K/V."""
    import torch

    from cbcore.cache import PagedKVCache
    from cbcore.cache_shape import CacheShape
    from cbcore.requests import RequestState
    from cbcore.runner import ModelRunner

    cache = PagedKVCache(CacheShape(1, 1, 8, torch.float32), num_blocks=3, page_size=4, device=torch.device("cpu"))
    cache.enable_swap(num_host_blocks=2)
    runner = ModelRunner(torch.nn.Identity(), cache, sampler=None)

    def computed(request_id: str, tokens: list[int], value: float) -> RequestState:
        state = RequestState(request_id=request_id, initial_tokens=tokens, max_new_tokens=4)
        cache.grow(state, len(tokens))
        for block in state.block_table:
            for pages in cache.key_caches + cache.value_caches:
                pages[block] = value
        state.num_computed_tokens = len(tokens)
        cache.commit_full_blocks(state)
        return state

    prefix = computed("prefix", [1, 2, 3, 4], value=7.0)  # one full block, cached once released
    prefix_block = prefix.block_table[0]
    cache.release(prefix)
    parent = computed("parent", [5, 6, 7, 8, 9, 10], value=3.0)  # a full block and a partial one
    child = RequestState(request_id="child", initial_tokens=parent.initial_tokens, max_new_tokens=4)
    cache.fork(parent, child)  # no free block: evicts the prefix's block into the tier and copies into it
    copies = cache.take_copies()
    assert child.block_table[-1] == prefix_block and copies.device_to_host and copies.device_to_device
    runner.copy_blocks(copies)
    assert torch.all(cache.key_caches[0][prefix_block] == 3.0)  # the child's copy of the parent's partial block

    cache.release(parent)
    cache.release(child)
    again = RequestState(request_id="again", initial_tokens=[1, 2, 3, 4, 11], max_new_tokens=4)
    hit = cache.peek_prefix(again)
    assert cache.take_prefix(again, hit) == 4  # brought back from the host tier
    runner.copy_blocks(cache.take_copies())
    brought_back = again.block_table[0]
    assert torch.all(cache.key_caches[0][brought_back] == 7.0) and torch.all(cache.value_caches[0][brought_back] == 7.0)
    cache.release(again)
    cache.check([])


def _scheduler_with_a_prefix_in_the_host_tier():
    """A cache of 8 blocks whose 2-block prefix was evicted into the host tier, 5 blocks held by another request (3
    available), and a scheduler of 8 tokens a step over it; returns (cache, scheduler, the holder, the prefix)."""
    import torch

    from cbcore.cache import PagedKVCache
    from cbcore.cache_shape import CacheShape
    from cbcore.requests import RequestState
    from cbcore.scheduler import Scheduler
    from cbcore.scheduling_orders import FifoOrder

    cache = PagedKVCache(CacheShape(1, 1, 8, torch.float32), num_blocks=8, page_size=4, device=torch.device("cpu"))
    cache.enable_swap(num_host_blocks=8)

    def holding(request_id: str, tokens: list[int], computed: bool) -> RequestState:
        state = RequestState(request_id=request_id, initial_tokens=tokens, max_new_tokens=4)
        cache.grow(state, len(tokens))
        if computed:
            state.num_computed_tokens = len(tokens)
            cache.commit_full_blocks(state)
        return state

    prefix = list(range(1, 9))
    cache.release(holding("owner", prefix, computed=True))  # its two blocks cached, unused
    cache.release(holding("filler", [50] * 32, computed=False))  # took all 8 blocks: the prefix went to the host tier
    cache.take_copies()
    holder = holding("holder", [60] * 20, computed=False)
    assert cache.swap.tier.num_blocks == 2 and cache.allocator.num_available == 3
    scheduler = Scheduler(cache, FifoOrder(), max_batch_tokens=8, max_requests_per_batch=8, safety_margin=0.0)
    return cache, scheduler, holder, prefix


def test_a_prefix_in_the_host_tier_counts_in_the_admission_of_the_blocks_it_comes_back_into() -> None:
    """Its 2 blocks come back into fresh device blocks, and the 8 tokens after them need 2 more: 4 in all, with 3
    available, so the request waits. Admitting it on the device hit alone (none) and then running a full budget past
    the brought-back blocks asked the allocator for blocks nobody had reserved, and the loop died."""
    from cbcore.requests import RequestState

    cache, scheduler, holder, prefix = _scheduler_with_a_prefix_in_the_host_tier()
    later = RequestState(request_id="later", initial_tokens=prefix + list(range(20, 32)), max_new_tokens=4)
    hit = cache.peek_prefix(later)
    assert (hit.blocks, hit.num_host_blocks) == ((), 2)
    scheduler.add(later)
    batch = scheduler.schedule()
    assert batch.requests == [] and scheduler.waiting[0] is later
    assert later.block_table == [] and cache.swap.tier.num_blocks == 2  # nothing taken
    cache.check([holder, later])


def test_a_prefix_brought_back_from_the_host_tier_runs_the_token_budget_after_it() -> None:
    from cbcore.requests import RequestState

    cache, scheduler, holder, prefix = _scheduler_with_a_prefix_in_the_host_tier()
    cache.release(holder)
    later = RequestState(request_id="later", initial_tokens=prefix + list(range(20, 32)), max_new_tokens=4)
    scheduler.add(later)
    (item,) = scheduler.schedule().requests
    assert later.num_computed_tokens == 8 and item.num_tokens == 8  # tokens 8..15: the budget after the prefix
    assert len(later.block_table) == 4 and cache.swap.tier.counters["host_tier_hits"] == 2
    cache.check([later])
