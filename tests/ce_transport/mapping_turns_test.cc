// The ranks on one GPU take turns at mapping (ce_transport/mapping_turns.h): at most kSlots map at
// once, everyone gets a turn, a slot held by a process that is gone is taken back, and no wait
// lasts for ever.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "ce_transport/mapping_turns.h"

namespace magi::ce {
namespace {

TEST(MappingTurns, AtMostTwoMapAtOnceAndEveryMapperGetsEachOfItsTurns) {
  std::atomic<uint64_t> slots[MappingTurns::kSlots] = {};
  const MappingTurns turns(slots);
  std::atomic<int> inside{0}, most{0}, done{0};
  std::vector<std::thread> mappers;
  for (int t = 0; t < 6; ++t)
    mappers.emplace_back([&] {
      for (int i = 0; i < 30; ++i) {
        const MappingTurns::Turn turn(turns);
        const int now = ++inside;
        for (int m = most.load(); now > m && !most.compare_exchange_weak(m, now);) {}
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        --inside;
        ++done;
      }
    });
  for (std::thread& m : mappers) m.join();
  EXPECT_LE(most.load(), 2);
  EXPECT_EQ(done.load(), 180);
  for (const auto& slot : slots) EXPECT_EQ(slot.load(), 0u) << "a turn was not given back";
}

TEST(MappingTurns, ASlotHeldByAProcessThatIsGoneIsTakenBackAndALiveOnesIsNot) {
  const pid_t gone = fork();
  ASSERT_GE(gone, 0);
  if (gone == 0) _exit(0);
  ASSERT_EQ(waitpid(gone, nullptr, 0), gone);
  const auto live = static_cast<uint64_t>(getppid());
  std::atomic<uint64_t> slots[MappingTurns::kSlots] = {};
  slots[0] = live;
  slots[1] = static_cast<uint64_t>(gone);
  const MappingTurns turns(slots);
  {
    const MappingTurns::Turn turn(turns);
    EXPECT_EQ(slots[0].load(), live);
    EXPECT_EQ(slots[1].load(), static_cast<uint64_t>(getpid()));
  }
  EXPECT_EQ(slots[0].load(), live);
  EXPECT_EQ(slots[1].load(), 0u);
}

// Slots that stay held (a pid reused by a live process, say) never stop a set-up: after a
// second the mapping goes ahead without a turn, and the slots are left as they were.
TEST(MappingTurns, SlotsHeldForLongerThanAnyMappingTakesDoNotStopTheMapper) {
  const auto live = static_cast<uint64_t>(getppid());
  std::atomic<uint64_t> slots[MappingTurns::kSlots] = {};
  for (auto& slot : slots) slot = live;
  const MappingTurns turns(slots);
  const auto began = std::chrono::steady_clock::now();
  { const MappingTurns::Turn turn(turns); }
  const auto waited = std::chrono::steady_clock::now() - began;
  EXPECT_GE(waited, std::chrono::seconds(1));
  EXPECT_LT(waited, std::chrono::seconds(30));
  for (const auto& slot : slots) EXPECT_EQ(slot.load(), live);
}

}  // namespace
}  // namespace magi::ce
