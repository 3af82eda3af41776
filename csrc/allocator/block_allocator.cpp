// See block_allocator.h for the invariants and the ownership table.
#include "block_allocator.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace cbcore {

namespace {

// splitmix64 finaliser: a bijection with full avalanche, cheap (3 multiplies).
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

[[noreturn]] void check_failed(const std::string& what) {
  throw std::runtime_error("BlockAllocator.check: " + what);
}

}  // namespace

uint64_t chain_hash(uint64_t parent_key, const Token* tokens, size_t n) {
  // Mixing the length in keeps blocks of different page sizes apart; mixing every token
  // into the running state (rather than xor-ing independent token hashes) makes the key
  // order-sensitive.
  uint64_t h = splitmix64(parent_key ^ static_cast<uint64_t>(n));
  for (size_t i = 0; i < n; ++i) {
    h = splitmix64(h ^ static_cast<uint64_t>(tokens[i]));
  }
  return h;
}

BlockAllocator::BlockAllocator(int num_blocks, int page_size, BlockHashFn hash)
    : num_blocks_(num_blocks), page_size_(page_size), hash_(hash) {
  if (num_blocks < 1 || page_size < 1) {
    throw std::invalid_argument(concat("BlockAllocator: num_blocks and page_size must be >= 1, got num_blocks=",
                                       num_blocks, ", page_size=", page_size));
  }
  if (hash_ == nullptr) throw std::invalid_argument("BlockAllocator: hash function must not be null");
  const size_t n = static_cast<size_t>(num_blocks);
  refcount_.assign(n, 0);
  generation_.assign(n, 0);
  hashed_.assign(n, 0);
  key_.assign(n, 0);
  parent_.assign(n, kNone);
  parent_gen_.assign(n, 0);
  tokens_.resize(n);
  lru_prev_.assign(n, kNone);
  lru_next_.assign(n, kNone);
  pending_.assign(n, 0);
  // Highest id at the bottom of the stack so that a fresh allocator hands out 0, 1, 2, ...
  free_list_.reserve(n);
  for (int id = num_blocks - 1; id >= 0; --id) free_list_.push_back(id);
  prefix_map_.reserve(n);
}

// ---- validation -------------------------------------------------------------------------

void BlockAllocator::require_valid_id(int block_id, const char* what) const {
  if (block_id < 0 || block_id >= num_blocks_) {
    throw std::invalid_argument(
        concat(what, ": block id ", block_id, " is out of range [0, ", num_blocks_, ")"));
  }
}

void BlockAllocator::require_page(const std::vector<Token>& tokens, const char* what) const {
  if (tokens.size() != static_cast<size_t>(page_size_)) {
    throw std::invalid_argument(concat(what, ": expected exactly page_size=", page_size_,
                                       " tokens, got ", tokens.size()));
  }
}

// ---- prefix chain ---------------------------------------------------------------------

uint64_t BlockAllocator::parent_key(int parent) const {
  return parent == kNone ? kRootKey : key_[parent];
}

bool BlockAllocator::is_stale(int block_id) const {
  const int parent = parent_[block_id];
  return parent != kNone && generation_[parent] != parent_gen_[block_id];
}

bool BlockAllocator::matches(int block_id, int parent, const Token* tokens) const {
  if (parent_[block_id] != parent || is_stale(block_id)) return false;
  return std::equal(tokens, tokens + page_size_, tokens_[block_id].begin());
}

// ---- LRU list and state transitions -----------------------------------------------------

void BlockAllocator::lru_push_back(int block_id) {
  lru_prev_[block_id] = lru_tail_;
  lru_next_[block_id] = kNone;
  if (lru_tail_ == kNone) {
    lru_head_ = block_id;
  } else {
    lru_next_[lru_tail_] = block_id;
  }
  lru_tail_ = block_id;
  ++lru_size_;
}

void BlockAllocator::lru_remove(int block_id) {
  const int prev = lru_prev_[block_id];
  const int next = lru_next_[block_id];
  (prev == kNone ? lru_head_ : lru_next_[prev]) = next;
  (next == kNone ? lru_tail_ : lru_prev_[next]) = prev;
  lru_prev_[block_id] = lru_next_[block_id] = kNone;
  --lru_size_;
}

