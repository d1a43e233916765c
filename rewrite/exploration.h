// When a communicator explores, what it remembers, and when it stops: the exploration policy.
//
// Exploring is everything the library does to find out whether a gather should leave NCCL and
// that the program would not do without it: agreement rounds (one small all-gather each, read a
// fixed number of calls later), calls timed both ways in a cost trial, and the host waits a
// round may cause. It must pay for itself. The rules, each a function of what every rank read
// alike (so every rank explores at the same calls, and a round only ever meets a round):
//
//  - Never where it cannot win. A communicator of one rank (NCCL's all-gather there is one local
//    copy, which a copy-engine read cannot beat) takes no part unless MAGI_CE_FORCE=1, and ranks
//    found on different hosts or without peer access stop for good: none of these facts ever
//    changes for a communicator.
//  - When rounds come (counted in anchors passed: agreement.h says why only there). The first
//    propose once MAGI_WARMUP_STEPS complete steps were seen, at the call that completes them; a
//    propose, publish or confirm is read a quarter step later, a cost round a step later. After
//    a round that moved all it could, or that NCCL won by measurement: MAGI_REAGREE_STEPS steps
//    later. After one short of what it could move: 1, 2, 4 … steps later, doubling from the
//    first, up to MAGI_REAGREE_STEPS. Counted from the step after the last round's issue, so a
//    round read sooner brings no round sooner. Default mode keys a gather on what matters to it
//    (position, count, type, call site, group; not its buffers), so what is not stable by the first
//    propose rarely settles later; static weights also wait for stable buffers, so there the first
//    kStaticEagerSteps steps retry every step (allocators warm up, first-step buffers differ).
//  - What is remembered. Per step (by its shape digest, so a phase that comes back finds it): the
//    back-off reached and a plan NCCL won by measurement (proposed again, that plan moves
//    nothing). Per communicator: which bucket sizes each route won (size verdicts). The copy
//    engine pays a fixed cost per gather and wins by bandwidth, so as sizes grow the winner
//    changes once, from NCCL to the copy engine: a bucket at least as large as one the copy
//    engine won moves without being timed, one no larger than one NCCL won stays without being
//    tried; between, or where the measurements do not fit that picture, the cost trial decides.
//    The verdicts come from cost rounds, which every rank reads alike, about sizes (shapes).
//  - What it cost, said at the communicator's end: rounds, the host time spent waiting for them,
//    calls timed, and calls that ran the slower way.
// Pure: no NCCL, no transport, no clock of its own; CommAgreement feeds it what happened.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "base/agreement_records.h"
#include "base/base.h"

namespace magi::rewrite {

using trace::Reason;
using trace::RoundKind;

class ExplorationPolicy {
 public:
  explicit ExplorationPolicy(const Options& options) : options_(options) {}
  explicit ExplorationPolicy(Options&&) = delete;  // it keeps a reference: no temporary

  // Why a communicator of `nranks` ranks never explores, by facts every rank shares (the same
  // answer on every rank, so no hello is owed either); Reason::None if it may.
  static Reason never_explores(const Options& options, int nranks);

  // ---- when rounds come ----
  // The step `digest` was found or changed at the call at `position`. The anchor (the same on
  // every rank: positions are shapes) is where the first propose can come soonest: that very
  // call if the warmup is complete there (`complete_steps` seeded from the calls already seen),
  // else
  // position 0, where each complete step is counted, so the propose comes at the call that
  // completes the warmup rather than most of a step later. A step seen before keeps the back-off
  // it had reached.
  void restart(uint64_t digest, uint32_t position, uint64_t complete_steps);
  uint32_t anchor() const { return anchor_; }
  // The call at the anchor: one more step.
  void pass_anchor() { ++steps_; }
  uint64_t steps() const { return steps_; }
  bool propose_due(uint64_t complete_steps) const;
  // Calls from a round's issue to its read, equal on every rank (a round is read at the call
  // `distance` collectives after the one it was issued at). A propose, publish or confirm: a
  // quarter step (at least one call), so that the three fit in the step where the warmup
  // completes, each with a quarter of the step's calls to run behind; the host waits there only
  // for a round every rank issued. A cost round, and every round of a step whose in-step commit
  // failed: a step, at the next anchor.
  uint64_t read_distance(RoundKind kind, uint32_t period) const;
  // Every rank read a publish or confirm that failed (one issued inside a group holding
  // Send/Recv is one): until the step changes, rounds are read at the anchor, where the anchor
  // moves on from such a group.
  void read_at_anchor() { in_step_ = false; }
  // The anchor count the next round's wait starts from: the step after the last round was
  // issued, as when each round was read a step later, so a round read sooner brings the next one
  // no sooner and a step holds no more rounds than that schedule gave it.
  uint64_t waits_from() const { return std::max(steps_, last_issued_ + 1); }
  // A round moved all it could, or NCCL won by measurement.
  void reagree_later();
  // A round moved less than it could (a candidate not yet stable on some rank, groups not
  // settled, a rank that could not serve).
  void retry_soon();
  // Every rank read that the anchor sat inside a group it could not leave: all move it one
  // position on and propose again a step later, until a position where a round can launch.
  void move_anchor(uint32_t period);
  // Every rank read a fact that never changes for this communicator and rules out a win (ranks
  // on different hosts, no peer access): no round from here on.
  void stop(Reason why);
  bool stopped() const { return stopped_ != Reason::None; }
  Reason stopped_by() const { return stopped_; }
  // The first steps of a static-weights step retry at every step.
  static constexpr uint64_t kStaticEagerSteps = 32;

