// Unit tests of the C++ BlockAllocator (no torch, no Python). Each test names one behaviour.
#include "allocator/block_allocator.h"

#include <gtest/gtest.h>

#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace cbcore {

const char* corruption_label(Corruption kind) {
  static const char* const kNames[] = {"RefcountPlusOne",  "RefcountMinusOne", "DuplicateInFreeList",
                                       "BreakLruBackLink", "DropMapEntry",     "WrongStoredKey"};
  return kNames[static_cast<int>(kind)];
}

// Readable parameter values in gtest / ctest output (found by ADL).
void PrintTo(Corruption kind, std::ostream* os) { *os << corruption_label(kind); }

namespace {

using Ids = std::vector<int>;
using Tokens = std::vector<Token>;

// Every block hashes to the same key: any two commits collide.
uint64_t constant_hash(uint64_t, const Token*, size_t) { return 42; }

std::vector<int> free_ids(const BlockAllocator& a) { return std::get<0>(a.blocks_in_state()); }
std::vector<int> lru_ids(const BlockAllocator& a) { return std::get<1>(a.blocks_in_state()); }
std::vector<int> referenced_ids(const BlockAllocator& a) { return std::get<2>(a.blocks_in_state()); }

// Allocates one block per page of `tokens`, commits them as a chain and returns the ids.
Ids cache_chain(BlockAllocator& a, const Tokens& tokens) {
  const int page = a.page_size();
  const int n = static_cast<int>(tokens.size()) / page;
  Ids ids = a.allocate(n);
  int parent = -1;
  for (int i = 0; i < n; ++i) {
    Tokens chunk(tokens.begin() + i * page, tokens.begin() + (i + 1) * page);
    EXPECT_TRUE(a.commit(ids[i], parent, chunk));
    parent = ids[i];
  }
  return ids;
}

// ---- construction and allocation ------------------------------------------------------

TEST(BlockAllocator, RejectsNonPositiveSizes) {
  EXPECT_THROW(BlockAllocator(0, 4), std::invalid_argument);
  EXPECT_THROW(BlockAllocator(4, 0), std::invalid_argument);
  EXPECT_THROW(BlockAllocator(-1, 4), std::invalid_argument);
}

TEST(BlockAllocator, FreshAllocatorHandsOutLowIdsFirst) {
  BlockAllocator a(8, 4);
  EXPECT_EQ(a.allocate(3), (Ids{0, 1, 2}));
  EXPECT_EQ(a.num_free(), 5);
  EXPECT_EQ(a.num_referenced(), 3);
  EXPECT_EQ(a.refcount(1), 1);
  EXPECT_EQ(a.stats().allocations, 3);
  a.check();
}

TEST(BlockAllocator, AllocateZeroReturnsNothing) {
  BlockAllocator a(2, 4);
  EXPECT_TRUE(a.allocate(0).empty());
  EXPECT_THROW(a.allocate(-1), std::invalid_argument);
}

TEST(BlockAllocator, ExhaustionThrowsAndChangesNothing) {
  BlockAllocator a(4, 2);
  a.allocate(3);
  try {
    a.allocate(2);
    FAIL() << "allocate(2) with one block available must throw";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("allocate(2)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("only 1 blocks available"), std::string::npos) << msg;
  }
  EXPECT_EQ(a.num_free(), 1);
  EXPECT_EQ(a.num_referenced(), 3);
  EXPECT_EQ(a.stats().allocations, 3);
  a.check();
}

// ---- refcounts, free and fork ---------------------------------------------------------

TEST(BlockAllocator, FreeingAnUnhashedBlockReturnsItToTheFreeListAndBumpsGeneration) {
  BlockAllocator a(4, 2);
  Ids ids = a.allocate(2);
  const uint64_t gen = a.generation(ids[0]);
  a.free({ids[0]});
  EXPECT_EQ(a.refcount(ids[0]), 0);
  EXPECT_EQ(a.generation(ids[0]), gen + 1);
  EXPECT_EQ(free_ids(a), (Ids{0, 2, 3}));
  EXPECT_EQ(a.allocate(1), (Ids{ids[0]})) << "the free list is a stack: last freed is reused first";
  a.check();
}

TEST(BlockAllocator, ForkAddsOneReferencePerIdAndFreeReleasesOne) {
  BlockAllocator a(4, 2);
  Ids ids = a.allocate(2);
  a.fork(ids);
  a.fork({ids[0]});
  EXPECT_EQ(a.refcount(ids[0]), 3);
  EXPECT_EQ(a.refcount(ids[1]), 2);
  EXPECT_EQ(referenced_ids(a), ids);
  a.free({ids[0], ids[0], ids[1]});  // duplicates in one call are separate releases
  EXPECT_EQ(a.refcount(ids[0]), 1);
  EXPECT_EQ(a.refcount(ids[1]), 1);
  a.check_holders({{ids[0], 1}, {ids[1], 1}});
  a.check();
}

TEST(BlockAllocator, ForkOfUnreferencedBlockThrowsAndChangesNothing) {
  BlockAllocator a(4, 2);
  Ids ids = a.allocate(1);
  EXPECT_THROW(a.fork({ids[0], 3}), std::invalid_argument);
  EXPECT_EQ(a.refcount(ids[0]), 1);
  EXPECT_THROW(a.fork({7}), std::invalid_argument);
  a.check();
}

TEST(BlockAllocator, DoubleFreeThrowsAndChangesNothing) {
  BlockAllocator a(4, 2);
  Ids ids = a.allocate(2);
  EXPECT_THROW(a.free({ids[0], ids[1], ids[1]}), std::invalid_argument);
  EXPECT_EQ(a.refcount(ids[0]), 1) << "a rejected call must not release the valid ids either";
  EXPECT_EQ(a.refcount(ids[1]), 1);
  EXPECT_THROW(a.free({ids[0], 99}), std::invalid_argument);
  EXPECT_THROW(a.free({3}), std::invalid_argument);
  EXPECT_EQ(a.refcount(ids[0]), 1);
  a.check();
  a.free(ids);  // the scratch counters were reset: a valid free still works
  EXPECT_EQ(a.num_free(), 4);
  a.check();
}

TEST(BlockAllocator, CheckHoldersComparesRefcountsWithKnownHolders) {
  BlockAllocator a(4, 2);
  Ids ids = a.allocate(2);
  a.check_holders({{ids[0], 1}, {ids[1], 1}});
  EXPECT_THROW(a.check_holders({{ids[0], 1}}), std::runtime_error);  // leaked reference
  EXPECT_THROW(a.check_holders({{ids[0], 1}, {ids[1], 1}, {3, 1}}), std::runtime_error);
  EXPECT_THROW(a.check_holders({{9, 0}}), std::runtime_error);
}

// ---- prefix cache ---------------------------------------------------------------------

TEST(BlockAllocator, CommittedChainIsFoundAgainByMatchPrefix) {
  BlockAllocator a(8, 2);
  Ids chain = cache_chain(a, {1, 2, 3, 4, 5, 6});
  a.free(chain);
  EXPECT_EQ(a.num_cached_unused(), 3);
  EXPECT_EQ(a.num_cached(), 3);

  Ids hit = a.match_prefix({1, 2, 3, 4, 5, 6, 7}, 10);  // the partial last block is ignored
  EXPECT_EQ(hit, chain);
  for (int id : chain) EXPECT_EQ(a.refcount(id), 1);
  EXPECT_EQ(a.num_cached_unused(), 0);
  EXPECT_EQ(a.stats().lookups, 3);
  EXPECT_EQ(a.stats().hits, 3);
  a.check();
}

TEST(BlockAllocator, MatchPrefixStopsAtFirstMissAndAtMaxBlocks) {
  BlockAllocator a(8, 2);
  Ids chain = cache_chain(a, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(a.match_prefix({1, 2, 3, 9, 5, 6}, 10), (Ids{chain[0]}));
  EXPECT_EQ(a.match_prefix({1, 2, 3, 4, 5, 6}, 2), (Ids{chain[0], chain[1]}));
  EXPECT_TRUE(a.match_prefix({1, 2, 3, 4}, 0).empty());
  EXPECT_TRUE(a.match_prefix({1}, 5).empty());
  EXPECT_EQ(a.refcount(chain[0]), 3);
  EXPECT_EQ(a.refcount(chain[2]), 1);
  a.check();
}

TEST(BlockAllocator, PeekPrefixFindsWhatMatchPrefixWouldAndChangesNothing) {
  BlockAllocator a(8, 2);
  Ids chain = cache_chain(a, {1, 2, 3, 4, 5, 6});
  a.free(chain);
  const auto stats_before = a.stats();
  const auto states_before = a.blocks_in_state();
  EXPECT_EQ(a.peek_prefix({1, 2, 3, 4, 9, 9}, 10), (Ids{chain[0], chain[1]}));
  EXPECT_EQ(a.peek_prefix({1, 2, 3, 4, 5, 6}, 2), (Ids{chain[0], chain[1]}));
  EXPECT_TRUE(a.peek_prefix({7, 7}, 3).empty());
  EXPECT_EQ(a.stats().lookups, stats_before.lookups);
  EXPECT_EQ(a.stats().hits, stats_before.hits);
  EXPECT_EQ(a.blocks_in_state(), states_before);  // no reference taken, the LRU order untouched
  for (int id : chain) EXPECT_EQ(a.refcount(id), 0);
  a.check();
}

TEST(BlockAllocator, TakePrefixReferencesThePeekedBlocksAndCountsTheLookups) {
  BlockAllocator a(8, 2);
  Ids chain = cache_chain(a, {1, 2, 3, 4, 5, 6});
  a.free(chain);
  Ids hit = a.peek_prefix({1, 2, 3, 4, 9, 9}, 10);
  a.take_prefix(hit, 3);  // two hits and the miss that ended the walk
  EXPECT_EQ(a.refcount(chain[0]), 1);
  EXPECT_EQ(a.refcount(chain[1]), 1);
  EXPECT_EQ(a.refcount(chain[2]), 0);
  EXPECT_EQ(a.num_cached_unused(), 1);
  EXPECT_EQ(a.stats().lookups, 3);
  EXPECT_EQ(a.stats().hits, 2);
  a.check();
}

TEST(BlockAllocator, TakePrefixOfAnUnhashedBlockThrowsAndChangesNothing) {
  BlockAllocator a(4, 2);
  Ids chain = cache_chain(a, {1, 2});
  Ids fresh = a.allocate(1);
  EXPECT_THROW(a.take_prefix({chain[0], fresh[0]}, 2), std::invalid_argument);
  EXPECT_THROW(a.take_prefix({chain[0]}, 0), std::invalid_argument);
  EXPECT_EQ(a.refcount(chain[0]), 1);
  EXPECT_EQ(a.stats().lookups, 0);
  a.check();
}

TEST(BlockAllocator, LookupMissesOnOtherTokensOrOtherParent) {
  BlockAllocator a(8, 2);
  Ids chain = cache_chain(a, {1, 2, 3, 4});
  EXPECT_EQ(a.lookup(-1, {1, 3}), -1);
  EXPECT_EQ(a.lookup(-1, {3, 4}), -1) << "{3, 4} is cached only after {1, 2}";
  EXPECT_EQ(a.lookup(chain[0], {3, 4}), chain[1]);
  EXPECT_EQ(a.lookup(chain[1], {1, 2}), -1);
  EXPECT_EQ(a.stats().lookups, 4);
  EXPECT_EQ(a.stats().hits, 1);
  EXPECT_THROW(a.lookup(-1, {1, 2, 3}), std::invalid_argument);
  EXPECT_THROW(a.lookup(8, {1, 2}), std::invalid_argument);
}

TEST(BlockAllocator, CommitRejectsDuplicatesBrokenChainsAndBadArguments) {
  BlockAllocator a(8, 2);
  Ids first = cache_chain(a, {1, 2});
  Ids other = a.allocate(2);
  EXPECT_FALSE(a.commit(other[0], -1, {1, 2})) << "same prefix already cached";
  EXPECT_FALSE(a.is_cached(other[0]));
  EXPECT_FALSE(a.commit(other[1], other[0], {3, 4})) << "parent is not hashed";
  EXPECT_FALSE(a.commit(first[0], -1, {1, 2})) << "already hashed";
  EXPECT_THROW(a.commit(other[0], -1, {1}), std::invalid_argument);
  EXPECT_THROW(a.commit(5, -1, {7, 7}), std::invalid_argument) << "block 5 is free";
  EXPECT_EQ(a.stats().commits, 1);
  a.check();
}

TEST(BlockAllocator, CachedBlocksAreEvictedInLeastRecentlyUsedOrder) {
  BlockAllocator a(4, 1);
  Ids ids = a.allocate(4);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(a.commit(ids[i], -1, {Token(100 + i)}));
  a.free({ids[2], ids[0], ids[3], ids[1]});
  EXPECT_EQ(lru_ids(a), (Ids{ids[2], ids[0], ids[3], ids[1]}));
  // A hit takes the block out of the LRU list; releasing it again makes it most recent.
  ASSERT_EQ(a.lookup(-1, {100}), ids[0]);
  a.free({ids[0]});
  EXPECT_EQ(lru_ids(a), (Ids{ids[2], ids[3], ids[1], ids[0]}));

  EXPECT_EQ(a.allocate(1), (Ids{ids[2]}));
  EXPECT_EQ(a.evict(2), 2);
  EXPECT_EQ(lru_ids(a), (Ids{ids[0]}));
  EXPECT_EQ(a.stats().evictions, 3);
  EXPECT_FALSE(a.is_cached(ids[3]));
  EXPECT_EQ(a.lookup(-1, {103}), -1);
  EXPECT_EQ(a.evict(10), 1);
  a.check();
}

TEST(BlockAllocator, LeastRecentlyUsedNamesWhatEvictWouldFreeAndChangesNothing) {
  BlockAllocator a(8, 2);
  Ids first = cache_chain(a, {1, 2, 3, 4});
  Ids second = cache_chain(a, {5, 6});
  a.free({first[1], first[0]});
  a.free(second);
  EXPECT_EQ(a.least_recently_used(2), (Ids{first[1], first[0]}));
  EXPECT_EQ(a.least_recently_used(10), (Ids{first[1], first[0], second[0]}));
  EXPECT_TRUE(a.least_recently_used(0).empty());
  EXPECT_EQ(a.num_cached_unused(), 3);
  EXPECT_THROW(a.least_recently_used(-1), std::invalid_argument);
  EXPECT_EQ(a.evict(2), 2);
  EXPECT_EQ(a.least_recently_used(5), (Ids{second[0]}));
  a.check();
}

TEST(BlockAllocator, AllocateEvictsOnlyWhenTheFreeListIsEmpty) {
  BlockAllocator a(3, 1);
  Ids ids = a.allocate(2);
  ASSERT_TRUE(a.commit(ids[0], -1, {7}));
  a.free(ids);  // ids[0] -> LRU, ids[1] -> free list
  EXPECT_EQ(a.num_available(), 3);
  EXPECT_EQ(a.allocate(2).size(), 2u);
  EXPECT_TRUE(a.is_cached(ids[0])) << "two free blocks were enough";
  EXPECT_EQ(a.allocate(1), (Ids{ids[0]}));
  EXPECT_FALSE(a.is_cached(ids[0]));
  EXPECT_EQ(a.stats().evictions, 1);
  a.check();
}

// ---- collision safety and generations -------------------------------------------------

TEST(BlockAllocator, FullKeyCollisionNeverReturnsTheWrongBlock) {
  BlockAllocator a(8, 2, &constant_hash);
  Ids chain = a.allocate(2);
  ASSERT_TRUE(a.commit(chain[0], -1, {1, 2}));
  EXPECT_FALSE(a.commit(chain[1], chain[0], {3, 4})) << "its key collides with chain[0]'s...";
  EXPECT_FALSE(a.is_cached(chain[1])) << "...so it is left unhashed";
  a.free(chain);
  // Every lookup lands on chain[0]'s entry; only the exact (parent, tokens) may hit it.
  EXPECT_EQ(a.lookup(-1, {9, 9}), -1) << "different tokens";
  EXPECT_EQ(a.lookup(chain[0], {1, 2}), -1) << "same tokens, different parent";
  EXPECT_EQ(a.match_prefix({1, 2, 3, 4}, 5), (Ids{chain[0]}));
  EXPECT_EQ(a.stats().hits, 1);

  Ids other = a.allocate(1);
  EXPECT_FALSE(a.commit(other[0], -1, {5, 6})) << "the key is taken by a live entry";
  a.check();
}

TEST(BlockAllocator, RecycledParentMakesItsCachedChildrenUnreachable) {
  BlockAllocator a(4, 1);
  Ids chain = cache_chain(a, {1, 2});
  a.free({chain[0], chain[1]});  // head first: the head is evicted first
  EXPECT_EQ(a.evict(1), 1);
  EXPECT_FALSE(a.is_cached(chain[0]));
  EXPECT_EQ(a.generation(chain[0]), 1u);

  // The recycled block gets the same first-block contents again: same key as before.
  Ids again = a.allocate(1);
  ASSERT_EQ(again[0], chain[0]);
  ASSERT_TRUE(a.commit(again[0], -1, {1}));
  EXPECT_EQ(a.lookup(again[0], {2}), -1)
      << "the child was computed from the old contents of its parent: stale";
  EXPECT_TRUE(a.is_cached(chain[1])) << "stale entries age out through the LRU";

  // A fresh child with the same prefix takes the stale entry's place.
  Ids child = a.allocate(1);
  EXPECT_TRUE(a.commit(child[0], again[0], {2}));
  EXPECT_FALSE(a.is_cached(chain[1]));
  EXPECT_EQ(a.num_free(), 2) << "the stale block went back to the free list";
  EXPECT_EQ(a.lookup(again[0], {2}), child[0]);
  a.check();
}

// ---- check() catches corruption -------------------------------------------------------

std::string corruption_name(const ::testing::TestParamInfo<Corruption>& info) {
  return corruption_label(info.param);
}

class CorruptionTest : public ::testing::TestWithParam<Corruption> {};

TEST_P(CorruptionTest, CheckReportsIt) {
  // Block 0: referenced and hashed; block 1: cached-unused (hashed, LRU); blocks 2-3: free.
  BlockAllocator a(4, 1);
  Ids ids = a.allocate(2);
  ASSERT_TRUE(a.commit(ids[0], -1, {1}));
  ASSERT_TRUE(a.commit(ids[1], ids[0], {2}));
  a.free({ids[1]});
  a.check();

  // A referenced block with one refcount too many breaks no structural invariant (only
  // check_holders sees it), so the refcount corruptions hit blocks whose list placement
  // depends on the count.
  const Corruption kind = GetParam();
  int victim = ids[0];
  if (kind == Corruption::kRefcountPlusOne || kind == Corruption::kBreakLruBackLink) victim = ids[1];
  if (kind == Corruption::kDuplicateInFreeList) victim = 2;
  a.corrupt_for_testing(kind, victim);
  EXPECT_THROW(a.check(), std::runtime_error);
}

INSTANTIATE_TEST_SUITE_P(AllKinds, CorruptionTest,
                         ::testing::Values(Corruption::kRefcountPlusOne, Corruption::kRefcountMinusOne,
                                           Corruption::kDuplicateInFreeList, Corruption::kBreakLruBackLink,
                                           Corruption::kDropMapEntry, Corruption::kWrongStoredKey),
                         corruption_name);

TEST(BlockAllocator, CheckCatchesARefcountDroppedToZeroWithoutMovingTheBlock) {
  BlockAllocator a(2, 1);
  Ids ids = a.allocate(1);
  a.corrupt_for_testing(Corruption::kRefcountMinusOne, ids[0]);
  EXPECT_THROW(a.check(), std::runtime_error);
}

TEST(BlockAllocator, ResetStatsZeroesEventCountersOnly) {
  BlockAllocator a(4, 1);
  Ids chain = cache_chain(a, {1});
  a.match_prefix({1}, 1);
  a.reset_stats();
  EXPECT_EQ(a.stats().lookups, 0);
  EXPECT_EQ(a.stats().hits, 0);
  EXPECT_EQ(a.stats().allocations, 0);
  EXPECT_EQ(a.stats().commits, 0);
  EXPECT_EQ(a.num_cached(), 1);
  EXPECT_EQ(a.refcount(chain[0]), 2);
}

TEST(BlockAllocator, PrefixPathNamesTheWholeChainUntilALinkChanges) {
  BlockAllocator a(8, 2);
  Ids chain = cache_chain(a, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(a.prefix_path(chain[2]), (std::vector<Tokens>{{1, 2}, {3, 4}, {5, 6}}));
  EXPECT_EQ(a.prefix_path(chain[0]), (std::vector<Tokens>{{1, 2}}));
  Ids fresh = a.allocate(1);
  EXPECT_TRUE(a.prefix_path(fresh[0]).empty());  // not hashed
  // The middle block is evicted (its K/V recycled): the tail's chain can no longer be named.
  a.free({chain[2], chain[1], chain[0]});
  a.free(fresh);
  Ids all = a.allocate(8);  // evicts every cached block
  EXPECT_TRUE(a.prefix_path(chain[2]).empty());
  a.free(all);
  a.check();
}

TEST(BlockAllocator, ForgetPrefixesFreesUnusedUnhashesHeldAndBreaksTheirChains) {
  BlockAllocator a(8, 2);
  Ids unused = cache_chain(a, {7, 7});
  a.free(unused);
  Ids held = cache_chain(a, {1, 2, 3, 4});
  EXPECT_EQ(a.forget_prefixes(), 3);
  a.check();
  EXPECT_EQ(a.num_cached(), 0);
  EXPECT_EQ(a.num_free(), 6);  // the unused block, and the 5 never allocated
  EXPECT_EQ(a.refcount(held[0]), 1);  // its holder keeps it
  EXPECT_TRUE(a.match_prefix({1, 2, 3, 4}, 2).empty());
  Ids next = a.allocate(1);
  EXPECT_FALSE(a.commit(next[0], held[1], {5, 6}));  // never chained on K/V of the old weights
  a.free({next[0], held[1], held[0]});
  EXPECT_EQ(a.num_free(), 8);  // unhashed: straight to the free list
  a.check();
}

TEST(ChainHash, DependsOnParentAndTokenOrder) {
  const Token ab[] = {1, 2};
  const Token ba[] = {2, 1};
  EXPECT_NE(chain_hash(kRootKey, ab, 2), chain_hash(kRootKey, ba, 2));
  EXPECT_NE(chain_hash(kRootKey, ab, 2), chain_hash(kRootKey + 1, ab, 2));
  EXPECT_EQ(chain_hash(kRootKey, ab, 2), chain_hash(kRootKey, ab, 2));
}

}  // namespace
}  // namespace cbcore
