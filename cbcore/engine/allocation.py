"""Allocating what an engine holds besides its KV pages: the stateful layers' state pool and the host pool for swap,
each sized from the config, with an error that says which option to change when the memory is not there."""

from __future__ import annotations

import logging

import torch

from ..cache import PagedKVCache
from ..cache_shape import CacheShape
from ..config import ContinuousBatchingConfig
from ..distributed.group import TensorParallelGroup
from ..state_layers import StatePool
from .sizing import allocation_error, gib, plan_num_host_blocks

logger = logging.getLogger("cbcore")


def allocate_state_pool(specs, num_slots: int, device: torch.device) -> StatePool | None:
    """The stateful layers' states for `num_slots` running requests (None for a model without such layers)."""
    if not specs:
        return None
    try:
        pool = StatePool(specs, num_slots, device)
    except (RuntimeError, MemoryError) as error:
        needed = num_slots * StatePool.bytes_per_slot(specs)
        option = f"max_requests_per_batch (state slots: {num_slots})"
        raise allocation_error(f"state pool of {num_slots} slots", option, needed, device, error) from error
    logger.info(f"cbcore: state pool of {num_slots} slots ({gib(pool.nbytes)} GiB, "
                f"{StatePool.bytes_per_slot(specs)} bytes per request over {len(pool.layers)} stateful layers)")
    return pool


def enable_swap(cache: PagedKVCache, shape: CacheShape, cfg: ContinuousBatchingConfig,
                tensor_parallel: TensorParallelGroup | None) -> None:
    """Give `cache` the host pool `cpu_offload_space` asks for (the smallest over the ranks under tensor
    parallelism); a ValueError or an allocation error saying what to change when it cannot."""
    bytes_per_block = shape.bytes_per_token * cfg.page_size
    plan = plan_num_host_blocks(cfg.cpu_offload_space, cfg.cpu_offload_space_safety_threshold, bytes_per_block)
    num_host_blocks = plan.num_blocks
    if tensor_parallel is not None:
        (num_host_blocks,) = tensor_parallel.agree_min([num_host_blocks], "the number of host blocks")
    if num_host_blocks < 1:
        raise ValueError(
            f"cpu_offload_space={cfg.cpu_offload_space} GiB holds no block of {bytes_per_block} bytes (after the "
            "cpu_offload_space_safety_threshold cap and what memory is available); raise it or set it to 0 to "
            "disable swap"
        )
    try:
        cache.enable_swap(num_host_blocks)
    except NotImplementedError:  # a cache shape the pool cannot hold: its own message says what to set
        raise
    except (RuntimeError, MemoryError) as error:  # torch raises RuntimeError when the pool's allocation fails
        raise allocation_error(f"host pool of {num_host_blocks} blocks",
                               f"cpu_offload_space={cfg.cpu_offload_space}", num_host_blocks * bytes_per_block,
                               torch.device("cpu"), error) from error
    size = f"host pool of {num_host_blocks} blocks ({gib(num_host_blocks * bytes_per_block)} GiB)"
    if plan.capped_by is not None:
        logger.warning(f"cbcore: cpu_offload_space={cfg.cpu_offload_space} GiB capped to a {size} by "
                       f"{plan.capped_by}")
    else:
        logger.info(f"cbcore: {size} for cpu_offload_space={cfg.cpu_offload_space}")
