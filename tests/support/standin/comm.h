// A communicator as this process sees it: its rank, the shared segment, and the counters that
// put its operations in the same order on every rank. Only the thread using the communicator
// touches these (NCCL's rule too), so none of it is locked; a CUDA graph's replay uses it from
// CUDA's host-function thread, in stream order with the program's calls (device_memory.h).
#pragma once

#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tests/support/standin/segment.h"

namespace standin {
class Operation;
}

struct ncclComm {
  std::shared_ptr<standin::Segment> segment;
  int rank = 0;
  int nranks = 0;
  int cuda_device = 0;

  // Collectives (and splits) run one at a time, in call order, matched by position.
  uint64_t next_seq = 0;  // number of the next collective, as messages show it
  uint64_t collective_tickets = 0;
  uint64_t collective_turn = 0;
  uint64_t rounds_done = 0;  // collective rounds finished; equal on every rank

  // Send/Recv: in call order per peer and direction; the chunk counters mirror PairChannel.
  std::vector<uint64_t> send_tickets, send_turn, recv_tickets, recv_turn;
  std::vector<uint64_t> chunks_sent, chunks_received;

  uint64_t splits = 0;  // children derived so far: part of the child's segment name
  uint64_t shrinks = 0;
  bool finalized = false;
  bool revoked = false;
  std::atomic<bool> aborted{false};  // set by ncclCommAbort, from any thread
  std::string broken;  // why this communicator refuses work (a timeout); empty if healthy
  // A non-blocking ncclCommInitRank* (config.blocking = 0) outside a group: the wait for every
  // rank to join, advanced by ncclCommGetAsyncError (ncclInProgress until it is done), as NCCL's
  // own non-blocking initialisation is; empty once joined.
  std::shared_ptr<standin::Operation> joining;
  std::mutex replay_mutex;  // one CUDA graph's replay of this communicator's operations at a time
};

namespace standin {

inline constexpr char kSegmentPrefix[] = "/magi-standin-";

// Opens (or creates) the named segment and takes `rank` in it.
ncclComm* join_communicator(const std::string& segment_name, int nranks, int rank, int cuda_device);

ncclUniqueId make_unique_id();
std::string segment_name_of(const ncclUniqueId& id);  // throws on an id not made here

// A child's segment name: the parent's name with its random part replaced by a hash of the
// parent name and `derivation`, which every member passes alike.
std::string child_segment_name(const std::string& parent, const std::string& derivation);

// Throws unless `comm` can take new work.
void check_usable(const ncclComm* comm);
// A non-blocking join in progress advanced once, never waiting: ncclInProgress until every rank
// joined, then its result (ncclSuccess once there is none, or no longer one).
ncclResult_t advance_join(ncclComm* comm);

}  // namespace standin
