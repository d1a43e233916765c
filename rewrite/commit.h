// Committing a plan every rank read: this rank's side of its publish (the window, its exports) and
// of its confirm (the peers' windows opened), each set up at the call where that is quick and off
// the program's calls where it would take long (rewrite/set_up.h); and the wait for a rank still
// setting up. Every rank reads "still setting up" (kSettingUp) alike from a publish or confirm,
// so every rank issues that round again at the same later step: 1 step later, then 2, 4, ... 64,
// so that a set-up of seconds costs a few rounds, not one per step. The gathers stay on NCCL
// meanwhile (the trial's NCCL side still timed). The rounds themselves are the coordinator's.
#pragma once

#include <cstdint>
#include <string>

#include "capture/capture.h"
#include "rewrite/active_plan.h"
#include "rewrite/agreement_log.h"
#include "rewrite/contribution.h"
#include "rewrite/observation.h"
#include "rewrite/round_log.h"
#include "rewrite/serving.h"
#include "rewrite/world.h"

namespace magi::rewrite {

class Commit {
 public:
  Commit(const AgreementWorld& world, const capture::CommInfo& info, Serving& serving,
         AgreementLog& log)
      : world_(world), info_(info), serving_(serving), log_(log) {}

  // The publish of `plan` (its decision, layout; `seen`: the step it was read on): prepares
  // this rank's window at the call, or starts preparing it off the calls (the publish then says
  // "still setting up"); binds `plan.sources`. A failure is said and refuses the plan.
  void prepare(Contribution& publish, ActivePlan& plan, const StepObservation& seen);
  // The publish issued again after a pending read: the window's handle if it is ready now.
  void prepare_again(Contribution& publish, const ActivePlan& plan);
  // The publish read, every rank able to serve: opening the peers' windows begins.
  void attach(const CommitOutcome& publish);
  // The confirm: whether this rank's set-up is done, running or failed, or its static sources
  // changed since the publish. Done is said once, with the trace's Window record (at `seq`).
  void confirm(Contribution& confirm, const ActivePlan& plan, uint64_t seq);

  // A publish or confirm read pending (some rank still setting up), read at anchor count
  // `steps`: true when the round is to be issued again at once, else it is due() later.
  bool wait(RoundKind kind, uint64_t decision_hash, uint64_t steps);
  bool due(uint64_t steps) const { return steps >= wait_.due_step; }
  RoundKind waiting_for() const { return wait_.kind; }
  uint64_t waiting_hash() const { return wait_.decision_hash; }
  // A read that was not pending: the next wait backs off from one step again.
  void stop_waiting() { wait_ = SetUpWait{}; }

  static constexpr int kSlowSetUpMs = 100;  // MAGI_INJECT_FAULT=slow-attach, slow-prepare

 private:
  // The prepared window's handle and table into the publish, and its lines (once).
  void fill_publish(Contribution& c, const ActivePlan& plan);

  const AgreementWorld& world_;
  const capture::CommInfo& info_;
  Serving& serving_;
  AgreementLog& log_;
  // A publish or confirm read pending is issued again at due_step.
  struct SetUpWait {
    RoundKind kind = RoundKind::Confirm;
    uint64_t decision_hash = 0;
    uint64_t due_step = 0;
    uint32_t reads = 0;  // pending reads of this round kind of the plan so far
  };
  SetUpWait wait_;
  std::string set_up_failed_;  // why the peers' windows could not be opened ("": they could)
  bool set_up_in_background_ = false;
  bool prepare_in_background_ = false;
};

}  // namespace magi::rewrite
