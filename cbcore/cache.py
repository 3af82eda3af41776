"""The paged KV cache: one K and one V tensor per layer, the C++ block allocator that hands out their blocks, and the
block bookkeeping of each request (block table, prefix-cache commits).

Layout: `[num_blocks, page_size, num_kv_heads, head_dim]` per layer, the layout `flash_attn_with_kvcache` takes with
a block table. Token t of a request lives at `(block_table[t // page_size], t % page_size)`. V pages have V's head dim,
which differs from K's in multi-head latent attention (DeepSeek-V2/V3, MiniCPM3).

Who holds a block reference (the allocator counts them; `check()` proves the count):

| holder                      | takes a reference                        | releases it                              |
|-----------------------------|------------------------------------------|------------------------------------------|
| a request's `block_table`   | `grow()` (fresh blocks), `take_prefix()`, `fork()`, `swap_in()` | `release()`, `swap_out()` |
| the prefix cache            | never: a hashed block with no holder sits in the allocator's LRU list, reusable until evicted |

Host blocks of the swap pool are held by swapped-out requests (`RequestState.host_blocks`); see cbcore/swap.py.
For a model with stateful layers, each request's state slot follows it through the same calls (`state_slots`,
cbcore/state_slots.py): forked with it, kept while it is swapped out, released with its blocks.

One prefix index: the C++ allocator's hash chain (parent, tokens, the parent's generation). Python keeps no copy
of it: the host tier asks the allocator for an evicted block's whole prefix (`prefix_path`), and a weight change
makes it forget every prefix (`forget_prefixes`). The page shape comes from cbcore/cache_shape.py, the number of
blocks from cbcore/engine/sizing.py.

The scheduler calls the bookkeeping methods (it decides); the block copies they imply (a fork's copy-on-write
block, swaps, host-tier moves) are recorded as block-id pairs, taken into the step's plan by `take_copies()` and
issued by the runner (it executes), which also reads the tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ._C import BlockAllocator
from .cache_shape import CacheShape
from .lazy_zeros import zeroed_pages
from .plan import BlockCopies
from .requests import RequestState
from .state_slots import StateSlots
from .swap import HostSwap

@dataclass(frozen=True)
class PrefixHit:
    """What `PagedKVCache.peek_prefix` found for a waiting request: the shared device blocks, how many of them nobody
    holds now (they stop being available once taken), the block lookups the walk made (hits and the final miss), and
    how many blocks after them the host tier keeps (each comes back into a fresh device block at admission, so the
    admission must count it among the blocks it takes)."""

    blocks: tuple[int, ...]
    num_unused: int
    lookups: int
    num_host_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        """Leading prompt blocks the request skips computing: shared on the device or brought back from the host."""
        return len(self.blocks) + self.num_host_blocks


class PagedKVCache:
    """K/V pages for every layer plus the allocator and per-request block bookkeeping."""

    def __init__(
        self,
        shape: CacheShape,
        num_blocks: int,
        page_size: int,
        device: torch.device,
        allow_prefix_sharing: bool = True,
        state_slots: StateSlots | None = None,
    ) -> None:
        """`state_slots`: the requests' state slots, for a model with stateful layers (None without)."""
        self.shape = shape
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.device = device
        self.allow_prefix_sharing = allow_prefix_sharing
        self.state_slots = state_slots
        self.key_caches, self.value_caches = [], []
        for layer in range(shape.num_layers):
            heads, k_dim, v_dim = shape.layer_dims(layer)
            self.key_caches.append(zeroed_pages((num_blocks, page_size, heads, k_dim), shape.dtype, device))
            self.value_caches.append(zeroed_pages((num_blocks, page_size, heads, v_dim), shape.dtype, device))
        self.allocator = BlockAllocator(num_blocks, page_size)
        self.swap: HostSwap | None = None
        # The block copies decided while scheduling this step; taken into its plan by take_copies().
        self._copies = BlockCopies()

    def enable_swap(self, num_host_blocks: int) -> None:
        """Attach a host pool of `num_host_blocks` blocks: preempted requests may then be swapped out."""
        shape = self.shape
        if not shape.uniform:
            # The host pool (cbcore/swap.py, csrc/swap) holds one block shape for every layer and for K and V alike.
            what = ("layers of different K/V shapes" if shape.per_layer is not None else
                    f"a V head dim ({shape.value_head_dim}) other than K's ({shape.head_dim}), as in multi-head latent "
                    "attention")
            raise NotImplementedError(
                f"swapping to host memory is not implemented for {what}; set cpu_offload_space=0 (preempted requests "
                "are then recomputed, with the same output)"
            )
        self.swap = HostSwap(
            shape.num_layers, num_host_blocks, self.page_size, shape.num_kv_heads, shape.head_dim, shape.dtype,
            self.key_caches, self.value_caches, self._copies,
        )

    @property
    def capacity_tokens(self) -> int:
        """The most tokens a single request can ever hold."""
        return self.num_blocks * self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes taken by the K/V tensors."""
        return sum(t.numel() * t.element_size() for t in self.key_caches + self.value_caches)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    # ---- weights changed ---------------------------------------------------------------------------------------

    def invalidate_prefixes(self) -> int:
        """The model's weights changed: no K/V computed before may be shared from now on. The allocator forgets
        every cached prefix (unused hashed blocks are freed; hashed blocks running requests hold are unhashed, so
        no prefix match reaches them and no block is ever committed chained on them) and the host tier is emptied.
        Requests already running keep their own K/V (as in transformers). Returns the number of blocks forgotten."""
        if not self.allow_prefix_sharing:
            return 0
        forgotten = self.allocator.forget_prefixes()
        if self.swap is not None:
            self.swap.release(self.swap._reclaim_from_tier(self.swap.tier.num_blocks))
        return forgotten

    # ---- bookkeeping called by the scheduler -------------------------------------------------------------------

    def peek_prefix(self, state: RequestState) -> PrefixHit:
        """The request's leading full blocks that the prefix cache holds, changing nothing (no reference taken, no
        lookup counted, the LRU order untouched): the scheduler asks this of a waiting request every step, and only
        `take_prefix` at admission acts on it. At least one token is always left to compute, so the last prompt
        position still produces logits."""
        if not self.allow_prefix_sharing or state.block_table or state.host_blocks:
            return PrefixHit((), 0, 0)
        max_blocks = (state.num_tokens - 1) // self.page_size
        if state.next_prompt_row is not None:  # prompt logprobs still to compute: their rows must run
            max_blocks = min(max_blocks, state.next_prompt_row // self.page_size)
        if max_blocks <= 0:
            return PrefixHit((), 0, 0)
        blocks = tuple(self.allocator.peek_prefix(state.all_tokens, max_blocks))
        unused = sum(1 for block in blocks if self.allocator.refcount(block) == 0)
        lookups = min(len(blocks) + 1, max_blocks)  # every hit, and the miss that ended the walk
        return PrefixHit(blocks, unused, lookups, self._host_tier_blocks_after(state, len(blocks), max_blocks))

    def _host_tier_blocks_after(self, state: RequestState, num_device_blocks: int, max_blocks: int) -> int:
        """How many of the request's blocks right after its first `num_device_blocks` the host tier keeps, up to
        `max_blocks` in all (a pure walk of the tier's trie: nothing is taken or touched)."""
        if self.swap is None or not self.swap.tier.num_blocks:
            return 0
        page = self.page_size
        tokens = state.all_tokens
        node = self.swap.tier.walk([tuple(tokens[i * page : (i + 1) * page]) for i in range(num_device_blocks)])
        count = 0
        while node is not None and num_device_blocks + count < max_blocks:
            index = num_device_blocks + count
            node = node.children.get(tuple(tokens[index * page : (index + 1) * page]))
            if node is None or node.host_block is None:
                break
            count += 1
        return count

    def can_admit(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Whether a request sharing `hit` can have `num_tokens` tokens: the fresh blocks it needs (the host tier's
        blocks it brings back among them) must be available once the hit's unused blocks (available now) are taken."""
        missing = self.blocks_for(num_tokens) - len(hit.blocks)
        return missing <= 0 or missing <= self.allocator.num_available - hit.num_unused

    def take_prefix(self, state: RequestState, hit: PrefixHit) -> int:
        """Admit the request onto its prefix hit: reference the shared blocks, count the lookup, and bring back the
        hit's blocks from the host tier (copied back this step). Returns the prompt tokens it skips: at most
        `hit.num_blocks` blocks' worth (fewer when making room for one of them evicted a block into the tier and
        that took back a tier block the hit counted), never more than the admission reserved blocks for."""
        self.allocator.take_prefix(list(hit.blocks), hit.lookups)
        state.block_table = list(hit.blocks)
        state.num_committed_blocks = len(hit.blocks)
        if hit.num_host_blocks:
            self._bring_back_from_host(state, hit.num_blocks)
        state.num_computed_tokens = len(state.block_table) * self.page_size
        return state.num_computed_tokens

    def _bring_back_from_host(self, state: RequestState, max_blocks: int) -> None:
        """Extend a device prefix match with blocks the host tier kept: each is copied back into a fresh device
        block (recorded in this step's copies) and hashed again, so it is shared as if it had never left."""
        page = self.page_size
        tokens = state.all_tokens
        node = self.swap.tier.walk([tuple(tokens[i * page : (i + 1) * page]) for i in range(len(state.block_table))])
        while node is not None and len(state.block_table) < max_blocks:
            index = len(state.block_table)
            block_tokens = tuple(tokens[index * page : (index + 1) * page])
            child = node.children.get(block_tokens)
            if child is None or child.host_block is None:
                return
            host_block = self.swap.tier.take(child)
            (device_block,) = self._allocate(1)
            self.swap.bring_back(host_block, device_block)
            parent = state.block_table[-1] if state.block_table else -1
            self.allocator.commit(device_block, parent, list(block_tokens))
            state.block_table.append(device_block)
            state.num_committed_blocks += 1
            node = child

    def _allocate(self, count: int) -> list[int]:
        """Fresh blocks from the allocator; with a host pool, the hashed blocks this evicts are first kept in its
        host tier (when their whole prefix is still known)."""
        shortfall = count - self.allocator.num_free
        if self.swap is not None and shortfall > 0:
            victims = self.allocator.least_recently_used(shortfall)
            for victim in victims:
                # The whole prefix's tokens, from the allocator's own chain (empty when a link changed since).
                path = [tuple(tokens) for tokens in self.allocator.prefix_path(victim)]
                if path:
                    self.swap.keep_in_tier(victim, path)
            self.allocator.evict(len(victims))
        return self.allocator.allocate(count)

    def can_grow(self, state: RequestState, num_tokens: int) -> bool:
        """Whether the request's block table can cover `num_tokens` tokens (evicting unused cached blocks if needed)."""
        missing = self.blocks_for(num_tokens) - len(state.block_table)
        return missing <= 0 or missing <= self.allocator.num_available

    def grow(self, state: RequestState, num_tokens: int) -> None:
        """Extend the request's block table to cover `num_tokens` tokens; call `can_grow` first."""
        missing = self.blocks_for(num_tokens) - len(state.block_table)
        if missing > 0:
            state.block_table.extend(self._allocate(missing))

    def commit_full_blocks(self, state: RequestState) -> None:
        """Offer every newly completed block (all its tokens computed) to the prefix cache, chained on its parent."""
        if not self.allow_prefix_sharing:
            return
        num_full = state.num_computed_tokens // self.page_size
        page = self.page_size
        for index in range(state.num_committed_blocks, num_full):
            parent = state.block_table[index - 1] if index else -1
            self.allocator.commit(state.block_table[index], parent, state.all_tokens[index * page : (index + 1) * page])
        state.num_committed_blocks = max(state.num_committed_blocks, num_full)

    def blocks_to_fork(self, parent: RequestState) -> int:
        """Fresh blocks one child needs at fork time: a copy of the parent's partial last block, if any."""
        return 1 if parent.num_computed_tokens % self.page_size else 0

    def fork(self, parent: RequestState, child: RequestState) -> None:
        """Give `child` the parent's computed K/V: full blocks shared (refcount + 1), a partial last block copied
        into a fresh block (copy on write: both will append different tokens to it)."""
        num_full = parent.num_computed_tokens // self.page_size
        shared = parent.block_table[:num_full]
        if shared:
            self.allocator.fork(shared)
        child.block_table = list(shared)
        if self.blocks_to_fork(parent):
            source = parent.block_table[num_full]
            (copy,) = self._allocate(1)
            self._copies.device_to_device.append((source, copy))  # issued with the step's other copies
            child.block_table.append(copy)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_committed_blocks = min(parent.num_committed_blocks, num_full)
        if self.state_slots is not None:
            self.state_slots.fork(parent, child)

    def can_swap_out(self, state: RequestState) -> bool:
        """Whether preempting `state` should swap it out: the pool has room and copying beats recomputing."""
        if self.swap is None or state.num_computed_tokens == 0:
            return False
        blocks = self.blocks_for(state.num_computed_tokens)
        return blocks <= self.swap.num_free and self.swap.policy.prefer_swap(
            state.num_computed_tokens, blocks * self.page_size
        )

    def swap_out(self, state: RequestState) -> None:
        """Copy the request's computed blocks to the host (recorded in this step's copies) and release its device
        blocks; it keeps `num_computed_tokens` (and its state slot, whose state stays in place) and resumes with
        `swap_in`."""
        computed_blocks = state.block_table[: self.blocks_for(state.num_computed_tokens)]
        state.host_blocks = self.swap.swap_out(computed_blocks)
        self.allocator.free(state.block_table[::-1])
        state.block_table = []
        state.num_committed_blocks = 0

    def swap_in(self, state: RequestState, num_tokens: int) -> None:
        """Give a swapped-out request device blocks for `num_tokens` tokens and queue the copy of its host blocks
        into the first of them; call `can_grow(state, num_tokens)` first."""
        self.grow(state, num_tokens)
        self.swap.swap_in(state.host_blocks, state.block_table[: len(state.host_blocks)])
        state.host_blocks = []

    def take_copies(self) -> BlockCopies:
        """The block copies decided since the last call (this step's), for its plan; the worker issues them before
        the step's forward. Host blocks read by this step's copies to the device are free from the next step on."""
        copies = self._copies
        self._copies = BlockCopies()
        if self.state_slots is not None:
            copies.state_copies = self.state_slots.take_copies()
        if self.swap is not None:
            self.swap.copies_planned(copies, self._copies)
        return copies

    def release(self, state: RequestState) -> None:
        """Drop the request's references; its computed K/V is forgotten (hashed blocks stay cached until evicted)."""
        if state.host_blocks:
            self.swap.release(state.host_blocks)
            state.host_blocks = []
        if state.block_table:
            # Tail first: the allocator appends each released hashed block to the LRU list, so the request's first
            # blocks (the prefix most likely shared by the next request) become the last to be evicted.
            self.allocator.free(state.block_table[::-1])
        state.block_table = []
        state.num_committed_blocks = 0
        state.num_computed_tokens = 0
        if self.state_slots is not None:
            self.state_slots.release(state)

    # ---- invariants --------------------------------------------------------------------------------------------

    def check(self, live_requests: Iterable[RequestState]) -> None:
        """Assert the allocator's invariants and that each block's refcount equals the block tables holding it."""
        live_requests = list(live_requests)
        holders = Counter(block for state in live_requests for block in state.block_table)
        self.allocator.check()
        self.allocator.check_holders(dict(holders))
        if self.swap is not None:
            self.swap.check(dict(Counter(block for state in live_requests for block in state.host_blocks)))
        if self.state_slots is not None:
            self.state_slots.check(live_requests)
