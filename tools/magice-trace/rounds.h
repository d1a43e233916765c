// Agreement rounds as the traces hold them, per communicator and rank, gathered from every file:
// the propose rounds each rank read, what it decided for each gather, and the route changes
// that followed. What `magice-trace decisions` prints and checks.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "capture/trace_reader.h"

namespace magi::tool {

// One propose round a rank read.
struct ReadRound {
  uint32_t round = 0;
  const trace::AgreementRecord* read = nullptr;         // its Read record; null if it was lost
  std::vector<const trace::DecisionRecord*> decisions;  // by position in the step
  // Activated and Deactivated events, and publish or confirm reads that failed, from this read
  // on until the rank read its next round.
  std::vector<const trace::AgreementRecord*> route_changes;

  trace::AgreementMode mode() const;
  uint32_t gathers() const;
  uint32_t moved() const;
  bool dry_run() const;  // some gather "would move": the round only reported
  trace::Reason reason() const;
};

struct RankRounds {
  int32_t rank = -1;
  std::vector<ReadRound> rounds;  // by round number
  // The hello's read when it kept the communicator on NCCL (settings differ, ...); else null.
  const trace::AgreementRecord* hello_refused = nullptr;
};

struct CommRounds {
  uint64_t comm_id = 0;
  std::vector<RankRounds> ranks;  // by rank, also those that read no round
  bool any_agreement = false;     // some rank recorded an agreement event, read or not
  bool any_read() const;
};

// Every communicator of the traces, by id. Pointers point into `traces`, which must outlive
// the result.
std::vector<CommRounds> rounds_of(const std::vector<trace::Trace>& traces);

// A rank and the round of it being printed; null when it read none (or not that one).
struct RankRound {
  int32_t rank = -1;
  const ReadRound* round = nullptr;
};

// Where ranks that read the same round decided differently: one "ranks disagree on comm X
// gather #N ..." line per gather position. Verdicts count, reasons do not (each rank words its
// own). A gather only some ranks have disagrees only if one of them does not keep it on NCCL.
std::vector<std::string> verdict_disagreements(uint64_t comm_id, std::span<const RankRound> ranks);

// "rank 3" or "ranks 0, 1, 5".
std::string ranks_text(std::span<const int32_t> ranks);

}  // namespace magi::tool
