// Unit tests of SlotAllocator (csrc/allocator/slot_allocator.h): allocation order, refcounts, the all-or-nothing
// contract of bad calls, and check() catching damaged bookkeeping.
#include <gtest/gtest.h>

#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "allocator/slot_allocator.h"

using cbcore::SlotAllocator;

TEST(SlotAllocator, RejectsEmptyPool) { EXPECT_THROW(SlotAllocator(0), std::invalid_argument); }

TEST(SlotAllocator, HandsOutLowIdsFirstAndReusesTheLastFreed) {
  SlotAllocator a(4);
  EXPECT_EQ(a.allocate(2), (std::vector<int>{0, 1}));
  a.free({0});
  EXPECT_EQ(a.allocate(1), (std::vector<int>{0}));
  EXPECT_EQ(a.num_free(), 2);
  EXPECT_EQ(a.num_held(), 2);
  a.check();
}

TEST(SlotAllocator, RunningOutChangesNothing) {
  SlotAllocator a(2);
  a.allocate(1);
  EXPECT_THROW(a.allocate(2), std::runtime_error);
  EXPECT_EQ(a.num_free(), 1);
  EXPECT_THROW(a.allocate(-1), std::invalid_argument);
  a.check();
}

TEST(SlotAllocator, SharedSlotIsFreeOnlyAfterEveryHolder) {
  SlotAllocator a(2);
  const int slot = a.allocate(1)[0];
  a.share({slot});
  EXPECT_EQ(a.refcount(slot), 2);
  a.free({slot});
  EXPECT_EQ(a.num_free(), 1);
  a.free({slot});
  EXPECT_EQ(a.num_free(), 2);
  a.check();
}

TEST(SlotAllocator, BadFreeOrShareChangesNothing) {
  SlotAllocator a(3);
  const std::vector<int> held = a.allocate(2);
  EXPECT_THROW(a.free({held[0], held[0]}), std::invalid_argument);  // released twice, held once
  EXPECT_THROW(a.free({held[0], 7}), std::invalid_argument);
  EXPECT_THROW(a.share({2}), std::invalid_argument);  // free
  EXPECT_THROW(a.refcount(-1), std::invalid_argument);
  EXPECT_EQ(a.refcount(held[0]), 1);
  EXPECT_EQ(a.num_free(), 1);
  a.check_holders({{held[0], 1}, {held[1], 1}});
}

TEST(SlotAllocator, CheckHoldersFindsALeakAndAMiscount) {
  SlotAllocator a(3);
  const std::vector<int> held = a.allocate(2);
  EXPECT_THROW(a.check_holders({{held[0], 1}}), std::runtime_error);                  // held[1]: nobody holds it
  EXPECT_THROW(a.check_holders({{held[0], 2}, {held[1], 1}}), std::runtime_error);    // miscounted
  EXPECT_THROW(a.check_holders({{held[0], 1}, {held[1], 1}, {2, 1}}), std::runtime_error);  // a free slot named
}

TEST(SlotAllocator, CheckFindsDamagedRefcounts) {
  SlotAllocator a(3);
  const int slot = a.allocate(1)[0];
  a.corrupt_refcount_for_testing(slot, -1);  // refcount 0 but not in the free list
  EXPECT_THROW(a.check(), std::runtime_error);
  a.corrupt_refcount_for_testing(slot, -1);  // negative
  EXPECT_THROW(a.check(), std::runtime_error);
  SlotAllocator b(2);
  b.corrupt_refcount_for_testing(0, 1);  // referenced while in the free list
  EXPECT_THROW(b.check(), std::runtime_error);
}
