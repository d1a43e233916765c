#include "base/free_later.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace magi {
namespace {

TEST(FreeLater, FreesOnlyTheReadyItemsInOrderAndKeepsTheRestInOrder) {
  FreeLater<int> later;
  for (int i = 1; i <= 6; ++i) later.add(i);
  std::vector<int> freed;
  const size_t n =
      later.free_ready([](int& i) { return i % 2 == 0; }, [&](int i) { freed.push_back(i); });
  EXPECT_EQ(n, 3u);
  EXPECT_EQ(freed, (std::vector<int>{2, 4, 6}));
  EXPECT_EQ(later.size(), 3u);
  EXPECT_EQ(later.take_all(), (std::vector<int>{1, 3, 5}));
  EXPECT_TRUE(later.empty());
}

TEST(FreeLater, NothingReadyFreesNothing) {
  FreeLater<int> later;
  later.add(7);
  EXPECT_EQ(later.free_ready([](int&) { return false; }, [](int) { FAIL(); }), 0u);
  EXPECT_EQ(later.size(), 1u);
}

// An owned item goes when `free` returns, before the next item is looked at: a freed round's
// buffers are gone before anything after them runs.
TEST(FreeLater, AnOwnedItemIsDestroyedAsItIsFreed) {
  FreeLater<std::shared_ptr<int>> later;
  auto first = std::make_shared<int>(1);
  std::weak_ptr<int> watch_first = first;
  later.add(std::move(first));
  later.add(std::make_shared<int>(2));
  bool first_gone_when_second_asked = false;
  later.free_ready(
      [&](std::shared_ptr<int>& p) {
        if (*p == 2) first_gone_when_second_asked = watch_first.expired();
        return *p == 1;
      },
      [](std::shared_ptr<int>) {});
  EXPECT_TRUE(first_gone_when_second_asked);
  ASSERT_EQ(later.size(), 1u);
  EXPECT_EQ(*later.take_all().front(), 2);
}

}  // namespace
}  // namespace magi
