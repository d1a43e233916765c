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

  // The step was found or changed at the call at `position`: that position becomes the anchor
  // (the same on every rank: positions are shapes), and the first propose comes at the first
  // anchor once MAGI_WARMUP_STEPS complete steps were seen — at once when the observation,
  // seeded with the step's calls before it was found, already holds them.
  void restart(uint32_t position);
  uint32_t anchor() const { return anchor_; }
  // The call at the anchor: one more step.
  void pass_anchor() { ++steps_; }
  uint64_t steps() const { return steps_; }
  bool propose_due(uint64_t complete_steps) const;
  // A round moved all it could, or NCCL won by measurement: the next propose comes
  // MAGI_REAGREE_STEPS steps later, or never with 0.
  void reagree_later();
  // A round moved less than it could (a candidate not yet stable on some rank, groups not yet
  // settled, a rank that could not serve): the next propose comes a step after the read while
  // the step is young (kEagerSteps: a program's first steps often differ a little, and settle),
  // then 1, 2, 4 … steps after, up to MAGI_REAGREE_STEPS (without bound with 0: a logarithmic
  // number of rounds). Every rank reads the same round, so every rank backs off alike.
  void retry_soon();
  static constexpr uint64_t kEagerSteps = 32;
  // Every rank read that the anchor sat inside a group it could not leave: all move it one
  // position on and propose again a step later, until a position where a round can launch.
  void move_anchor(uint32_t period);

  // Rounds issued so far; numbers the next one.
  uint32_t next_round() { return ++rounds_; }
  uint32_t rounds() const { return rounds_; }

 private:
  const Options& options_;
  uint64_t steps_ = 0;         // anchors passed since the step was found
  uint32_t anchor_ = 0;        // step position where rounds are issued and read
  uint64_t next_propose_ = 0;  // value of steps_ at which to propose
  uint64_t backoff_ = 1;       // steps to the next retry_soon() propose
  uint32_t rounds_ = 0;
};

// A read propose round: decide() from every rank's bytes, except that a plan already timed with
// NCCL winning every bucket (`nccl_faster_hash`) moves nothing.
Decision read_propose(std::span<const uint8_t> all, int nranks, int my_rank,
                      uint64_t nccl_faster_hash);
// A propose this rank issued inside an open group: void, without reading it.
Decision void_propose(const std::vector<GatherEntry>& entries);

}  // namespace magi::rewrite