void BlockAllocator::unhash(int block_id) {
  prefix_map_.erase(key_[block_id]);
  hashed_[block_id] = 0;
  --num_hashed_;
}

void BlockAllocator::recycle(int block_id) {
  unhash(block_id);
  // Its K/V will be overwritten: every child committed under the old contents is now stale.
  ++generation_[block_id];
  free_list_.push_back(block_id);
}

int BlockAllocator::evict_one() {
  const int victim = lru_head_;
  lru_remove(victim);
  recycle(victim);
  ++stats_.evictions;
  return victim;
}

void BlockAllocator::take_reference(int block_id) {
  if (refcount_[block_id] == 0) {
    // Only a cached block can be referenced from refcount 0 (free blocks go via allocate).
    lru_remove(block_id);
    ++num_referenced_;
  }
  ++refcount_[block_id];
}

// ---- public API -------------------------------------------------------------------------

std::vector<int> BlockAllocator::allocate(int n) {
  if (n < 0) throw std::invalid_argument(concat("allocate: n must be >= 0, got ", n));
  if (n > num_available()) {
    throw std::runtime_error(concat("allocate(", n, "): only ", num_available(), " blocks available (",
                                    num_free(), " free + ", num_cached_unused(), " cached-unused; ",
                                    num_referenced_, " of ", num_blocks_,
                                    " referenced); free blocks or raise num_blocks"));
  }
  std::vector<int> ids;
  ids.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    if (free_list_.empty()) evict_one();  // puts the LRU head on the free list
    const int id = free_list_.back();
    free_list_.pop_back();
    refcount_[id] = 1;
    ++num_referenced_;
    ids.push_back(id);
  }
  stats_.allocations += n;
  return ids;
}

void BlockAllocator::free(const std::vector<int>& ids) {
  for (int id : ids) require_valid_id(id, "free");
  // Count releases per id so that duplicates are checked against the refcount as a whole.
  int bad = kNone;
  for (int id : ids) {
    if (++pending_[id] > refcount_[id]) {
      bad = id;
      break;
    }
  }
  const int released_in_call = bad == kNone ? 0 : pending_[bad];
  for (int id : ids) pending_[id] = 0;
  if (bad != kNone) {
    throw std::invalid_argument(concat("free: block ", bad, " has refcount ", refcount_[bad],
                                       " but is released ", released_in_call,
                                       " time(s) in this call (double free?); nothing was freed"));
  }
  for (int id : ids) {
    if (--refcount_[id] > 0) continue;
    --num_referenced_;
    if (hashed_[id]) {
      lru_push_back(id);  // most recently used: evicted last
    } else {
      ++generation_[id];
      free_list_.push_back(id);
    }
  }
}

void BlockAllocator::fork(const std::vector<int>& ids) {
  for (int id : ids) {
    require_valid_id(id, "fork");
    if (refcount_[id] < 1) {
      throw std::invalid_argument(concat("fork: block ", id, " is not referenced (refcount 0); "
                                         "only blocks a request holds can be shared; nothing was forked"));
    }
  }
  for (int id : ids) ++refcount_[id];
}

int BlockAllocator::lookup(int parent, const std::vector<Token>& tokens) {
  require_page(tokens, "lookup");
  if (parent != kNone) require_valid_id(parent, "lookup parent");
  ++stats_.lookups;
  // An unhashed parent has no key, so nothing can be cached under it.
  if (parent != kNone && !hashed_[parent]) return kNone;
  const auto it = prefix_map_.find(hash_(parent_key(parent), tokens.data(), tokens.size()));
  if (it == prefix_map_.end() || !matches(it->second, parent, tokens.data())) return kNone;
  take_reference(it->second);
  ++stats_.hits;
  return it->second;
}

std::vector<int> BlockAllocator::match_prefix(const std::vector<Token>& tokens, int max_blocks) {
  if (max_blocks < 0) throw std::invalid_argument(concat("match_prefix: max_blocks must be >= 0, got ", max_blocks));
  const size_t full_blocks = tokens.size() / static_cast<size_t>(page_size_);
  const size_t limit = std::min(full_blocks, static_cast<size_t>(max_blocks));
  std::vector<int> hits;
  std::vector<Token> page(static_cast<size_t>(page_size_));
  int parent = kNone;
  for (size_t b = 0; b < limit; ++b) {
    const auto first = tokens.begin() + static_cast<std::ptrdiff_t>(b * page_size_);
    std::copy(first, first + page_size_, page.begin());
    const int hit = lookup(parent, page);
    if (hit == kNone) break;
    hits.push_back(hit);
    parent = hit;
  }
  return hits;
}

