// The hello round: at a communicator's first collective every rank says which settings decide
// WHEN it issues agreement rounds, and whether it can take part at all. rewrite/agreement.h says
// why reading it before any other round keeps a round from ever meeting a program's call.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/base.h"
#include "rewrite/contribution.h"

namespace magi::rewrite {

// This rank's schedule settings, as the hello carries them (values, so a warning can name them).
// MAGI_DRY_RUN and MAGI_STATIC_WEIGHTS do not keep a communicator on NCCL when they differ:
// decide() combines them across ranks. MAGI_STATIC_WEIGHTS and MAGI_GRAPH_SLOTS decide whether a
// rank takes part in a round at a graph capture, which only the ranks that come to it meet (no
// decide() can combine a round a rank never joins), so where they differ no rank takes one.
struct ScheduleSettings {
  int64_t warmup_steps;     // MAGI_WARMUP_STEPS: when the first propose comes; the cost trial
  int64_t reagree_steps;    // MAGI_REAGREE_STEPS: when the next propose comes
  int64_t max_step_calls;   // MAGI_MAX_STEP_CALLS: which steps capture finds, so where anchors are
  int64_t capture_wait_ms;  // MAGI_CAPTURE_WAIT_MS: whether rounds come at a graph capture
  // Not a setting: where the rank runs (ce::Locality::host), so every rank knows from the hello
  // whether the communicator lies on one host, as rounds at a graph capture need
  // (rewrite/capture_rounds.cc).
  uint64_t host;
  uint8_t transport;          // Options::Transport; nccl: no rounds at all
  uint8_t backend;            // Options::Backend
  uint8_t ce_force;           // MAGI_CE_FORCE: whether a cost round follows an activation
  uint8_t backend_available;  // the backend can run in this process
  uint8_t graph_slots;     // Options::GraphSlots: rounds at a capture (rewrite/capture_rounds.cc)
  uint8_t static_weights;  // MAGI_STATIC_WEIGHTS: the same
  uint8_t reserved[2];
};
static_assert(sizeof(ScheduleSettings) == 48);

ScheduleSettings schedule_settings(const Options& options, bool backend_available);
// Takes part in rounds: the copy-engine transport, on a backend this process can run.
bool takes_part(const ScheduleSettings& s);
// The hello's payload: what Contribution::table carries for a RoundKind::Hello.
std::vector<uint8_t> hello_payload(const ScheduleSettings& s);

// What every rank reads from the hello: the same outcome from the same bytes.
struct HelloOutcome {
  bool agreed = false;           // settings alike, and every rank can take part
  Reason reason = Reason::None;  // SettingsDiffer, AnchorInGroup, or StepsDiffer (unreadable)
  std::string why;               // one line for the log when not agreed
  bool one_host = false;         // every rank runs on the same host
  // The settings rounds at a capture depend on are alike on every rank; else `capture_why` says
  // which differ.
  bool capture_alike = false;
  std::string capture_why;
};
HelloOutcome read_hello(std::span<const uint8_t> all, int nranks);

// The process's first settings warning is a WARN, the rest INFO: one line says it to the user.
bool first_settings_warning();

}  // namespace magi::rewrite
