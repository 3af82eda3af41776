// Block allocator for the paged KV cache: free list, refcounts, prefix hash chain,
// and an LRU list of reusable cached blocks.
//
// It hands out block *ids* only and knows nothing about tensors (no torch here), so it
// builds standalone for the C++ unit tests. The Python side (cbcore/cache.py) owns the
// K/V tensors and uses these ids as indices into them.
//
// ---------------------------------------------------------------------------------------
// Invariants (checked by check(), which the tests call after every step)
// ---------------------------------------------------------------------------------------
// Every block id in [0, num_blocks) is in exactly one state:
//
//   state          refcount  hashed (in prefix map)  lives in
//   -------------  --------  ----------------------  -----------------------------------
//   FREE           0         no                      free list (a stack)
//   CACHED_UNUSED  0         yes                     LRU list (head = evicted first)
//   REFERENCED     >= 1      yes or no               the block tables of its holders
//
// * refcount == number of holders (see the table below); it never goes negative.
// * Only full blocks are hashed: commit() is given exactly page_size tokens.
// * free list + LRU list + referenced blocks partition all blocks, and the counters
//   (num_free, num_cached_unused, num_referenced, num_cached) match that partition.
// * Every hashed block has exactly one entry in the prefix map, under its stored key.
//
// Who holds a reference (= who must call free() once per reference it holds):
//
//   holder                     takes a reference via             releases via
//   -------------------------  --------------------------------  -------------------------
//   a request's block table    allocate(), lookup(),             free() when the request
//                              match_prefix(), fork()            finishes / is preempted
//   the prefix cache           (holds NO reference: a cached block with refcount 0 sits in
//                              the LRU list and may be evicted by allocate() or evict())
//   the swap pool (later)      fork() while a copy is in flight  free() when it is done
//
// Example (page_size = 2): request A allocates [0, 1] for prompt "a b c d" and commits
// both blocks (0 under root, 1 under 0). A finishes and frees [1, 0]: both become
// CACHED_UNUSED, LRU order 1, 0. Request B with prompt "a b c d e" calls
// match_prefix -> [0, 1] (refcounts 1, 1, REFERENCED again) and allocate(1) -> [2] for
// "e". Blocks are evicted only when allocate() runs out of FREE blocks.
//
// Freeing order matters for the LRU: free() releases ids in the order given, so passing a
// block table reversed (tail first) makes the tail blocks older, and they are evicted
// before the shared head of the chain.
//
// ---------------------------------------------------------------------------------------
// Collision safety
// ---------------------------------------------------------------------------------------
// A block's key is a 64-bit hash chained over its parent's key (kRootKey for the first
// block) and its own tokens. The map is only an index: each cached block also stores its
// tokens, its parent id and the parent's *generation* at commit time. A block's
// generation is bumped whenever its contents stop being what was cached (it goes back to
// the free list or is evicted). lookup(parent, tokens) hits only when the candidate's
// stored tokens, parent id and parent generation all match, so even a full 64-bit
// collision, or a parent that has been recycled, can never hand out the wrong K/V.
// Children of a recycled parent become unreachable ("stale") and age out through the LRU;
// commit() replaces a stale entry that is in the way of a new one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace cbcore {

using Token = int64_t;

// Hash of one block given its parent's key and its tokens. Swappable for tests only.
using BlockHashFn = uint64_t (*)(uint64_t parent_key, const Token* tokens, size_t n);

// The production hash: splitmix64 mixing, one round per token, chained from parent_key.
uint64_t chain_hash(uint64_t parent_key, const Token* tokens, size_t n);

// Key used as the "parent key" of the first block of every sequence.
constexpr uint64_t kRootKey = 0x6a09e667f3bcc908ULL;

// Deliberate damage for tests of check(); never used by the engine.
enum class Corruption {
  kRefcountPlusOne,      // refcount changes without moving the block between lists
  kRefcountMinusOne,     // same, downwards (may go negative)
  kDuplicateInFreeList,  // push the block onto the free list a second time
  kBreakLruBackLink,     // the block's LRU prev pointer no longer matches
  kDropMapEntry,         // the block stays hashed but its map entry disappears
  kWrongStoredKey,       // the block's stored key no longer matches its map entry
};

struct AllocatorStats {
  int64_t lookups = 0;
  int64_t hits = 0;
  int64_t evictions = 0;
  int64_t allocations = 0;  // blocks handed out by allocate()
  int64_t commits = 0;      // successful commit() calls
};

class BlockAllocator {
 public:
  // Throws std::invalid_argument when num_blocks < 1 or page_size < 1.
  BlockAllocator(int num_blocks, int page_size, BlockHashFn hash = &chain_hash);

  int num_blocks() const { return num_blocks_; }
  int page_size() const { return page_size_; }

  // n fresh blocks with refcount 1: free list first, then LRU evictions.
  // Throws std::runtime_error (and changes nothing) when fewer than n are available.
  std::vector<int> allocate(int n);
  // One release per id (duplicates allowed). All ids are validated before any is
  // released; a bad id throws std::invalid_argument and changes nothing.
  void free(const std::vector<int>& ids);
  // One more reference per id; every id must be REFERENCED.
  void fork(const std::vector<int>& ids);