std::vector<int> BlockAllocator::peek_prefix(const std::vector<Token>& tokens, int max_blocks) const {
  if (max_blocks < 0) throw std::invalid_argument(concat("peek_prefix: max_blocks must be >= 0, got ", max_blocks));
  const size_t full_blocks = tokens.size() / static_cast<size_t>(page_size_);
  const size_t limit = std::min(full_blocks, static_cast<size_t>(max_blocks));
  std::vector<int> hits;
  int parent = kNone;
  for (size_t b = 0; b < limit; ++b) {
    const Token* page = tokens.data() + b * static_cast<size_t>(page_size_);
    if (parent != kNone && !hashed_[parent]) break;
    const auto it = prefix_map_.find(hash_(parent_key(parent), page, static_cast<size_t>(page_size_)));
    if (it == prefix_map_.end() || !matches(it->second, parent, page)) break;
    hits.push_back(it->second);
    parent = it->second;
  }
  return hits;
}

void BlockAllocator::take_prefix(const std::vector<int>& ids, int lookups) {
  if (lookups < static_cast<int>(ids.size())) {
    throw std::invalid_argument(concat("take_prefix: ", ids.size(), " hits but only ", lookups, " lookups"));
  }
  for (int id : ids) {
    require_valid_id(id, "take_prefix");
    if (!hashed_[id]) {
      throw std::invalid_argument(concat("take_prefix: block ", id, " is not in the prefix cache (evicted since the "
                                         "peek?); nothing was taken"));
    }
  }
  for (int id : ids) take_reference(id);
  stats_.lookups += lookups;
  stats_.hits += static_cast<int64_t>(ids.size());
}

bool BlockAllocator::commit(int block_id, int parent, const std::vector<Token>& tokens) {
  require_valid_id(block_id, "commit");
  require_page(tokens, "commit");
  if (parent != kNone) require_valid_id(parent, "commit parent");
  if (refcount_[block_id] < 1) {
    throw std::invalid_argument(concat("commit: block ", block_id,
                                       " is not referenced; only a block a request holds can be cached"));
  }
  if (hashed_[block_id]) return false;  // already cached (e.g. it came from a prefix hit)
  if (parent != kNone && !hashed_[parent]) return false;  // the chain is broken above it
  const uint64_t key = hash_(parent_key(parent), tokens.data(), tokens.size());
  const auto it = prefix_map_.find(key);
  if (it != prefix_map_.end()) {
    const int other = it->second;
    // A live entry is either this very prefix (a duplicate) or a genuine collision; keep it.
    // A stale one (its parent was recycled) can never be hit again, so it makes way.
    if (!is_stale(other) || other == parent) return false;
    if (refcount_[other] == 0) {
      lru_remove(other);
      recycle(other);
      ++stats_.evictions;
    } else {
      unhash(other);  // its holders keep using it; it just leaves the cache
    }
  }
  hashed_[block_id] = 1;
  key_[block_id] = key;
  parent_[block_id] = parent;
  parent_gen_[block_id] = parent == kNone ? 0 : generation_[parent];
  tokens_[block_id].assign(tokens.begin(), tokens.end());
  prefix_map_.emplace(key, block_id);
  ++num_hashed_;
  ++stats_.commits;
  return true;
}

int BlockAllocator::evict(int n) {
  if (n < 0) throw std::invalid_argument(concat("evict: n must be >= 0, got ", n));
  int evicted = 0;
  while (evicted < n && lru_head_ != kNone) {
    evict_one();
    ++evicted;
  }
  return evicted;
}

