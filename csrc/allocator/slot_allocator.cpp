#include "allocator/slot_allocator.h"

#include <stdexcept>
#include <string>

namespace cbcore {

SlotAllocator::SlotAllocator(int num_slots) {
  if (num_slots < 1) throw std::invalid_argument("num_slots must be >= 1, got " + std::to_string(num_slots));
  refcounts_.assign(static_cast<size_t>(num_slots), 0);
  free_.reserve(static_cast<size_t>(num_slots));
  // Highest id at the bottom of the stack: slots are handed out 0, 1, 2, ... on a fresh allocator.
  for (int slot = num_slots - 1; slot >= 0; --slot) free_.push_back(slot);
}

void SlotAllocator::check_id(int slot, const char* what) const {
  if (slot < 0 || slot >= num_slots()) {
    throw std::invalid_argument(std::string(what) + ": slot " + std::to_string(slot) + " is outside [0, " +
                                std::to_string(num_slots()) + ")");
  }
}

int SlotAllocator::refcount(int slot) const {
  check_id(slot, "refcount");
  return refcounts_[static_cast<size_t>(slot)];
}

std::vector<int> SlotAllocator::allocate(int n) {
  if (n < 0) throw std::invalid_argument("allocate: n must be >= 0, got " + std::to_string(n));
  if (n > num_free()) {
    throw std::runtime_error("allocate(" + std::to_string(n) + "): only " + std::to_string(num_free()) + " of " +
                             std::to_string(num_slots()) + " state slots are free");
  }
  std::vector<int> slots;
  slots.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const int slot = free_.back();
    free_.pop_back();
    refcounts_[static_cast<size_t>(slot)] = 1;
    slots.push_back(slot);
  }
  return slots;
}

void SlotAllocator::free(const std::vector<int>& slots) {
  // Validate everything first: a bad call changes nothing.
  std::unordered_map<int, int> releases;
  for (int slot : slots) {
    check_id(slot, "free");
    const int count = ++releases[slot];
    if (count > refcounts_[static_cast<size_t>(slot)]) {
      throw std::invalid_argument("free: slot " + std::to_string(slot) + " has " +
                                  std::to_string(refcounts_[static_cast<size_t>(slot)]) +
                                  " reference(s), fewer than the " + std::to_string(count) + " released");
    }
  }
  for (int slot : slots) {
    int& refcount = refcounts_[static_cast<size_t>(slot)];
    if (--refcount == 0) free_.push_back(slot);
  }
}

void SlotAllocator::share(const std::vector<int>& slots) {
  for (int slot : slots) {
    check_id(slot, "share");
    if (refcounts_[static_cast<size_t>(slot)] == 0) {
      throw std::invalid_argument("share: slot " + std::to_string(slot) + " is free");
    }
  }
  for (int slot : slots) ++refcounts_[static_cast<size_t>(slot)];
}

void SlotAllocator::check() const {
  std::vector<char> in_free(refcounts_.size(), 0);
  for (int slot : free_) {
    if (slot < 0 || slot >= num_slots()) {
      throw std::runtime_error("SlotAllocator.check: free list holds slot " + std::to_string(slot) + ", outside the range");
    }
    if (in_free[static_cast<size_t>(slot)]) {
      throw std::runtime_error("SlotAllocator.check: slot " + std::to_string(slot) + " is in the free list twice");
    }
    in_free[static_cast<size_t>(slot)] = 1;
  }
  for (int slot = 0; slot < num_slots(); ++slot) {
    const int refcount = refcounts_[static_cast<size_t>(slot)];
    if (refcount < 0) throw std::runtime_error("SlotAllocator.check: slot " + std::to_string(slot) + " has a negative refcount");
    if ((refcount == 0) != static_cast<bool>(in_free[static_cast<size_t>(slot)])) {
      throw std::runtime_error("SlotAllocator.check: slot " + std::to_string(slot) + " has refcount " + std::to_string(refcount) +
                             (refcount == 0 ? " but is not in the free list" : " but is in the free list"));
    }
  }
}

void SlotAllocator::check_holders(const std::unordered_map<int, int>& holders) const {
  check();
  for (const auto& [slot, count] : holders) {
    if (slot < 0 || slot >= num_slots()) {
      throw std::runtime_error("SlotAllocator.check: a holder names slot " + std::to_string(slot) + ", outside the range");
    }
    if (refcounts_[static_cast<size_t>(slot)] != count) {
      throw std::runtime_error("SlotAllocator.check: slot " + std::to_string(slot) + " has refcount " +
                             std::to_string(refcounts_[static_cast<size_t>(slot)]) + " but " +
                             std::to_string(count) + " holder(s)");
    }
  }
  for (int slot = 0; slot < num_slots(); ++slot) {
    if (refcounts_[static_cast<size_t>(slot)] > 0 && holders.find(slot) == holders.end()) {
      throw std::runtime_error("SlotAllocator.check: slot " + std::to_string(slot) + " is held (refcount " +
                             std::to_string(refcounts_[static_cast<size_t>(slot)]) + ") but no holder names it: a leak");
    }
  }
}

void SlotAllocator::corrupt_refcount_for_testing(int slot, int delta) {
  check_id(slot, "corrupt_refcount_for_testing");
  refcounts_[static_cast<size_t>(slot)] += delta;
}

}  // namespace cbcore