  // Rounds issued so far; numbers the next one.
  uint32_t next_round() { return ++rounds_; }
  uint32_t rounds() const { return rounds_; }

  // ---- what is remembered ----
  // NCCL won every bucket of the plan `hash` of the current step when timed: proposed again, it
  // moves nothing.
  void nccl_won_plan(uint64_t hash);
  bool nccl_won(uint64_t hash) const { return hash != 0 && hash == current().nccl_faster_hash; }

  enum class SizeVerdict : uint8_t { Unknown, Moves, Stays };
  // A cost round's verdict for a bucket of `bytes` (measured on every rank only).
  void learn_size(uint64_t bytes, bool copy_engine_won);
  SizeVerdict size_verdict(uint64_t bytes) const;

  // ---- what it cost ----
  // One round's all-gather issued (hello, propose, publish, confirm or cost).
  void count_round_issued() {
    ++cost_.rounds_issued;
    last_issued_ = steps_;
  }
  void count_round_wait(uint64_t ns) { cost_.wait_ns += ns; }
  void count_timed_calls(uint64_t calls) { cost_.timed_calls += calls; }
  void count_slower_calls(uint64_t calls) { cost_.slower_calls += calls; }
  // "R rounds (W us waiting on them), T calls timed, S of them the slower way": R counts the
  // rounds' all-gathers (a propose, publish and confirm are three).
  std::string cost_summary() const;
  uint64_t rounds_issued() const { return cost_.rounds_issued; }
  uint64_t round_wait_ns() const { return cost_.wait_ns; }
  uint64_t timed_calls() const { return cost_.timed_calls; }
  uint64_t slower_calls() const { return cost_.slower_calls; }

 private:
  struct StepMemory {
    uint64_t digest = 0;
    uint64_t backoff = 1;  // steps to the next retry_soon() propose
    uint64_t nccl_faster_hash = 0;
  };
  // Steps remembered (a program alternates between a few phases; the oldest is forgotten).
  static constexpr size_t kStepsRemembered = 64;
  // Complete steps the first propose waits for.
  uint64_t warmup_needed() const;
  StepMemory& current() { return memory_[current_]; }
  const StepMemory& current() const { return memory_[current_]; }

  const Options& options_;
  uint64_t steps_ = 0;         // anchors passed since the step was found
  uint32_t anchor_ = 0;        // step position where rounds are issued and read
  uint64_t next_propose_ = 0;  // value of steps_ at which to propose
  uint64_t last_issued_ = 0;   // value of steps_ when the last round was issued
  bool in_step_ = true;        // rounds read a quarter step on (read_distance)
  uint32_t rounds_ = 0;
  Reason stopped_ = Reason::None;
  std::vector<StepMemory> memory_{StepMemory{}};
  size_t current_ = 0;
  size_t oldest_ = 0;  // the next entry to reuse once memory_ is full
  // Sizes (bucket bytes) each route won, sorted.
  std::vector<uint64_t> copy_engine_won_, nccl_won_;
  struct Cost {
    uint64_t rounds_issued = 0, wait_ns = 0, timed_calls = 0, slower_calls = 0;
  } cost_;
};

}  // namespace magi::rewrite
