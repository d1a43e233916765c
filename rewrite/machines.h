// The machines a communicator's ranks run on, as every rank reads them from one propose round.
//
// A propose carries each rank's machine (ce::Locality::host: the host name and boot, or
// MAGI_INJECT_HOST in tests), so every rank holds the same bytes and computes the same topology:
// ranks grouped by machine, the machines ordered by their lowest rank, each rank's machine index
// and local index (its place among its machine's ranks, by rank). Any numbering: the ranks of a
// machine need not be consecutive.
//
// A plan spanning machines gathers in two levels: between machines, NCCL on a sub-communicator
// per local index l (the ranks (m, l) of every machine m, in machine order); inside each machine,
// the transport among its ranks. That needs every machine to hold the same number of ranks L, and
// L >= 2 (with one rank a machine, the gather would be NCCL's alone): else the communicator stays
// on NCCL with the reason said (uneven: MachinesUneven; one rank each: OneRankPerMachine).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/agreement_records.h"

namespace magi::rewrite {

struct Machines {
  int32_t count = 1;        // machines
  int32_t per_machine = 0;  // ranks on each machine when every machine holds as many, else 0
  std::vector<int32_t> machine_of;  // by rank: its machine's index
  std::vector<int32_t> local_of;    // by rank: its place among its machine's ranks
  // Even splits: the rank at (machine m, local index l), at m × per_machine + l.
  std::vector<int32_t> rank_at;

  bool spans() const { return count > 1; }
  int32_t rank_of(int32_t machine, int32_t local) const {
    return rank_at[static_cast<size_t>(machine * per_machine + local)];
  }
  // Why a plan spanning these machines cannot move (Reason::None: it can, or it spans none).
  trace::Reason refusal() const;
};

// From every rank's machine key, by rank.
Machines machines_of(std::span<const uint64_t> host_by_rank);

}  // namespace magi::rewrite
