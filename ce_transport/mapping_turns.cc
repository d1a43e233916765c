#include "ce_transport/mapping_turns.h"

#include <unistd.h>

#include <chrono>
#include <thread>

#include "ce_transport/process.h"

namespace magi::ce {
namespace {

constexpr auto kRetry = std::chrono::microseconds(20);
constexpr int kRetriesBetweenLivenessChecks = 50;  // a holder's liveness, about once a ms
// A mapping takes at most a few ms: slots held this long are taken as lost (a pid reused by
// another process, or one from another pid namespace) and the mapping goes ahead without a turn.
constexpr auto kLongestWait = std::chrono::seconds(1);

}  // namespace

MappingTurns::Turn::Turn(const MappingTurns& turns) {
  if (turns.slots_ == nullptr) return;
  const auto self = static_cast<uint64_t>(getpid());
  const auto began = std::chrono::steady_clock::now();
  for (int tries = 0;; ++tries) {
    for (size_t i = 0; i < kSlots; ++i) {
      uint64_t free = 0;
      if (turns.slots_[i].compare_exchange_strong(free, self)) {
        slot_ = &turns.slots_[i];
        return;
      }
    }
    if (tries % kRetriesBetweenLivenessChecks == kRetriesBetweenLivenessChecks - 1) {
      if (std::chrono::steady_clock::now() - began > kLongestWait) return;
      for (size_t i = 0; i < kSlots; ++i) {
        uint64_t holder = turns.slots_[i].load();
        if (holder != 0 && holder != self && !process_alive(static_cast<pid_t>(holder)))
          turns.slots_[i].compare_exchange_strong(holder, 0);
      }
    }
    std::this_thread::sleep_for(kRetry);
  }
}

MappingTurns::Turn::~Turn() {
  if (slot_ != nullptr) slot_->store(0);
}

}  // namespace magi::ce
