#include "base/agreement_records.h"

#include "base/enum_names.h"

namespace magi::trace {

std::string_view mode_name(AgreementMode mode) {
  static const auto names =
      names_with_fallback<4>({"none", "identical", "slot", "abort"}, 0, "mode#");
  return names[static_cast<uint8_t>(mode)];
}

std::string_view round_kind_name(RoundKind kind) {
  static const auto names =
      names_with_fallback<5>({"propose", "publish", "confirm", "cost", "hello"}, 1, "round#");
  return names[static_cast<uint8_t>(kind)];
}

std::string_view round_event_name(RoundEvent event) {
  static const auto names = names_with_fallback<5>(
      {"issued", "read", "activated", "deactivated", "abandoned"}, 1, "event#");
  return names[static_cast<uint8_t>(event)];
}

std::string_view reason_name(Reason reason) {
  static const auto names = names_with_fallback<static_cast<size_t>(Reason::Count)>(
      {"none",
       "not stable for MAGI_WARMUP_STEPS steps (count, call site or group changed; static "
       "weights: or the send buffer)",
       "host memory",
       "device memory (the host backend serves host memory)",
       "managed memory",
       "memory of unknown kind",
       "a peer is on another host",
       "a peer's GPU is not accessible",
       "shard below MAGI_SYMM_MIN_SHARD_MIB",
       "issued while its stream captured a CUDA graph",
       "bucket larger than MAGI_WINDOW_MAX_MIB",
       "another rank refused it",
       "another gather of its bucket stays",
       "abort: the ranks' steps differ",
       "abort: the ranks group their calls differently",
       "abort: more gathers in the step than a round carries",
       "an agreement round was issued inside an open group",
       "ranks run different MAGI_BACKEND values",
       "the transport failed on some rank",
       "some rank did not confirm the commit",
       "the call deviated from the agreed step",
       "communicator not agreeable (ncclCommInitAll, non-blocking, or unknown)",
       "static bindings would pass MAGI_BIND_MAX_MIB",
       "static weights changed after binding",
       "NCCL was faster for its bucket (timed both ways)",
       "the ranks' schedule settings differ (MAGI_WARMUP_STEPS, ...), or a rank cannot take part",
       "the step was refined: every rank sees a step of several shape steps, each gather its "
       "own position",
       "a communicator of one rank: NCCL's one local copy cannot be beaten (MAGI_CE_FORCE=1 "
       "moves anyway)",
       "some rank is still mapping its peers' memory (off the program's calls); the next step "
       "asks again",
       "captured into a CUDA graph, so untimed, and its bucket's shards are below the size where "
       "the copy engine wins (no verdict from eager calls of that size)",
       "a round at a CUDA graph capture did not reach every rank in time (MAGI_CAPTURE_WAIT_MS), "
       "or a rank was gone",
       "static weights at a CUDA graph capture: its shard cannot be read where it lies (a copy "
       "needs the program's work finished, which a capture cannot wait for)",
       "the ranks span machines holding different numbers of them: no sub-communicator per "
       "local index",
       "the ranks span machines of one rank each: a two-level gather would be NCCL's alone",
       "the ranks span machines on the CUDA backend: the two-level gather runs on the host "
       "backend only"},
      0, "reason#");
  return names[static_cast<uint8_t>(reason)];
}

std::string_view verdict_name(Verdict verdict) {
  static const auto names = names_with_fallback<3>({"moved", "would move", "stays"}, 1, "verdict#");
  return names[static_cast<uint8_t>(verdict)];
}

}  // namespace magi::trace
