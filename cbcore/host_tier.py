"""The host tier of the prefix cache: full prefix blocks evicted from the device are copied into free blocks of the
swap pool and brought back on a later hit instead of being recomputed.

Entries live in a trie keyed by each block's tokens (a path from the root is a whole prefix, compared token for token,
so a hit is never a near miss). A node may exist without host data: its block is still on the device, or was never
kept. The tier only uses host blocks the swap pool does not need: swap comes first and takes tier blocks back (least
recently used first) when it runs short.

| holder | takes a host block | releases it |
|---|---|---|
| the host tier (`HostTier`) | `keep()` when the device evicts a hashed block | `take()` (it goes back to the device, freed after the step's copies), `reclaim()` (swap needs it) |
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False)
class TierNode:
    """One block of a prefix: its tokens (the edge from its parent) and, when kept, the host block holding its K/V."""

    tokens: tuple[int, ...]
    parent: TierNode | None
    children: dict[tuple[int, ...], TierNode] = field(default_factory=dict)
    host_block: int | None = None


class HostTier:
    """Prefix blocks kept on the host, in a trie, with an LRU order over the kept ones."""

    def __init__(self) -> None:
        self.root = TierNode((), None)
        self._kept: OrderedDict[int, TierNode] = OrderedDict()  # host block -> node, least recently used first
        self.counters = {"host_tier_kept": 0, "host_tier_hits": 0, "host_tier_dropped": 0}

    @property
    def num_blocks(self) -> int:
        """Host blocks the tier holds."""
        return len(self._kept)

    def held_blocks(self) -> list[int]:
        """The host blocks the tier holds (for the pool's invariant check)."""
        return list(self._kept)

    def keep(self, path: list[tuple[int, ...]], host_block: int) -> None:
        """Record that `host_block` holds the K/V of the last block of `path` (the block tokens from the root)."""
        node = self.root
        for tokens in path:
            child = node.children.get(tokens)
            if child is None:
                child = TierNode(tokens, node)
                node.children[tokens] = child
            node = child
        assert node.host_block is None, "keep() of a block the tier already holds"
        node.host_block = host_block
        self._kept[host_block] = node
        self.counters["host_tier_kept"] += 1

    def walk(self, block_tokens: list[tuple[int, ...]]) -> TierNode | None:
        """The node at the end of this path of blocks, or None when the trie has no such path."""
        node = self.root
        for tokens in block_tokens:
            node = node.children.get(tokens)
            if node is None:
                return None
        return node

    def take(self, node: TierNode) -> int:
        """Remove the node's host block from the tier (the caller copies it back to the device) and return it."""
        host_block = node.host_block
        assert host_block is not None
        node.host_block = None
        del self._kept[host_block]
        self._prune(node)
        self.counters["host_tier_hits"] += 1
        return host_block

    def reclaim(self, count: int) -> list[int]:
        """Give up to `count` least recently used host blocks (for swap, which comes first)."""
        freed = []
        while self._kept and len(freed) < count:
            host_block, node = self._kept.popitem(last=False)
            node.host_block = None
            self._prune(node)
            freed.append(host_block)
            self.counters["host_tier_dropped"] += 1
        return freed

    def touch(self, node: TierNode) -> None:
        """Mark a kept node as recently used."""
        if node.host_block is not None:
            self._kept.move_to_end(node.host_block)

    def _prune(self, node: TierNode | None) -> None:
        """Drop nodes that hold nothing and lead nowhere, up towards the root."""
        while node is not None and node.parent is not None and node.host_block is None and not node.children:
            del node.parent.children[node.tokens]
            node = node.parent
