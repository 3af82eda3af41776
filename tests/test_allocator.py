"""The C++ BlockAllocator as seen from Python: the binding's API, and a stateful test that drives random operation
sequences against `AllocatorModel`, a plain-Python statement of the allocator's contract, comparing every result,
error, refcount, state and counter after every step."""

from __future__ import annotations

import copy

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.errors import InvalidArgument
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cbcore._C import BlockAllocator

ROOT = -1


def note(what: str) -> None:
    """Count `what` in Hypothesis' statistics (`pytest --hypothesis-show-statistics`); a no-op outside Hypothesis."""
    try:
        event(what)
    except InvalidArgument:
        pass


# ---- the model --------------------------------------------------------------------------------------------------------


@dataclass
class Entry:
    """What the prefix cache remembers about a hashed block."""

    key: object
    prefix: tuple[int, ...]  # every token from the root through this block: what the chained hash summarises
    parent: int
    parent_generation: int
    tokens: tuple[int, ...]


class AllocatorModel:
    """The allocator contract in plain Python, slow and obvious.

    Keys are the full token prefix itself (an ideal, collision-free hash), or one constant for every block when
    `constant_key` mirrors `BlockAllocator._with_constant_hash_for_testing`. Lists are Python lists with O(n)
    operations; only the observable behaviour has to match the C++ class: returned ids (including the free list's
    stack order and the LRU order), errors, refcounts, generations and counters.
    """

    def __init__(self, num_blocks: int, page_size: int, constant_key: bool = False) -> None:
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.constant_key = constant_key
        self.refcount = [0] * num_blocks
        self.generation = [0] * num_blocks
        self.entries: dict[int, Entry] = {}  # hashed blocks
        self.index: dict[object, int] = {}  # key -> block
        self.free_list = list(range(num_blocks - 1, -1, -1))  # stack: pop() hands out 0, 1, 2, ... first
        self.lru: list[int] = []  # least recently used first
        self.events = dict.fromkeys(["lookups", "hits", "evictions", "allocations", "commits"], 0)

    # -- helpers

    def _valid(self, block: int) -> bool:
        return 0 <= block < self.num_blocks

    def _key(self, prefix: tuple[int, ...]) -> object:
        return 0 if self.constant_key else prefix

    def _prefix_of(self, parent: int) -> tuple[int, ...]:
        return () if parent == ROOT else self.entries[parent].prefix

    def _stale(self, block: int) -> bool:
        entry = self.entries[block]
        return entry.parent != ROOT and self.generation[entry.parent] != entry.parent_generation

    def _unhash(self, block: int) -> None:
        del self.index[self.entries.pop(block).key]

    def _recycle(self, block: int) -> None:
        self._unhash(block)
        self.generation[block] += 1
        self.free_list.append(block)

    def _evict_one(self) -> None:
        self._recycle(self.lru.pop(0))
        self.events["evictions"] += 1

    def _check_page(self, tokens: list[int]) -> None:
        if len(tokens) != self.page_size:
            raise ValueError("wrong number of tokens")

    def _check_parent(self, parent: int) -> None:
        if parent != ROOT and not self._valid(parent):
            raise ValueError("parent out of range")

    # -- the API

    @property
    def num_available(self) -> int:
        return len(self.free_list) + len(self.lru)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("negative n")
        if n > self.num_available:
            raise RuntimeError("not enough blocks")
        ids = []
        for _ in range(n):
            if not self.free_list:
                self._evict_one()
            block = self.free_list.pop()
            self.refcount[block] = 1
            ids.append(block)
        self.events["allocations"] += n
        return ids

    def free(self, ids: list[int]) -> None:
        if not all(self._valid(b) for b in ids):
            raise ValueError("id out of range")
        if any(ids.count(b) > self.refcount[b] for b in ids):
            raise ValueError("double free")
        for block in ids:
            self.refcount[block] -= 1
            if self.refcount[block]:
                continue
            if block in self.entries:
                self.lru.append(block)
            else:
                self.generation[block] += 1
                self.free_list.append(block)

    def fork(self, ids: list[int]) -> None:
        if not all(self._valid(b) and self.refcount[b] >= 1 for b in ids):
            raise ValueError("not referenced")
        for block in ids:
            self.refcount[block] += 1

    def lookup(self, parent: int, tokens: list[int]) -> int:
        self._check_page(tokens)
        self._check_parent(parent)
        self.events["lookups"] += 1
        if parent != ROOT and parent not in self.entries:
            return ROOT
        block = self.index.get(self._key(self._prefix_of(parent) + tuple(tokens)))
        if block is None:
            return ROOT
        entry = self.entries[block]
        if entry.parent != parent or self._stale(block) or entry.tokens != tuple(tokens):
            note("lookup: key found but entry rejected")
            return ROOT
        if self.refcount[block] == 0:
            self.lru.remove(block)
        self.refcount[block] += 1
        self.events["hits"] += 1
        return block

    def match_prefix(self, tokens: list[int], max_blocks: int) -> list[int]:
        if max_blocks < 0:
            raise ValueError("negative max_blocks")
        hits: list[int] = []
        parent = ROOT
        page = self.page_size
        for i in range(min(max_blocks, len(tokens) // page)):
            block = self.lookup(parent, tokens[i * page : (i + 1) * page])
            if block == ROOT:
                break
            hits.append(block)
            parent = block
        return hits

    def least_recently_used(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("negative n")
        return list(self.lru[:n])

    def peek_prefix(self, tokens: list[int], max_blocks: int) -> list[int]:
        """What match_prefix would return, on a copy: nothing here changes."""
        return copy.deepcopy(self).match_prefix(tokens, max_blocks)

    def take_prefix(self, ids: list[int], lookups: int) -> None:
        if lookups < len(ids):
            raise ValueError("more hits than lookups")
        if not all(self._valid(b) and b in self.entries for b in ids):
            raise ValueError("not in the prefix cache")
        for block in ids:
            if self.refcount[block] == 0:
                self.lru.remove(block)
            self.refcount[block] += 1
        self.events["lookups"] += lookups
        self.events["hits"] += len(ids)

    def commit(self, block: int, parent: int, tokens: list[int]) -> bool:
        if not self._valid(block):
            raise ValueError("block out of range")
        self._check_page(tokens)
        self._check_parent(parent)
        if self.refcount[block] < 1:
            raise ValueError("block not referenced")
        if block in self.entries or (parent != ROOT and parent not in self.entries):
            return False
        prefix = self._prefix_of(parent) + tuple(tokens)
        key = self._key(prefix)
        other = self.index.get(key)
        if other is not None:
            if not self._stale(other) or other == parent:
                return False
            note("commit: a stale entry makes way")
            if self.refcount[other] == 0:
                self.lru.remove(other)
                self._recycle(other)
                self.events["evictions"] += 1
            else:
                self._unhash(other)
        parent_generation = 0 if parent == ROOT else self.generation[parent]
        self.entries[block] = Entry(key, prefix, parent, parent_generation, tuple(tokens))
        self.index[key] = block
        self.events["commits"] += 1
        return True

    def evict(self, n: int) -> int:
        if n < 0:
            raise ValueError("negative n")
        evicted = min(n, len(self.lru))
        for _ in range(evicted):
            self._evict_one()
        return evicted

    def reset_stats(self) -> None:
        self.events = dict.fromkeys(self.events, 0)

    def stats(self) -> dict[str, int]:
        referenced = sum(1 for r in self.refcount if r > 0)
        return {
            **self.events,
            "num_free": len(self.free_list),
            "num_cached_unused": len(self.lru),
            "num_referenced": referenced,
            "num_cached": len(self.entries),
        }

    def blocks_in_state(self) -> tuple[list[int], list[int], list[int]]:
        referenced = [b for b in range(self.num_blocks) if self.refcount[b] > 0]
        return sorted(self.free_list), list(self.lru), referenced


# ---- comparing the two ------------------------------------------------------------------------------------------------


def agree(model: AllocatorModel, real: BlockAllocator, method: str, *args):
    """Call `method` on both; they must return the same value or raise the same exception type (then: None)."""
    try:
        expected = getattr(model, method)(*args)
    except (ValueError, RuntimeError) as error:
        with pytest.raises(type(error)):
            getattr(real, method)(*args)
        note(f"{method}: {type(error).__name__}")
        return None
    actual = getattr(real, method)(*args)
    assert actual == expected, f"{method}{args}: C++ returned {actual!r}, the model {expected!r}"
    return actual


def assert_same_state(model: AllocatorModel, real: BlockAllocator) -> None:
    """Invariants hold, and every observable count, state, refcount and generation matches the model."""
    real.check()
    real.check_holders({block: count for block, count in enumerate(model.refcount) if count})
    assert real.stats() == model.stats()
    assert real.blocks_in_state() == tuple(model.blocks_in_state())
    assert real.num_available == model.num_available
    for block in range(model.num_blocks):
        assert real.refcount(block) == model.refcount[block], f"refcount of block {block}"
        assert real.is_cached(block) == (block in model.entries), f"is_cached of block {block}"
        assert real.generation(block) == model.generation[block], f"generation of block {block}"


# ---- the stateful test ------------------------------------------------------------------------------------------------

TOKEN = st.integers(0, 1)  # a tiny alphabet, so that prefixes repeat and the cache really gets hit


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / free / fork / lookup / match_prefix / commit / evict sequences; C++ and model must agree.

    Raw rules call one method with mostly valid and sometimes invalid arguments; request rules use the allocator the
    way the engine does (share a cached prefix, allocate the rest, commit full blocks, free the table later).
    """

    constant_key = False

    @initialize(num_blocks=st.integers(1, 8), page_size=st.integers(1, 3))
    def create(self, num_blocks: int, page_size: int) -> None:
        if self.constant_key:
            self.real = BlockAllocator._with_constant_hash_for_testing(num_blocks, page_size)
        else:
            self.real = BlockAllocator(num_blocks, page_size)
        self.model = AllocatorModel(num_blocks, page_size, constant_key=self.constant_key)
        self.requests: list[list[int]] = []  # block tables of the requests started by start_request
        self.prompts: list[list[int]] = []  # every prompt start_request has seen
        self.tail_first = False

    def both(self, method: str, *args):
        return agree(self.model, self.real, method, *args)

    # -- argument choices that depend on the current state: valid most of the time, a bad one now and then

    @staticmethod
    def bad_now_and_then(data) -> bool:
        return data.draw(st.integers(0, 7), label="bad argument") == 7

    def some_blocks(self, data) -> list[int]:
        referenced = self.model.blocks_in_state()[2]
        if self.bad_now_and_then(data) or not referenced:
            return data.draw(st.lists(st.integers(-1, self.model.num_blocks), min_size=1, max_size=3), label="ids")
        return data.draw(st.lists(st.sampled_from(referenced), min_size=1, max_size=4), label="ids")

    def parent(self, data) -> int:
        hashed = sorted(self.model.entries)
        if self.bad_now_and_then(data):
            return data.draw(st.sampled_from([-2, self.model.num_blocks]), label="parent")
        return data.draw(st.sampled_from([ROOT] + hashed * 2), label="parent")

    def page(self, data) -> list[int]:
        size = self.model.page_size
        if self.bad_now_and_then(data):
            size = data.draw(st.sampled_from([size - 1, size + 1]), label="bad page size")
        return data.draw(st.lists(TOKEN, min_size=size, max_size=size), label="tokens")

    def count(self, data, upper: int) -> int:
        if self.bad_now_and_then(data):
            return -1
        return data.draw(st.integers(0, upper), label="n")

    # -- raw rules

    @rule(data=st.data())
    def allocate(self, data) -> None:
        self.both("allocate", self.count(data, self.model.num_available + 1))

    @rule(data=st.data())
    def free(self, data) -> None:
        self.both("free", self.some_blocks(data))

    @rule(data=st.data())
    def fork(self, data) -> None:
        self.both("fork", self.some_blocks(data))

    @rule(data=st.data())
    def lookup(self, data) -> None:
        if self.both("lookup", self.parent(data), self.page(data)) not in (None, ROOT):
            note("lookup: hit")

    @rule(data=st.data(), tokens=st.lists(TOKEN, max_size=10))
    def match_prefix(self, data, tokens: list[int]) -> None:
        if self.both("match_prefix", tokens, self.count(data, 4)):
            note("match_prefix: hit")

    @rule(n=st.integers(-1, 9))
    def least_recently_used(self, n: int) -> None:
        self.both("least_recently_used", n)

    @rule(data=st.data(), tokens=st.lists(TOKEN, max_size=10))
    def peek_then_take_prefix(self, data, tokens: list[int]) -> None:
        """The scheduler's admission: a pure peek (checked to change nothing), then maybe taking what it found."""
        before = (self.real.stats(), self.real.blocks_in_state())
        hits = self.both("peek_prefix", tokens, self.count(data, 4))
        assert (self.real.stats(), self.real.blocks_in_state()) == before, "peek_prefix changed something"
        if hits is None or not data.draw(st.booleans(), label="admit"):
            return
        ids = list(hits)
        if self.bad_now_and_then(data):
            ids.append(data.draw(st.integers(-1, self.model.num_blocks), label="bad id"))
        lookups = len(ids) + data.draw(st.integers(0, 1), label="the miss that ended the walk")
        try:
            self.model.take_prefix(ids, lookups)
        except ValueError:
            with pytest.raises(ValueError):
                self.real.take_prefix(ids, lookups)
            note("take_prefix: refused")
            return
        self.real.take_prefix(ids, lookups)
        note("take_prefix: taken")
        self.requests.append(ids)  # freed later, like a request's block table

    @rule(data=st.data())
    def commit(self, data) -> None:
        referenced = self.model.blocks_in_state()[2]
        if self.bad_now_and_then(data) or not referenced:
            block = data.draw(st.integers(-1, self.model.num_blocks), label="block")
        else:
            block = data.draw(st.sampled_from(referenced), label="block")
        if self.both("commit", block, self.parent(data), self.page(data)):
            note("commit: registered")

    @rule(data=st.data())
    def evict(self, data) -> None:
        self.both("evict", self.count(data, 3))

    @rule()
    def reset_stats(self) -> None:
        self.both("reset_stats")

    # -- request rules

    @rule(data=st.data())
    def start_request(self, data) -> None:
        """Share the cached prefix of a prompt, allocate the rest, commit every full block as a chain."""
        page = self.model.page_size
        fresh = st.lists(TOKEN, min_size=1, max_size=4 * page)
        # Real workloads repeat prompts (that is what the prefix cache is for): often reuse an earlier one.
        seen = st.sampled_from(self.prompts) if self.prompts else fresh
        prompt = data.draw(st.one_of(fresh, seen), label="prompt")
        self.prompts.append(prompt)
        table = self.both("match_prefix", prompt, (len(prompt) - 1) // page)
        if table:
            note("start_request: prefix hit")
        missing = -(-len(prompt) // page) - len(table)
        if missing > self.model.num_available:
            self.both("free", table)
            return
        num_shared = len(table)
        table += self.both("allocate", missing)
        for index in range(num_shared, len(prompt) // page):
            parent = table[index - 1] if index else ROOT
            self.both("commit", table[index], parent, prompt[index * page : (index + 1) * page])
        self.requests.append(table)

    # No arguments: Hypothesis draws such rules more often than the others, and finishing requests is what fills
    # the LRU list with reusable blocks.
    @precondition(lambda self: self.requests)
    @rule()
    def finish_oldest_request(self) -> None:
        """Release a request's block table, alternately head first (as a plain loop would) and tail first."""
        table = self.requests.pop(0)
        self.tail_first = not self.tail_first
        self.both("free", table[::-1] if self.tail_first else table)

    @invariant()
    def agrees_with_model(self) -> None:
        assert_same_state(self.model, self.real)


class CollidingAllocatorMachine(AllocatorMachine):
    """The same, with every prefix key colliding: results must still only ever be exact matches."""

    constant_key = True


STATEFUL_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorAgainstModel = AllocatorMachine.TestCase
TestAllocatorAgainstModel.settings = STATEFUL_SETTINGS
TestCollidingAllocatorAgainstModel = CollidingAllocatorMachine.TestCase
TestCollidingAllocatorAgainstModel.settings = STATEFUL_SETTINGS


def test_model_and_allocator_agree_when_a_stale_entry_makes_way() -> None:
    """A scripted run through the rarest path: a child cached under a parent that was recycled and recomputed."""
    model, real = AllocatorModel(4, 1), BlockAllocator(4, 1)
    script = [
        ("allocate", 2), ("commit", 0, ROOT, [7]), ("commit", 1, 0, [8]),
        ("free", [0, 1]),  # head first: the head is the least recently used
        ("evict", 1),  # block 0 recycled; block 1 now hangs off a parent that no longer holds its prefix
        ("allocate", 2), ("commit", 0, ROOT, [7]),  # the same first block again, same key as before
        ("lookup", 0, [8]),  # the stale child must not be found
        ("commit", 2, 0, [8]),  # the new child takes the stale one's key; the stale block is freed
        ("lookup", 0, [8]),
    ]
    results = []
    for method, *args in script:
        results.append(agree(model, real, method, *args))
        assert_same_state(model, real)
    assert results[-3:] == [ROOT, True, 2]
    assert not real.is_cached(1) and real.refcount(1) == 0


# ---- the binding, one behaviour per test ------------------------------------------------------------------------------


@pytest.fixture
def allocator() -> BlockAllocator:
    return BlockAllocator(num_blocks=8, page_size=2)


def cache_chain(allocator: BlockAllocator, tokens: list[int]) -> list[int]:
    """Allocate and commit one block per page of `tokens`, chained from the root, as a finished request would."""
    page = allocator.page_size
    ids = allocator.allocate(len(tokens) // page)
    parent = ROOT
    for i, block in enumerate(ids):
        assert allocator.commit(block, parent, tokens[i * page : (i + 1) * page])
        parent = block
    return ids


def test_constructor_rejects_non_positive_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0, 4)
    with pytest.raises(ValueError, match="page_size"):
        BlockAllocator(4, 0)


def test_sizes_are_read_only_properties(allocator: BlockAllocator) -> None:
    assert (allocator.num_blocks, allocator.page_size) == (8, 2)
    with pytest.raises(AttributeError):
        allocator.num_blocks = 3


def test_fresh_allocator_hands_out_low_ids_first(allocator: BlockAllocator) -> None:
    assert allocator.allocate(2) == [0, 1]
    assert (allocator.num_free, allocator.num_referenced, allocator.num_available) == (6, 2, 6)


def test_exhaustion_raises_runtime_error_naming_request_and_availability(allocator: BlockAllocator) -> None:
    allocator.allocate(7)
    with pytest.raises(RuntimeError, match=r"allocate\(2\): only 1 blocks available"):
        allocator.allocate(2)
    assert allocator.num_free == 1
    allocator.check()


def test_double_free_raises_value_error_naming_the_block_and_changes_nothing(allocator: BlockAllocator) -> None:
    ids = allocator.allocate(2)
    with pytest.raises(ValueError, match=f"block {ids[1]} has refcount 1"):
        allocator.free([ids[0], ids[1], ids[1]])
    assert [allocator.refcount(b) for b in ids] == [1, 1]
    with pytest.raises(ValueError, match="out of range"):
        allocator.free([99])


def test_keyword_arguments_use_the_documented_names(allocator: BlockAllocator) -> None:
    ids = allocator.allocate(n=2)
    assert allocator.commit(block_id=ids[0], parent=ROOT, tokens=[5, 6])
    allocator.fork(ids=ids)
    allocator.free(ids=ids)
    assert allocator.lookup(parent=ROOT, tokens=[5, 6]) == ids[0]
    assert allocator.match_prefix(tokens=[5, 6, 7], max_blocks=1) == [ids[0]]
    assert allocator.evict(n=0) == 0
    assert allocator.refcount(block_id=ids[0]) == 3
    assert allocator.is_cached(block_id=ids[0])
    assert allocator.generation(block_id=ids[0]) == 0
    allocator.check_holders(holders={ids[0]: 3, ids[1]: 1})


def test_a_finished_requests_prefix_is_shared_by_the_next_request(allocator: BlockAllocator) -> None:
    chain = cache_chain(allocator, [1, 2, 3, 4, 5, 6])
    allocator.free(list(reversed(chain)))
    assert (allocator.num_cached_unused, allocator.num_cached) == (3, 3)
    assert allocator.match_prefix([1, 2, 3, 4, 9], max_blocks=8) == chain[:2]
    assert [allocator.refcount(b) for b in chain] == [1, 1, 0]
    stats = allocator.stats()
    assert (stats["lookups"], stats["hits"]) == (2, 2)
    allocator.check()


def test_lookup_rejects_a_partial_page(allocator: BlockAllocator) -> None:
    with pytest.raises(ValueError, match="page_size=2"):
        allocator.lookup(ROOT, [1])


def test_commit_of_an_unreferenced_block_is_a_value_error(allocator: BlockAllocator) -> None:
    with pytest.raises(ValueError, match="not referenced"):
        allocator.commit(3, ROOT, [1, 2])


def test_colliding_keys_never_return_another_prefix() -> None:
    allocator = BlockAllocator._with_constant_hash_for_testing(8, 2)
    (block,) = cache_chain(allocator, [1, 2])
    assert allocator.lookup(ROOT, [2, 1]) == ROOT
    assert allocator.lookup(block, [1, 2]) == ROOT
    assert allocator.lookup(ROOT, [1, 2]) == block


def test_eviction_follows_least_recent_release(allocator: BlockAllocator) -> None:
    ids = allocator.allocate(3)
    for i, block in enumerate(ids):
        allocator.commit(block, ROOT, [i, i])
    allocator.free([ids[1], ids[2], ids[0]])
    assert allocator.blocks_in_state()[1] == [ids[1], ids[2], ids[0]]
    assert allocator.evict(2) == 2
    assert allocator.blocks_in_state()[1] == [ids[0]]
    assert allocator.stats()["evictions"] == 2


def test_stats_has_event_counters_and_counts_and_reset_keeps_counts(allocator: BlockAllocator) -> None:
    cache_chain(allocator, [1, 2])
    assert set(allocator.stats()) == {
        "lookups", "hits", "evictions", "allocations", "commits",
        "num_free", "num_cached_unused", "num_referenced", "num_cached",
    }
    allocator.reset_stats()
    stats = allocator.stats()
    assert (stats["allocations"], stats["commits"], stats["num_cached"], stats["num_referenced"]) == (0, 0, 1, 1)


def test_check_holders_reports_a_leaked_reference(allocator: BlockAllocator) -> None:
    ids = allocator.allocate(2)
    allocator.check_holders({ids[0]: 1, ids[1]: 1})
    with pytest.raises(RuntimeError, match=f"block {ids[1]} has refcount 1 but 0"):
        allocator.check_holders({ids[0]: 1})


@pytest.mark.parametrize(
    "kind",
    ["refcount_plus_one", "refcount_minus_one", "duplicate_in_free_list", "break_lru_back_link",
     "drop_map_entry", "wrong_stored_key"],
)
def test_check_detects_corruption(kind: str) -> None:
    # Block 0 referenced and cached, block 1 cached-unused (in the LRU list), the rest free.
    allocator = BlockAllocator(4, 1)
    head, tail = cache_chain(allocator, [1, 2])
    allocator.free([tail])
    allocator.check()
    victim = {"refcount_plus_one": tail, "break_lru_back_link": tail, "duplicate_in_free_list": 2}.get(kind, head)
    allocator._corrupt_for_testing(kind, victim)
    with pytest.raises(RuntimeError, match="BlockAllocator.check"):
        allocator.check()


def test_public_methods_have_docstrings() -> None:
    names = ["allocate", "free", "fork", "lookup", "match_prefix", "commit", "evict", "refcount", "is_cached",
             "generation", "stats", "reset_stats", "check", "check_holders", "blocks_in_state"]
    for name in names:
        doc = getattr(BlockAllocator, name).__doc__
        assert doc and len(doc.splitlines()) > 1, f"{name} has no docstring"
    assert "CACHED_UNUSED" in BlockAllocator.__doc__
