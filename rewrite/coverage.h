// What the program got of its all-gathers on one communicator, said once at its end: how many it
// issued and their bytes, how many the transport served and how many fell back to NCCL, and the
// first collective moved (the same numbering as every log line and magice-trace output).
//   comm 3b46a4da86ce: 96 of 125 all-gathers (25165824 of 32768000 bytes sent) served off NCCL,
//   0 fell back to NCCL; the first at collective #57; exploring cost ...
// Gathers captured into a CUDA graph are counted once, at the capture, and said apart: their
// replays make no call the library sees.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "rewrite/serving.h"

namespace magi::rewrite {

struct Coverage {
  uint64_t gathers = 0, bytes = 0;
  uint64_t moved = 0, moved_bytes = 0;
  uint64_t fell_back = 0;
  uint64_t captured = 0;              // moved into a CUDA graph: moved again at every replay
  uint64_t first_moved = UINT64_MAX;  // collective index of the first call moved

  // An all-gather of the program, sending `sent` bytes from this rank (on the call path).
  void count_gather(uint64_t sent) {
    ++gathers;
    bytes += sent;
  }
  // A bucket of moved gathers (`calls`) served: by the transport, or else by NCCL, a fallback
  // unless the cost trial sent it there (`via_nccl`). `first_collective`: its first call's index.
  // `captured`: the calls were captured into a CUDA graph.
  void count_served(std::span<const NcclGather> calls, bool by_transport, bool via_nccl,
                    uint64_t first_collective, bool captured = false);

  // The line said at the communicator's end, after "comm <id>: ", with what exploring cost
  // (ExplorationPolicy::cost_summary).
  std::string summary(const std::string& exploring_cost) const;
  // That line, at INFO, where the communicator saw an all-gather.
  void say(uint64_t comm_identity, const std::string& exploring_cost) const;
};

}  // namespace magi::rewrite