std::vector<std::vector<Token>> BlockAllocator::prefix_path(int block_id) const {
  require_valid_id(block_id, "prefix_path");
  std::vector<std::vector<Token>> path;
  // Parents are committed before their children, so the walk ends at the root; the bound guards a broken chain.
  for (int current = block_id, steps = 0; current != kNone; current = parent_[current], ++steps) {
    if (!hashed_[current] || is_stale(current) || steps == num_blocks_) return {};
    path.push_back(tokens_[current]);
  }
  std::reverse(path.begin(), path.end());
  return path;
}

int BlockAllocator::forget_prefixes() {
  int forgotten = evict(lru_size_);
  for (int id = 0; id < num_blocks_; ++id) {
    if (!hashed_[id]) continue;  // every hashed block left is referenced
    unhash(id);
    ++generation_[id];  // its children, committed under the old weights, become stale
    ++forgotten;
  }
  return forgotten;
}

int BlockAllocator::refcount(int block_id) const {
  require_valid_id(block_id, "refcount");
  return refcount_[block_id];
}

bool BlockAllocator::is_cached(int block_id) const {
  require_valid_id(block_id, "is_cached");
  return hashed_[block_id] != 0;
}

uint64_t BlockAllocator::generation(int block_id) const {
  require_valid_id(block_id, "generation");
  return generation_[block_id];
}

// ---- invariants -------------------------------------------------------------------------

void BlockAllocator::check() const {
  std::vector<char> on_free(static_cast<size_t>(num_blocks_), 0);
  std::vector<char> on_lru(static_cast<size_t>(num_blocks_), 0);

  // Free list: in range, no duplicates, only unhashed refcount-0 blocks.
  for (int id : free_list_) {
    if (id < 0 || id >= num_blocks_) check_failed(concat("free list holds out-of-range id ", id));
    if (on_free[id]) check_failed(concat("block ", id, " is on the free list twice"));
    on_free[id] = 1;
    if (refcount_[id] != 0) check_failed(concat("block ", id, " is on the free list with refcount ", refcount_[id]));
    if (hashed_[id]) check_failed(concat("block ", id, " is on the free list but still hashed"));
  }

  // LRU list: walking forward, every back link must point at the block just visited.
  int prev = kNone;
  int length = 0;
  for (int id = lru_head_; id != kNone; id = lru_next_[id]) {
    if (id < 0 || id >= num_blocks_) check_failed(concat("LRU list holds out-of-range id ", id));
    if (on_lru[id]) check_failed(concat("LRU list has a cycle through block ", id));
    on_lru[id] = 1;
    if (lru_prev_[id] != prev) {
      check_failed(concat("LRU back link of block ", id, " is ", lru_prev_[id], ", expected ", prev));
    }
    if (on_free[id]) check_failed(concat("block ", id, " is on both the free list and the LRU list"));
    if (!hashed_[id]) check_failed(concat("block ", id, " is in the LRU list but not hashed"));
    if (refcount_[id] != 0) check_failed(concat("block ", id, " is in the LRU list with refcount ", refcount_[id]));
    prev = id;
    ++length;
  }
  if (prev != lru_tail_) check_failed(concat("LRU tail is ", lru_tail_, " but the forward walk ends at ", prev));
  if (length != lru_size_) check_failed(concat("LRU list has ", length, " blocks, counter says ", lru_size_));

  // Partition and counters.
  int referenced = 0;
  int hashed = 0;
  for (int id = 0; id < num_blocks_; ++id) {
    if (refcount_[id] < 0) check_failed(concat("block ", id, " has negative refcount ", refcount_[id]));
    if (refcount_[id] > 0) {
      ++referenced;
      if (on_free[id] || on_lru[id]) {
        check_failed(concat("block ", id, " has refcount ", refcount_[id], " but is on the ",
                            on_free[id] ? "free" : "LRU", " list"));
      }
    } else if (!on_free[id] && !on_lru[id]) {
      check_failed(concat("block ", id, " has refcount 0 but is on neither the free list nor the LRU list"));
    }
    if (!hashed_[id]) continue;
    ++hashed;
    const auto it = prefix_map_.find(key_[id]);
    if (it == prefix_map_.end() || it->second != id) {
      check_failed(concat("hashed block ", id, " is not in the prefix map under its key"));
    }
    if (tokens_[id].size() != static_cast<size_t>(page_size_)) {
      check_failed(concat("hashed block ", id, " stores ", tokens_[id].size(), " tokens, not page_size=", page_size_));
    }
    const int parent = parent_[id];
    if (parent != kNone && (parent < 0 || parent >= num_blocks_ || parent == id)) {
      check_failed(concat("hashed block ", id, " has invalid parent ", parent));
    }
  }
  if (referenced != num_referenced_) {
    check_failed(concat(referenced, " blocks are referenced, counter says ", num_referenced_));
  }
  if (hashed != num_hashed_) check_failed(concat(hashed, " blocks are hashed, counter says ", num_hashed_));
  if (static_cast<int>(free_list_.size()) + lru_size_ + referenced != num_blocks_) {
    check_failed(concat("free (", free_list_.size(), ") + cached-unused (", lru_size_, ") + referenced (",
                        referenced, ") != num_blocks (", num_blocks_, ")"));
  }

  // Prefix map: every entry points at a hashed block whose stored key is that entry's key.
  if (static_cast<int>(prefix_map_.size()) != num_hashed_) {
    check_failed(concat("prefix map has ", prefix_map_.size(), " entries for ", num_hashed_, " hashed blocks"));
  }
  for (const auto& [key, id] : prefix_map_) {
    if (id < 0 || id >= num_blocks_) check_failed(concat("prefix map points at out-of-range id ", id));
    if (!hashed_[id]) check_failed(concat("prefix map points at unhashed block ", id));
    if (key_[id] != key) check_failed(concat("prefix map entry for block ", id, " has a key the block does not store"));
  }
}

