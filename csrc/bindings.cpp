// Python bindings: the cbcore._C module.
//
// Only plain ids, token lists and flat tensors cross this boundary (see STYLE.md, "kernels
// see flat tensors only"). The allocator needs nothing from torch, so this file includes
// pybind11 alone (torch's bundled copy) and compiles quickly; the tensor ops register
// themselves from their own folders (attention/cpu_attention_bindings.cpp includes torch's
// pybind11 casters). The module is linked against libc10 / libtorch_cpu by CppExtension, so
// torch must be imported first (cbcore/__init__ does).
//
// C++ exceptions map to Python ones through pybind11's defaults:
// std::invalid_argument -> ValueError, std::runtime_error -> RuntimeError; the tensor ops
// raise c10::ValueError -> ValueError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <unordered_map>

#include "allocator/block_allocator.h"
#include "allocator/slot_allocator.h"
#include "attention/cpu_attention_bindings.h"
#include "linear/packed_linear.h"
#include "runtime/openmp_team.h"
#include "sampling/greedy.h"
#include "sampling/token_bitmask.h"
#include "state_ops/state_ops.h"
#include "swap/swap.h"

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif

namespace py = pybind11;

namespace cbcore {
namespace {

// Every key collides: lets Python tests exercise the collision path too.
uint64_t constant_hash_for_testing(uint64_t, const Token*, size_t) { return 0x5eedULL; }

Corruption parse_corruption(const std::string& kind) {
  static const std::unordered_map<std::string, Corruption> kinds = {
      {"refcount_plus_one", Corruption::kRefcountPlusOne},
      {"refcount_minus_one", Corruption::kRefcountMinusOne},
      {"duplicate_in_free_list", Corruption::kDuplicateInFreeList},
      {"break_lru_back_link", Corruption::kBreakLruBackLink},
      {"drop_map_entry", Corruption::kDropMapEntry},
      {"wrong_stored_key", Corruption::kWrongStoredKey},
  };
  const auto it = kinds.find(kind);
  if (it == kinds.end()) throw std::invalid_argument("unknown corruption kind '" + kind + "'");
  return it->second;
}

py::dict stats_dict(const BlockAllocator& a) {
  const AllocatorStats& s = a.stats();
  py::dict d;
  d["lookups"] = s.lookups;
  d["hits"] = s.hits;
  d["evictions"] = s.evictions;
  d["allocations"] = s.allocations;
  d["commits"] = s.commits;
  d["num_free"] = a.num_free();
  d["num_cached_unused"] = a.num_cached_unused();
  d["num_referenced"] = a.num_referenced();
  d["num_cached"] = a.num_cached();
  return d;
}

std::string repr(const BlockAllocator& a) {
  return "BlockAllocator(num_blocks=" + std::to_string(a.num_blocks()) +
         ", page_size=" + std::to_string(a.page_size()) + ", free=" + std::to_string(a.num_free()) +
         ", cached_unused=" + std::to_string(a.num_cached_unused()) +
         ", referenced=" + std::to_string(a.num_referenced()) + ")";
}

void bind_block_allocator(py::module_& m) {
  py::class_<BlockAllocator>(m, "BlockAllocator", R"doc(
Refcounted KV-cache block ids with a prefix cache (C++; see csrc/allocator/block_allocator.h).

Every block is exactly one of FREE (free list), CACHED_UNUSED (hashed, refcount 0, in an LRU
list of reusable blocks) or REFERENCED (refcount >= 1). A refcount equals the number of
holders (request block tables; the prefix cache holds none). A full block committed to the
prefix cache is found again by (parent block, tokens); lookups compare the stored tokens and
the parent's generation, so a hash collision or a recycled parent never yields wrong K/V.
Bad arguments raise ValueError and change nothing; running out of blocks raises RuntimeError.
)doc")
      .def(py::init<int, int>(), py::arg("num_blocks"), py::arg("page_size"),
           "Allocator over block ids [0, num_blocks), each holding page_size tokens. "
           "ValueError if either is < 1.")
      .def_static(
          "_with_constant_hash_for_testing",
          [](int num_blocks, int page_size) {
            return BlockAllocator(num_blocks, page_size, &constant_hash_for_testing);
          },
          py::arg("num_blocks"), py::arg("page_size"),
          "Test only: an allocator whose prefix keys all collide.")
      .def_property_readonly("num_blocks", &BlockAllocator::num_blocks, "Total number of blocks.")
      .def_property_readonly("page_size", &BlockAllocator::page_size, "Tokens per block.")
      .def("allocate", &BlockAllocator::allocate, py::arg("n"),
           py::doc("n fresh blocks with refcount 1: from the free list first, then by evicting "
                   "least-recently-used cached-unused blocks. RuntimeError (nothing changes) when "
                   "n > num_available."))
      .def("free", &BlockAllocator::free, py::arg("ids"),
           py::doc("Releases one reference per id (duplicates allowed). At refcount 0 a cached block "
                   "becomes the most recently used entry of the LRU list, any other block returns to "
                   "the free list. ValueError naming the id (nothing changes) on a double free or an "
                   "out-of-range id. Pass a block table reversed so its tail is evicted before its head."))
      .def("fork", &BlockAllocator::fork, py::arg("ids"),
           py::doc("Adds one reference per id, e.g. to share a parent's blocks with num_return_sequences "
                   "children. Every id must be referenced, else ValueError (nothing changes)."))
      .def("lookup", &BlockAllocator::lookup, py::arg("parent"), py::arg("tokens"),
           py::doc("The cached block holding exactly these page_size tokens after block `parent` "
                   "(-1 for the first block), with its refcount + 1; or -1. ValueError if "
                   "len(tokens) != page_size."))
      .def("match_prefix", &BlockAllocator::match_prefix, py::arg("tokens"), py::arg("max_blocks"),
           py::doc("Looks up the full page_size chunks of `tokens` from the root; returns the hit "
                   "block ids in order (each refcount + 1), stopping at the first miss or after "
                   "max_blocks blocks. A trailing partial chunk is never matched."))
      .def("peek_prefix", &BlockAllocator::peek_prefix, py::arg("tokens"), py::arg("max_blocks"),
           py::doc("The block ids match_prefix would return, changing nothing: no reference taken, no lookup "
                   "counted, the LRU order untouched (a pure query, asked every step of a waiting request)."))
      .def("take_prefix", &BlockAllocator::take_prefix, py::arg("ids"), py::arg("lookups"),
           py::doc("Takes one reference on each of `ids` (blocks peek_prefix just returned; each must still be "
                   "hashed) and counts `lookups` lookups, len(ids) of them hits. ValueError (nothing changes) for "
                   "a bad or unhashed id."))
      .def("commit", &BlockAllocator::commit, py::arg("block_id"), py::arg("parent"), py::arg("tokens"),
           py::doc("Registers the full, referenced block `block_id` in the prefix cache as the child of "
                   "`parent` (-1 or a cached block) holding `tokens`. Returns False and caches nothing "
                   "when the parent is not cached, the block already is, or an equivalent or colliding "
                   "live entry exists. ValueError if the block is not referenced or "
                   "len(tokens) != page_size."))
      .def("evict", &BlockAllocator::evict, py::arg("n"),
           py::doc("Moves up to n least-recently-used cached-unused blocks to the free list; returns "
                   "how many."))
      .def("least_recently_used", &BlockAllocator::least_recently_used, py::arg("n"),
           py::doc("The ids evict(n) would free, least recently used first, changing nothing (O(n)). "
                   "ValueError for a negative n."))
      .def("prefix_path", &BlockAllocator::prefix_path, py::arg("block_id"),
           py::doc("The tokens of every block from the root to this hashed block, root first (what the host "
                   "tier keys an evicted block by); [] when it is not hashed or a link of its chain changed "
                   "since it was committed."))
      .def("forget_prefixes", &BlockAllocator::forget_prefixes,
           py::doc("The model's weights changed: cached-unused blocks are freed and referenced hashed blocks "
                   "unhashed (their holders keep them), so no K/V computed before is shared or chained on "
                   "again. Returns the number of blocks forgotten."))
      .def("refcount", &BlockAllocator::refcount, py::arg("block_id"), py::doc("Number of holders."))
      .def("is_cached", &BlockAllocator::is_cached, py::arg("block_id"),
           py::doc("True while the block is in the prefix cache (hashed), referenced or not."))
      .def("generation", &BlockAllocator::generation, py::arg("block_id"),
           py::doc("Bumped each time the block returns to the free list (freed unhashed or evicted)."))
      .def_property_readonly("num_free", &BlockAllocator::num_free, "Blocks on the free list.")
      .def_property_readonly("num_cached_unused", &BlockAllocator::num_cached_unused,
                             "Cached blocks with refcount 0 (reusable; evicted on demand).")
      .def_property_readonly("num_referenced", &BlockAllocator::num_referenced, "Blocks with refcount >= 1.")
      .def_property_readonly("num_cached", &BlockAllocator::num_cached,
                             "Blocks in the prefix cache, referenced or not.")
      .def_property_readonly("num_available", &BlockAllocator::num_available,
                             "num_free + num_cached_unused: what allocate() can hand out.")
      .def("stats", &stats_dict,
           py::doc("Event counters (lookups, hits, evictions, allocations, commits) and the counts "
                   "num_free, num_cached_unused, num_referenced, num_cached, as a dict of ints."))
      .def("reset_stats", &BlockAllocator::reset_stats, py::doc("Zeroes the event counters (not the counts)."))
      .def("check", &BlockAllocator::check,
           py::doc("Verifies every invariant; RuntimeError describing the first violation."))
      .def("check_holders", &BlockAllocator::check_holders, py::arg("holders"),
           py::doc("RuntimeError unless every block's refcount equals holders.get(id, 0), where "
                   "`holders` maps block id -> number of holders the caller knows of."))
      .def("blocks_in_state", &BlockAllocator::blocks_in_state,
           py::doc("(free ids ascending, cached-unused ids in eviction order, referenced ids ascending)."))
      .def(
          "_corrupt_for_testing",
          [](BlockAllocator& a, const std::string& kind, int block_id) {
            a.corrupt_for_testing(parse_corruption(kind), block_id);
          },
          py::arg("kind"), py::arg("block_id"),
          py::doc("Test only: damages the bookkeeping so check() must fail. kind is one of "
                  "refcount_plus_one, refcount_minus_one, duplicate_in_free_list, "
                  "break_lru_back_link, drop_map_entry, wrong_stored_key."))
      .def("__repr__", &repr);
}

}  // namespace
void bind_slot_allocator(py::module_& m) {
  py::class_<SlotAllocator>(m, "SlotAllocator", R"doc(
Refcounted state-slot ids for layers with a per-request recurrent or convolutional state (C++; see
csrc/allocator/slot_allocator.h). A slot is FREE (refcount 0, in the free list) or HELD (refcount >= 1,
one per holder). Bad arguments raise ValueError and change nothing; running out of slots raises
RuntimeError.
)doc")
      .def(py::init<int>(), py::arg("num_slots"), "Slots [0, num_slots). ValueError if num_slots < 1.")
      .def_property_readonly("num_slots", &SlotAllocator::num_slots, "Total number of slots.")
      .def_property_readonly("num_free", &SlotAllocator::num_free, "Slots in the free list.")
      .def_property_readonly("num_held", &SlotAllocator::num_held, "Slots with at least one holder.")
      .def("refcount", &SlotAllocator::refcount, py::arg("slot"), "Holders of one slot.")
      .def("allocate", &SlotAllocator::allocate, py::arg("n"),
           "n free slots with refcount 1. RuntimeError (nothing changes) when fewer are free.")
      .def("free", &SlotAllocator::free, py::arg("slots"),
           "One reference less on each slot; a slot reaching 0 is free again. ValueError (nothing changes) for a "
           "bad id or a slot released more often than held.")
      .def("share", &SlotAllocator::share, py::arg("slots"),
           "One reference more on each held slot. ValueError (nothing changes) for a bad id or a free slot.")
      .def("check", &SlotAllocator::check, "RuntimeError naming the broken invariant, if any.")
      .def("check_holders", &SlotAllocator::check_holders, py::arg("holders"),
           "check(), and every refcount equals holders[slot] (0 for a slot not named).")
      .def("_corrupt_refcount_for_testing", &SlotAllocator::corrupt_refcount_for_testing, py::arg("slot"),
           py::arg("delta"), "Test only: change one refcount without the free list.")
      .def("__repr__", [](const SlotAllocator& a) {
        return "SlotAllocator(num_slots=" + std::to_string(a.num_slots()) + ", free=" + std::to_string(a.num_free()) +
               ")";
      });
}

}  // namespace cbcore

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cbcore's C++ extension: the KV-cache block allocator, the CPU attention kernels, the packed linears, the swap pool and the OpenMP team release.";
  cbcore::bind_block_allocator(m);
  cbcore::bind_slot_allocator(m);
  cbcore::register_cpu_attention_bindings(m);
  cbcore::register_cpu_step_attention_bindings(m);
  cbcore::register_swap_bindings(m);
  cbcore::register_packed_linear_bindings(m);
  cbcore::register_runtime_bindings(m);
  cbcore::register_greedy_bindings(m);
  cbcore::register_token_bitmask_bindings(m);
  cbcore::register_state_ops_bindings(m);
}
