"""Swap to host: a preempted request's K/V blocks are copied into a host pool and copied back when it resumes,
instead of being recomputed (`cpu_offload_space > 0`). Works on a machine without a GPU (plain memory; pinned when
CUDA is present).

The copies themselves are `cbcore._C.SwapPool` (csrc/swap): many blocks across all layers in one call per direction.
This module owns the host block ids: the scheduler's swap-outs and swap-ins are recorded as block-id pairs in the
step's `BlockCopies` (cbcore/plan.py), which the worker issues once, before the step's forward (swap-outs first, so a
device block freed by a swap-out can receive a swap-in in the same step). Host blocks emptied by a swap-in are reused
only from the next step on, so a swap-out can never overwrite a host block that is still being read.

Who holds a host block:

| holder | takes it | releases it |
|---|---|---|
| a swapped-out request (`RequestState.host_blocks`) | `swap_out()` | `swap_in()` (after the step's copies), or `release()` when it ends while swapped out |

Swap or recompute? `SwapPolicy.prefer_swap` compares the time to copy a request's blocks out and back in (bytes over
the host copy bandwidth measured when the pool is built) with the time to recompute its tokens (tokens over the
prefill throughput the engine measures as it runs). Short contexts on a fast accelerator recompute; long ones, and
almost everything on a CPU (where prefill is slow and memcpy is fast), swap.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from ._C import SwapPool
from .host_tier import HostTier
from .plan import BlockCopies

class SwapPolicy:
    """The swap-or-recompute rule, from two measured rates."""

    def __init__(self, bytes_per_token: int, host_copy_bytes_per_s: float) -> None:
        self.bytes_per_token = bytes_per_token
        self.host_copy_bytes_per_s = host_copy_bytes_per_s
        self.prefill_tokens_per_s: float | None = None  # unknown until the engine has run a prefill

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Fold one step's prefill throughput into the running estimate."""
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        previous = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if previous is None else 0.8 * previous + 0.2 * rate

    def copy_seconds(self, num_block_tokens: int) -> float:
        """Time to copy this many tokens' worth of blocks out and back in."""
        return 2 * num_block_tokens * self.bytes_per_token / self.host_copy_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        """Time to prefill these tokens again, at the measured rate (0 when not measured yet)."""
        return num_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else float("inf")

    def prefer_swap(self, num_tokens: int, num_block_tokens: int) -> bool:
        """Swap when copying the blocks out and in is faster than recomputing the tokens."""
        return self.copy_seconds(num_block_tokens) < self.recompute_seconds(num_tokens)


class HostSwap:
    """Host block ids, the host pool they index, the host tier, and the swap counters."""

    def __init__(
        self,
        num_layers: int,
        num_host_blocks: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        copies: BlockCopies,
    ) -> None:
        self.pool = SwapPool(num_layers, num_host_blocks, page_size, num_kv_heads, head_dim, dtype, None)
        self.num_host_blocks = num_host_blocks
        self.page_size = page_size
        self._key_caches = key_caches
        self._value_caches = value_caches
        self._free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._copies = copies  # this step's copies, shared with the cache (see copies_planned)
        self.bytes_per_block = self.pool.nbytes // num_host_blocks
        self.counters = {"swap_outs": 0, "swap_ins": 0, "swap_bytes_out": 0, "swap_bytes_in": 0}
        self.tier = HostTier()  # evicted prefix blocks kept in host blocks that swap does not use
        self.policy = SwapPolicy(self.bytes_per_block // page_size, self._measure_copy_bandwidth())

    @property
    def num_free(self) -> int:
        """Host blocks free for the next swap-out, counting those the host tier would give back (swap first)."""
        return len(self._free) + self.tier.num_blocks

    def swap_out(self, device_blocks: list[int]) -> list[int]:
        """Record copies of these device blocks into fresh host blocks; returns the host ids (the caller may release
        the device blocks at once: nothing runs on them before this step's copies)."""
        if len(self._free) < len(device_blocks):
            self._free.extend(self._reclaim_from_tier(len(device_blocks) - len(self._free)))
        host_blocks = [self._free.pop() for _ in device_blocks]
        self._copies.device_to_host.extend(zip(device_blocks, host_blocks))
        self.counters["swap_outs"] += 1
        self.counters["swap_bytes_out"] += len(device_blocks) * self.bytes_per_block
        return host_blocks

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Record copies of these host blocks into these device blocks; the host blocks are free from the next
        step on."""
        self._copies.host_to_device.extend(zip(host_blocks, device_blocks))
        self.counters["swap_ins"] += 1
        self.counters["swap_bytes_in"] += len(host_blocks) * self.bytes_per_block

    def keep_in_tier(self, device_block: int, path: list[tuple[int, ...]]) -> bool:
        """Record a copy of an evicted prefix block into a host block of the tier (a free one, else the tier's least
        recently used one); False when it is kept already or the pool has no block to spare."""
        node = self.tier.walk(path)
        if node is not None and node.host_block is not None:
            self.tier.touch(node)
            return False
        if self._free:
            host_block = self._free.pop()
        else:
            reclaimed = self._reclaim_from_tier(1)
            if not reclaimed:
                return False
            host_block = reclaimed[0]
        self._copies.device_to_host.append((device_block, host_block))
        self.tier.keep(path, host_block)
        return True

    def bring_back(self, host_block: int, device_block: int) -> None:
        """Record the copy of a tier block back to the device; the host block is free from the next step on."""
        self._copies.host_to_device.append((host_block, device_block))

    def _reclaim_from_tier(self, count: int) -> list[int]:
        """Host blocks taken back from the tier; a copy into one of them recorded this step is dropped, so no host
        block is written twice in one batched copy."""
        reclaimed = self.tier.reclaim(count)
        if reclaimed and self._copies.device_to_host:
            dropped = set(reclaimed)
            self._copies.device_to_host = [(d, h) for d, h in self._copies.device_to_host if h not in dropped]
        return reclaimed

    def release(self, host_blocks: Iterable[int]) -> None:
        """Give back the host blocks of a request that ended while swapped out."""
        self._free.extend(host_blocks)

    def copies_planned(self, copies: BlockCopies, next_copies: BlockCopies) -> None:
        """This step's copies went into its plan (the worker issues them before the forward): the host blocks its
        copies to the device read are free for the next step, whose copies are recorded in `next_copies`."""
        self._free.extend(host for host, _ in copies.host_to_device)
        self._copies = next_copies

    def check(self, holders: dict[int, int]) -> None:
        """Every host block is free, held by exactly one swapped-out request, or kept by the host tier; never two."""
        holders = dict(holders)
        for block in self.tier.held_blocks():
            holders[block] = holders.get(block, 0) + 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("swap pool: a host block is in the free list twice")
        for block, count in holders.items():
            if count != 1:
                raise RuntimeError(f"swap pool: host block {block} is held {count} times (requests and host tier)")
            if block in free:
                raise RuntimeError(f"swap pool: host block {block} is both free and held")
        if len(free) + len(holders) != self.num_host_blocks:
            raise RuntimeError(
                f"swap pool: {self.num_host_blocks - len(free) - len(holders)} host blocks leaked (neither free nor held)"
            )

    def _measure_copy_bandwidth(self) -> float:
        """Bytes per second of a device -> host block copy, timed on a few blocks (their contents do not matter)."""
        count = min(8, self.num_host_blocks, self._key_caches[0].shape[0])
        ids = list(range(count))
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            self.pool.swap_out(self._key_caches, self._value_caches, ids, ids)
            self.pool.synchronize()
            best = min(best, time.perf_counter() - start)
        return count * self.bytes_per_block / max(best, 1e-9)