void BlockAllocator::check_holders(const std::unordered_map<int, int>& holders) const {
  for (const auto& [id, count] : holders) {
    if (id < 0 || id >= num_blocks_) {
      throw std::runtime_error(concat("check_holders: block id ", id, " is out of range [0, ", num_blocks_, ")"));
    }
  }
  for (int id = 0; id < num_blocks_; ++id) {
    const auto it = holders.find(id);
    const int expected = it == holders.end() ? 0 : it->second;
    if (refcount_[id] != expected) {
      throw std::runtime_error(concat("check_holders: block ", id, " has refcount ", refcount_[id], " but ",
                                      expected, " holder(s) are known (leaked or double-counted reference)"));
    }
  }
}

std::vector<int> BlockAllocator::least_recently_used(int n) const {
  if (n < 0) throw std::invalid_argument(concat("least_recently_used: n must be >= 0, got ", n));
  std::vector<int> ids;
  ids.reserve(static_cast<size_t>(std::min(n, lru_size_)));
  for (int id = lru_head_; id != kNone && static_cast<int>(ids.size()) < n; id = lru_next_[id]) ids.push_back(id);
  return ids;
}

std::tuple<std::vector<int>, std::vector<int>, std::vector<int>> BlockAllocator::blocks_in_state() const {
  std::vector<int> free_ids(free_list_.begin(), free_list_.end());
  std::sort(free_ids.begin(), free_ids.end());
  std::vector<int> cached_unused;
  cached_unused.reserve(static_cast<size_t>(lru_size_));
  for (int id = lru_head_; id != kNone; id = lru_next_[id]) cached_unused.push_back(id);
  std::vector<int> referenced;
  referenced.reserve(static_cast<size_t>(num_referenced_));
  for (int id = 0; id < num_blocks_; ++id) {
    if (refcount_[id] > 0) referenced.push_back(id);
  }
  return {std::move(free_ids), std::move(cached_unused), std::move(referenced)};
}

void BlockAllocator::corrupt_for_testing(Corruption kind, int block_id) {
  require_valid_id(block_id, "corrupt_for_testing");
  switch (kind) {
    case Corruption::kRefcountPlusOne: ++refcount_[block_id]; break;
    case Corruption::kRefcountMinusOne: --refcount_[block_id]; break;
    case Corruption::kDuplicateInFreeList: free_list_.push_back(block_id); break;
    case Corruption::kBreakLruBackLink:
      lru_prev_[block_id] = lru_prev_[block_id] == kNone ? block_id : kNone;
      break;
    case Corruption::kDropMapEntry: prefix_map_.erase(key_[block_id]); break;
    case Corruption::kWrongStoredKey: key_[block_id] ^= 1; break;
  }
}

}  // namespace cbcore
