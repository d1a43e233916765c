// The facts of a communicator's latest collectives, kept so that a step, once found, is observed
// from the calls the detector already saw repeat rather than from the next ones: the warmup
// counts steps the program has already run (nccl-tests changes its size every few dozen calls,
// and a period-1 step takes 9 calls to find).
//
// What a seeded observation decides is shared like the rest: which calls are seeded (those of the
// detector's run still held here, a range of collective indices) and so how many complete steps
// it holds, depend only on shapes and on kRecentCalls; the facts themselves are this rank's, as
// in any observation. The buffer identity of a seeded gather is asked at seeding time (the
// address it named then, as it is now).
#pragma once

#include <array>
#include <cstdint>

#include "rewrite/observation.h"

namespace magi::rewrite {

class RecentCalls {
 public:
  static constexpr uint32_t kRecentCalls = 1024;

  // The communicator's collective `index` (indices come in order, one per collective).
  void add(uint64_t index, const CallFacts& call) {
    calls_[index % kRecentCalls] = call;
    next_ = index + 1;
  }
  // Feeds `seen` (reset for `period`) with the held calls from collective index `origin`, whose
  // position is 0, up to `before` (excluded), in order: each position 0 begins a step.
  void seed(StepObservation& seen, uint64_t origin, uint32_t period, uint64_t before,
            ce::Backend backend) const;

 private:
  std::array<CallFacts, kRecentCalls> calls_{};
  uint64_t next_ = 0;  // one past the latest index added
};

}  // namespace magi::rewrite
