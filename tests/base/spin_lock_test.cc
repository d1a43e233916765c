#include "base/spin_lock.h"

#include <gtest/gtest.h>

#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace magi {
namespace {

// A global taken while the process exits must need no constructor or destructor to run.
static_assert(std::is_trivially_destructible_v<SpinLock>);
constinit SpinLock g_constant_lock;

TEST(SpinLock, ExcludesOtherHolders) {
  SpinLock lock;
  uint64_t counter = 0;  // plain: only the lock orders the increments
  constexpr int kThreads = 4;
  constexpr int kRounds = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kRounds; ++i) {
        std::lock_guard<SpinLock> guard(lock);
        const uint64_t seen = counter;
        cpu_relax();  // widens the window a missing exclusion would lose an increment in
        counter = seen + 1;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(counter, static_cast<uint64_t>(kThreads) * kRounds);
}

TEST(SpinLock, TryLockFailsWhileHeldAndSucceedsOnceReleased) {
  g_constant_lock.lock();
  bool taken_elsewhere = true;
  std::thread([&] { taken_elsewhere = g_constant_lock.try_lock(); }).join();
  EXPECT_FALSE(taken_elsewhere);
  g_constant_lock.unlock();
  std::thread([&] { taken_elsewhere = g_constant_lock.try_lock(); }).join();
  EXPECT_TRUE(taken_elsewhere);
  g_constant_lock.unlock();
}

}  // namespace
}  // namespace magi
