// The trace records and log lines of agreement rounds and decisions (tools/magice-trace and the
// tests parse both: their content is a format).
#pragma once

#include <cstdint>

#include "rewrite/contribution.h"
#include "rewrite/observation.h"
#include "rewrite/world.h"

namespace magi::rewrite {

// What every round record of one communicator carries besides the event itself.
struct RoundStamp {
  uint64_t comm_id = 0;
  int32_t rank = 0;
  uint64_t step_digest = 0;
  uint32_t round = 0;  // the round issued (Issued, Abandoned) or the decision's round (others)
  uint32_t period = 0;
  uint32_t gathers = 0;  // of the decision
};

void record_round(const TraceSink& trace, const RoundStamp& stamp, RoundKind kind,
                  trace::RoundEvent event, uint64_t seq, AgreementMode mode, Reason reason,
                  uint32_t moved);

// One Decision record per gather, and the decision's summary line.
void record_decision(const TraceSink& trace, const capture::CommInfo& info,
                     const StepObservation& seen, const Decision& decision, uint32_t round);

// The Window record of a plan whose peers this rank opened.
void record_window(const TraceSink& trace, const RoundStamp& stamp, uint64_t seq,
                   AgreementMode mode, const ce::WindowMemory& memory);

}  // namespace magi::rewrite