  // The cached block holding exactly `tokens` after `parent` (-1 = root), with its
  // refcount + 1, or -1.
  int lookup(int parent, const std::vector<Token>& tokens);
  // lookup() over the full blocks of `tokens` from the root; stops at the first miss
  // or after max_blocks hits.
  std::vector<int> match_prefix(const std::vector<Token>& tokens, int max_blocks);
  // The blocks match_prefix() would return, with nothing changed: no reference taken, no
  // lookup counted, the LRU order untouched. The scheduler asks this of a waiting request
  // every step; only take_prefix() at admission changes anything.
  std::vector<int> peek_prefix(const std::vector<Token>& tokens, int max_blocks) const;
  // Takes one reference on each of `ids` (blocks a peek_prefix() just returned: each must
  // be hashed) and counts `lookups` lookups of which ids.size() hit. All ids are validated
  // first; a bad one throws std::invalid_argument and changes nothing.
  void take_prefix(const std::vector<int>& ids, int lookups);
  // Registers a full, referenced, unhashed block under (parent, tokens). False (and
  // nothing cached) when parent is not -1 or hashed, the block is already hashed, or an
  // equivalent / colliding live entry exists.
  bool commit(int block_id, int parent, const std::vector<Token>& tokens);
  // Moves up to n least-recently-used cached blocks to the free list; returns how many.
  int evict(int n);
  // The ids evict(n) would free, in that order, changing nothing (O(n), unlike blocks_in_state()).
  std::vector<int> least_recently_used(int n) const;

  // The tokens of every block from the root to the hashed `block_id`, root first: what the host tier keys an evicted
  // block by. Empty when the block is not hashed or a link of its chain is no longer the one it was committed under
  // (unhashed, or recycled since): the prefix cannot be named exactly then.
  std::vector<std::vector<Token>> prefix_path(int block_id) const;
  // Forgets every cached prefix (the model's weights changed): cached-unused blocks go to the free list, referenced
  // hashed blocks are unhashed with their generation bumped, so nothing computed before is matched or chained on
  // again, while their holders keep using them. Returns the number of blocks forgotten.
  int forget_prefixes();
  int refcount(int block_id) const;
  bool is_cached(int block_id) const;
  uint64_t generation(int block_id) const;

  int num_free() const { return static_cast<int>(free_list_.size()); }
  int num_cached_unused() const { return lru_size_; }
  int num_referenced() const { return num_referenced_; }
  int num_cached() const { return num_hashed_; }
  int num_available() const { return num_free() + num_cached_unused(); }

  const AllocatorStats& stats() const { return stats_; }
  void reset_stats() { stats_ = AllocatorStats{}; }

  // Throws std::runtime_error describing the first broken invariant.
  void check() const;
  // Throws std::runtime_error unless refcount(id) == holders[id] (0 when absent) for all.
  void check_holders(const std::unordered_map<int, int>& holders) const;
  // (free ascending, cached_unused in LRU order (next evicted first), referenced ascending)
  std::tuple<std::vector<int>, std::vector<int>, std::vector<int>> blocks_in_state() const;

  // Test-only: damage the bookkeeping of `block_id` so that check() must notice.
  void corrupt_for_testing(Corruption kind, int block_id);

 private:
  static constexpr int kNone = -1;  // "no block": root parent, end of the LRU list

  // Id validation; `what` names the caller in the error message.
  void require_valid_id(int block_id, const char* what) const;
  void require_page(const std::vector<Token>& tokens, const char* what) const;

  // Key the children of `parent` are hashed under (kRootKey for parent == -1).
  uint64_t parent_key(int parent) const;
  // True when `block_id`'s parent has been recycled since it was committed.
  bool is_stale(int block_id) const;
  // True when the cached `block_id` was committed under exactly (parent, tokens).
  bool matches(int block_id, int parent, const Token* tokens) const;

  void lru_push_back(int block_id);
  void lru_remove(int block_id);
  // Removes the block's prefix-map entry and marks it unhashed.
  void unhash(int block_id);
  // Unhash + bump generation + free list; the block must be CACHED_UNUSED and unlinked.
  void recycle(int block_id);
  // Evicts the LRU head (CACHED_UNUSED -> FREE) and returns its id.
  int evict_one();
  // refcount 0 -> 1: takes the block out of the LRU list if it was cached.
  void take_reference(int block_id);

  int num_blocks_;
  int page_size_;
  BlockHashFn hash_;

  // Per-block state, indexed by block id.
  std::vector<int> refcount_;
  std::vector<uint64_t> generation_;
  std::vector<char> hashed_;
  std::vector<uint64_t> key_;            // valid while hashed
  std::vector<int> parent_;              // valid while hashed
  std::vector<uint64_t> parent_gen_;     // valid while hashed
  std::vector<std::vector<Token>> tokens_;  // valid while hashed; capacity is reused
  std::vector<int> lru_prev_, lru_next_;  // intrusive LRU links; kNone at the ends
  std::vector<int> pending_;             // scratch for free(): releases per id in a call

  std::vector<int> free_list_;  // stack: back() is handed out next
  int lru_head_ = kNone;        // least recently used: evicted first
  int lru_tail_ = kNone;        // most recently used
  int lru_size_ = 0;
  int num_referenced_ = 0;
  int num_hashed_ = 0;

  std::unordered_map<uint64_t, int> prefix_map_;  // key -> block id
  AllocatorStats stats_;
};

}  // namespace cbcore
