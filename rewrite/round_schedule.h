// When a communicator's agreement rounds happen, counted in anchors passed (rewrite/agreement.h
// says why only there), and what a read propose round decides.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/base.h"
#include "rewrite/contribution.h"

namespace magi::rewrite {

class RoundSchedule {
 public:
  explicit RoundSchedule(const Options& options) : options_(options) {}

  // The step was found or changed: the anchor goes back to position 0, and the first propose
  // comes once MAGI_WARMUP_STEPS complete steps were seen.
  void restart();
  uint32_t anchor() const { return anchor_; }
  // The call at the anchor: one more step.
  void pass_anchor() { ++steps_; }
  uint64_t steps() const { return steps_; }
  bool propose_due(uint64_t complete_steps) const;
  // A propose was read, or a commit ended: the next propose comes MAGI_REAGREE_STEPS steps
  // later, or never with 0.
  void reagree_later();
  // Every rank read that the anchor sat inside a group: all move it one position on and propose
  // again a step later, until a position outside the program's groups is found.
  void move_anchor(uint32_t period);

  // Rounds issued so far; numbers the next one.
  uint32_t next_round() { return ++rounds_; }
  uint32_t rounds() const { return rounds_; }

 private:
  const Options& options_;
  uint64_t steps_ = 0;         // anchors passed since the step was found
  uint32_t anchor_ = 0;        // step position where rounds are issued and read
  uint64_t next_propose_ = 0;  // value of steps_ at which to propose
  uint32_t rounds_ = 0;
};

// A read propose round: decide() from every rank's bytes, except that a plan already timed with
// NCCL winning every bucket (`nccl_faster_hash`) moves nothing.
Decision read_propose(std::span<const uint8_t> all, int nranks, int my_rank,
                      uint64_t nccl_faster_hash);
// A propose this rank issued inside an open group: void, without reading it.
Decision void_propose(const std::vector<GatherEntry>& entries);

}  // namespace magi::rewrite
