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

The scheduler calls the bookkeeping methods (it decides); the block copies they imply (a fork's copy-on-write
block, swaps, host-tier moves) are recorded as block-id pairs, taken into the step's plan by `take_copies()` and
issued by the runner (it executes), which also reads the tensors.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import psutil
import torch

from ._C import BlockAllocator
from .attention import probe_kv_shapes
from .plan import BlockCopies
from .requests import RequestState
from .swap import HostSwap

# On a CPU the KV cache lives in the same RAM as everything else; never take more than this by default, so a small
# model on a laptop-sized machine cannot push it into swap (transformers takes 60% of free RAM on CPU). 1 GiB holds
# 64 requests of 512 tokens for a 32-layer model with 8 KV heads of 128 in bf16 / 16 layers in fp32; a workload that
# would need more is preempted (swap or recompute) rather than given more RAM, unless `num_blocks` says otherwise.
CPU_CACHE_CAP_BYTES = 2**30


@dataclass(frozen=True)
class CacheShape:
    """What one token costs in the cache: per layer, the KV heads and the K and V head dims its attention receives.

    Most models have one shape for every layer (`num_kv_heads`, `head_dim`, `v_head_dim`); a model whose layers differ
    (Gemma-4's sliding and global layers, per-layer KV head counts) has `per_layer` set, one (kv heads, K head dim,
    V head dim) per layer, and its pages are allocated layer by layer with their own shape.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int  # K's (and the queries')
    dtype: torch.dtype
    v_head_dim: int | None = None  # V's when it differs from K's (multi-head latent attention); None: head_dim
    per_layer: tuple[tuple[int, int, int], ...] | None = None  # when the layers differ

    @property
    def value_head_dim(self) -> int:
        """The head dim of the V pages (of layer 0 when the layers differ)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def uniform(self) -> bool:
        """One K/V page shape for every layer, the same for K and V (what the host swap pool holds)."""
        return self.per_layer is None and self.value_head_dim == self.head_dim

    def layer_dims(self, layer: int) -> tuple[int, int, int]:
        """(kv heads, K head dim, V head dim) of one layer."""
        if self.per_layer is not None:
            return self.per_layer[layer]
        return self.num_kv_heads, self.head_dim, self.value_head_dim

    @property
    def bytes_per_token(self) -> int:
        """K and V over every layer."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return sum(heads * (k + v) for heads, k, v in map(self.layer_dims, range(self.num_layers))) * element

    @classmethod
    def from_model_config(cls, config, dtype: torch.dtype) -> CacheShape:
        """Layers, KV heads and K/V head dims of a transformers text config (per layer for a heterogeneous config).

        ValueError, naming the config and the field, when the dims cannot be derived exactly.
        """
        config = config.get_text_config()
        if getattr(config, "is_heterogeneous", False):
            per_layer = [_attention_dims(layer) for layer in config.per_layer_config]
            return cls.from_layers(per_layer, dtype)
        num_kv_heads, head_dim, v_head_dim = _attention_dims(config)
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, dtype,
                   None if v_head_dim == head_dim else v_head_dim)

    @classmethod
    def from_layers(cls, per_layer: list[tuple[int, int, int]], dtype: torch.dtype) -> CacheShape:
        """The shape of layers whose (kv heads, K head dim, V head dim) are given one by one."""
        num_kv_heads, head_dim, v_head_dim = per_layer[0]
        layers = None if len(set(per_layer)) == 1 else tuple(per_layer)
        return cls(len(per_layer), num_kv_heads, head_dim, dtype, None if v_head_dim == head_dim else v_head_dim,
                   layers)

    @classmethod
    def from_model(cls, model: torch.nn.Module, dtype: torch.dtype) -> CacheShape:
        """The shape of what `model`'s attention layers really receive: read off one probe forward (a token through
        cbcore's attention function, which records each layer's K/V shapes), since a config does not always say
        (JetMoE's heads depend on its experts, some configs name per-layer head counts their own way). Falls back
        to the config when the probe cannot run; the start-up self-check verifies the numbers either way."""
        probed = probe_kv_shapes(model)
        config = model.config.get_text_config()
        if probed is None or sorted(probed) != list(range(config.num_hidden_layers)):
            return cls.from_model_config(model.config, dtype)
        return cls.from_layers([probed[layer] for layer in range(config.num_hidden_layers)], dtype)


def _attention_dims(config) -> tuple[int, int, int]:
    """(kv heads, K head dim, V head dim) of the K/V that one layer hands its attention function."""
    name = type(config).__name__

    def positive(field: str, value) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}.{field} is {value!r}; cbcore needs a positive integer to size its KV cache")
        return value

    num_heads = positive("num_attention_heads", getattr(config, "num_attention_heads", None))
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if nope is not None and rope is not None:
        # Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3): transformers expands the latent into per-head K/V
        # before calling attention (DeepseekV3Attention.expand_kv): one K/V head per query head, K = nope + rope
        # dims, V = v_head_dim. config.head_dim is only the rotary part there, not K's head dim.
        v_head_dim = positive("v_head_dim", getattr(config, "v_head_dim", None))
        return num_heads, positive("qk_nope_head_dim", nope) + positive("qk_rope_head_dim", rope), v_head_dim
    num_kv_heads = positive("num_key_value_heads", getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        hidden = positive("hidden_size", getattr(config, "hidden_size", None))
        if hidden % num_heads:
            raise ValueError(f"{name}: hidden_size {hidden} is not a multiple of num_attention_heads {num_heads} and "
                             "head_dim is unset; cbcore cannot derive the head dim of its KV cache")
        head_dim = hidden // num_heads
    head_dim = positive("head_dim", head_dim)
    v_head_dim = getattr(config, "v_head_dim", None)
    if v_head_dim is not None and v_head_dim != head_dim:
        # A V head dim without the latent-attention fields: how the model shapes its V is not known here.
        raise ValueError(f"{name}: v_head_dim {v_head_dim} differs from head_dim {head_dim} outside multi-head latent "
                         "attention (no qk_nope_head_dim / qk_rope_head_dim); cbcore cannot derive its KV cache shape")
    return num_kv_heads, head_dim, head_dim


def plan_num_blocks(
    shape: CacheShape,
    page_size: int,
    device: torch.device,
    max_memory_percent: float,
    reserved_bytes: int,
    max_useful_blocks: int | None = None,
) -> int:
    """How many blocks to allocate when the user left `num_blocks=None`.

    The budget is `max_memory_percent` of the memory that is free once the model is loaded, minus `reserved_bytes`
    (the activations of the largest step, computed from the step budgets). On CPU it is also capped at
    `CPU_CACHE_CAP_BYTES`. `max_useful_blocks` (from workload hints: every request at its longest, all at once, see
    `useful_blocks`) caps it further: more blocks than that would never be used.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = max_memory_percent * max(free - reserved_bytes, 0)
    else:
        available = psutil.virtual_memory().available
        budget = min(max_memory_percent * max(available - reserved_bytes, 0), CPU_CACHE_CAP_BYTES)
    num_blocks = int(budget // (shape.bytes_per_token * page_size))
    if max_useful_blocks is not None:
        num_blocks = min(num_blocks, max_useful_blocks)
    if num_blocks < 1:
        raise ValueError(
            f"not enough free memory for a single KV-cache block of {page_size} tokens "
            f"({shape.bytes_per_token * page_size} bytes); set num_blocks explicitly or free memory"
        )
    return num_blocks


def useful_blocks(num_requests: int, longest_request_tokens: int, page_size: int) -> int:
    """Blocks that `num_requests` requests of at most `longest_request_tokens` tokens can hold at once: each
    rounds up to whole pages, plus one block of slack for a request forked or admitted while another finishes."""
    return num_requests * math.ceil(longest_request_tokens / page_size) + 1


@dataclass(frozen=True)
class PrefixHit:
    """What `PagedKVCache.peek_prefix` found for a waiting request: the shared blocks, how many of them nobody holds
    now (they stop being available once taken), and the block lookups the walk made (hits and the final miss)."""

    blocks: tuple[int, ...]
    num_unused: int
    lookups: int


class PagedKVCache:
    """K/V pages for every layer plus the allocator and per-request block bookkeeping."""

    def __init__(
        self,
        shape: CacheShape,
        num_blocks: int,
        page_size: int,
        device: torch.device,
        allow_prefix_sharing: bool = True,
    ) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.device = device
        self.allow_prefix_sharing = allow_prefix_sharing
        self.key_caches, self.value_caches = [], []
        for layer in range(shape.num_layers):
            heads, k_dim, v_dim = shape.layer_dims(layer)
            self.key_caches.append(torch.zeros((num_blocks, page_size, heads, k_dim), dtype=shape.dtype, device=device))
            self.value_caches.append(torch.zeros((num_blocks, page_size, heads, v_dim), dtype=shape.dtype, device=device))
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
        if max_blocks <= 0:
            return PrefixHit((), 0, 0)
        blocks = tuple(self.allocator.peek_prefix(state.all_tokens, max_blocks))
        unused = sum(1 for block in blocks if self.allocator.refcount(block) == 0)
        lookups = min(len(blocks) + 1, max_blocks)  # every hit, and the miss that ended the walk
        return PrefixHit(blocks, unused, lookups)

    def can_admit(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Whether a request sharing `hit` can have `num_tokens` tokens: the fresh blocks it needs must be available
        once the hit's unused blocks (available now) are taken."""
        missing = self.blocks_for(num_tokens) - len(hit.blocks)
        return missing <= 0 or missing <= self.allocator.num_available - hit.num_unused

    def take_prefix(self, state: RequestState, hit: PrefixHit) -> int:
        """Admit the request onto its prefix hit: reference the shared blocks, count the lookup, and extend the
        match with blocks the host tier kept (copied back this step). Returns the prompt tokens it skips."""
        self.allocator.take_prefix(list(hit.blocks), hit.lookups)
        state.block_table = list(hit.blocks)
        state.num_committed_blocks = len(hit.blocks)
        if self.swap is not None and self.swap.tier.num_blocks and hit.lookups:
            self._bring_back_from_host(state, (state.num_tokens - 1) // self.page_size)
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
            if child is None or child.host_block is None or self.allocator.num_available < 1:
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
        blocks; it keeps `num_computed_tokens` and resumes with `swap_in`."""
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

    # ---- invariants --------------------------------------------------------------------------------------------

    def check(self, live_requests: Iterable[RequestState]) -> None:
        """Assert the allocator's invariants and that each block's refcount equals the block tables holding it."""
        live_requests = list(live_requests)
        holders = Counter(block for state in live_requests for block in state.block_table)
        self.allocator.check()
        self.allocator.check_holders(dict(holders))
        if self.swap is not None:
            self.swap.check(dict(Counter(block for state in live_requests for block in state.host_blocks)))
