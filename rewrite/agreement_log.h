// What one communicator's agreement says in the log (INFO, WARN), each line worded here once. The
// lines said once per communicator (a graph's first captured gather, the answer for captured
// gathers) or once per plan (its window, its set-up's end, calls that read another position's
// binding) remember here that they were said, so the coordinator keeps no flag for them. Tests
// and users read these lines: their wording is a format.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/base.h"
#include "ce_transport/ce_transport.h"
#include "rewrite/contribution.h"
#include "rewrite/phase.h"

namespace magi::rewrite {

class AgreementLog {
 public:
  explicit AgreementLog(uint64_t comm_identity) : comm_(comm_identity) {}

  // ---- the communicator ----
  // Why it never takes part, where it says so (at its creation): `never` (ExplorationPolicy),
  // and whether it is agreeable by program facts, its transport is NCCL, its backend can run.
  void why_no_agreement(Reason never, bool hello_owed, bool nonblocking, bool transport_nccl,
                        bool takes_part) const;
  // A phase change (TRACE: a reader follows the communicator's agreement in one column).
  void phase(Phase from, Phase to, uint64_t seq) const;
  // Rounds: no buffers for one (WARN), NCCL refused one (WARN).
  void cannot_prepare_round(const char* what) const;
  void nccl_refused_round(int result) const;
  // The hello said no: `first_warning` makes it a WARN (the process's first settings warning).
  void hello_refused(const std::string& why, bool first_warning) const;
  // A gather captured into a CUDA graph before any plan was active (once).
  void early_capture(uint64_t seq);
  // What a graph captured at an agreed position gets (once for each answer): moves (`bound`:
  // static weights, else graph slots), or stays (`dry`: a dry run; `slots_never`:
  // MAGI_GRAPH_SLOTS=never; else a plan without graph slots).
  void captured(bool moves, bool bound, bool dry, bool slots_never);
  // A round at a graph capture moved nothing (`why`), once per communicator; `abandoned`: the
  // board's round did not reach every rank (WARN: a rank did not capture what its peers did, or
  // is gone).
  void no_capture_round(uint64_t seq, const char* why, bool abandoned = false);
  // A plan agreed at a graph capture: what moves, what decided without timing, what it took.
  void agreed_at_capture(uint32_t round, uint64_t seq, uint32_t moved, size_t gathers,
                         const char* decided_by, double ms) const;

  // ---- a propose read ----
  void refined(uint32_t round, uint32_t period, uint32_t shape_steps) const;
  void stopped(uint32_t round, Reason why) const;
  void transient(uint32_t round, const Decision& d) const;
  // A plan spanning machines: its two levels, this rank's sub-communicator (`rank`: this rank).
  void two_levels(uint32_t round, const Decision& d, int rank) const;
  void not_timed_again(uint32_t round) const;

  // ---- commit and set-up ----
  // A plan being committed (its publish): its window's lines are said once, and its calls that
  // read another position's binding are counted afresh.
  void new_plan() {
    prepare_unsaid_ = true;
    other_source_calls_ = 0;
  }
  // Its peers' windows begin to open (the publish read): the set-up's end is said once.
  void attach_begins() { set_up_unsaid_ = true; }
  void cannot_prepare_window(const char* what);  // said once per plan
  // The default mode's staging window (once per plan).
  void staging_window(size_t window, size_t slot_bytes, uint32_t gathers);
  // A static plan's window and each reason a shard is bound instead (once per plan); `off_ms`:
  // how long it was prepared off the program's calls (negative: at the call).
  void static_window(uint32_t gathers, const ce::WindowMemory& m, size_t window, double off_ms);
  bool window_unsaid() const { return prepare_unsaid_; }
  // The peers' windows opened (once per plan: set_up_unsaid()).
  bool set_up_unsaid() const { return set_up_unsaid_; }
  void set_up_done(const ce::WindowMemory& m, double set_up_ms, bool in_background);
  void cannot_open_windows(const std::string& error) const;
  void binding_changed(uint32_t round) const;
  void cannot_serve(uint32_t round, Reason why) const;
  void not_confirmed(uint32_t round, Reason why) const;

  // ---- the plan in force ----
  void activated(uint32_t round, bool dry, const Decision& d, uint64_t seq, bool graph_slots) const;
  // A moved call sent a buffer bound for another position (said at the first of the plan).
  void other_source(uint32_t position) {
    if (other_source_calls_++ == 0) say_other_source(position);
  }
  void deactivated(uint64_t seq, Reason why);
  void costs_kept(uint32_t round, uint32_t moved) const;
  void costs_changed(uint32_t round, uint32_t moved, size_t gathers) const;

 private:
  void say_other_source(uint32_t position) const;

  const uint64_t comm_;
  bool early_capture_said_ = false;
  bool captured_moves_said_ = false;
  bool captured_stays_said_ = false;
  bool no_capture_round_said_ = false;
  bool prepare_unsaid_ = false;
  bool set_up_unsaid_ = false;
  uint64_t other_source_calls_ = 0;  // moved calls of the plan that read another's binding
};

}  // namespace magi::rewrite
