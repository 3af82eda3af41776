"""An engine's counters, gathered from its parts for `ContinuousBatchingManager.stats()`."""

from __future__ import annotations

from typing import Any


def engine_stats(core: Any) -> dict[str, int | float]:
    """The counters of `ContinuousBatchingManager.stats()` (see there), from the `EngineCore`'s own counters, its
    allocator, scheduler, sampler, host pool and state slots."""
    stats: dict[str, int | float] = dict(core.counters)
    allocator = core.cache.allocator.stats()
    scheduler = core.scheduler
    stats.update(
        num_blocks=core.cache.num_blocks,
        blocks_free=allocator["num_free"],
        blocks_cached=allocator["num_cached_unused"],
        blocks_used=allocator["num_referenced"],
        prefix_lookups=allocator["lookups"],
        prefix_hits=allocator["hits"],
        prefix_hit_rate=allocator["hits"] / allocator["lookups"] if allocator["lookups"] else 0.0,
        prefix_hit_tokens=scheduler.num_prefix_hit_tokens,
        evictions=allocator["evictions"],
        preemptions=scheduler.num_preemptions,
        swap_preemptions=scheduler.num_swap_preemptions,
        recompute_preemptions=scheduler.num_preemptions - scheduler.num_swap_preemptions,
        deferred_admissions=scheduler.num_deferred_admissions,
        structured_output_steps=core.runner.sampler.masked_steps,
        structured_output_mask_seconds=core.runner.sampler.mask_seconds,
    )
    swap = core.cache.swap
    if swap is not None:
        stats.update(swap.counters)
        stats.update(swap.tier.counters)
        stats.update(host_blocks=swap.num_host_blocks, host_blocks_free=swap.num_free,
                     host_tier_blocks=swap.tier.num_blocks)
    slots = core.cache.state_slots
    if slots is not None:
        stats.update(state_slots=slots.num_slots, state_slots_free=slots.num_free,
                     state_bytes=core.state_pool.nbytes)
    return stats
