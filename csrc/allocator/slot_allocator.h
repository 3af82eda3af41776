// State slots for layers that keep a per-request recurrent or convolutional state (Mamba, gated delta rule, short
// convolutions, linear attention): one slot per live request, indexing the worker's state tensors (cbcore/
// state_layers.py), which hold that request's state for every stateful layer at once.
//
// Like BlockAllocator it hands out ids only and knows nothing about tensors, so it builds standalone for the C++
// unit tests.
//
// ---------------------------------------------------------------------------------------
// Invariants (checked by check())
// ---------------------------------------------------------------------------------------
// Every slot id in [0, num_slots) is in exactly one state:
//
//   state   refcount  lives in
//   ------  --------  ----------------------------------------------------------------
//   FREE    0         the free list (a stack: the slot freed last is handed out first)
//   HELD    >= 1      its holders: a request (running, or swapped out to the host with its
//                     K/V: its state stays in its slot), or a parent's reservation for a
//                     child it will fork
//
// * refcount == number of holders; it never goes negative; free() of a FREE slot raises.
// * the free list holds each FREE slot exactly once, and num_free() is its length.
// * check_holders(): the refcounts equal exactly what the engine's requests say they hold.
//
// A slot's contents are never read before its holder writes them: a request's first chunk starts from no state
// (transformers' layers treat a missing state as zeros), so a slot handed out again needs no clearing.
#pragma once

#include <cstddef>
#include <unordered_map>
#include <vector>

namespace cbcore {

class SlotAllocator {
 public:
  // Slots [0, num_slots). std::invalid_argument if num_slots < 1.
  explicit SlotAllocator(int num_slots);

  int num_slots() const { return static_cast<int>(refcounts_.size()); }
  int num_free() const { return static_cast<int>(free_.size()); }
  int num_held() const { return num_slots() - num_free(); }
  // Refcount of one slot; std::invalid_argument outside [0, num_slots).
  int refcount(int slot) const;

  // n free slots with refcount 1. std::runtime_error (nothing changes) when fewer than n are free;
  // std::invalid_argument when n < 0.
  std::vector<int> allocate(int n);
  // One reference less on each slot (a slot listed twice loses two); a slot reaching 0 goes back to the free list.
  // std::invalid_argument (nothing changes) for an id outside the range or a slot with too few references.
  void free(const std::vector<int>& slots);
  // One reference more on each held slot (a second holder, such as a snapshot kept for a shared prefix).
  // std::invalid_argument (nothing changes) for an id outside the range or a FREE slot.
  void share(const std::vector<int>& slots);

  // std::runtime_error naming the broken invariant.
  void check() const;
  // check(), and the refcounts equal `holders` (slot -> number of holders) exactly.
  void check_holders(const std::unordered_map<int, int>& holders) const;

  // Test only: damage the bookkeeping so that check() must notice.
  void corrupt_refcount_for_testing(int slot, int delta);

 private:
  void check_id(int slot, const char* what) const;

  std::vector<int> refcounts_;
  std::vector<int> free_;
};

}  // namespace cbcore
