// capture/: what each rank did. The face of the folder.
//
// The shim hands every intercepted NCCL call here twice: begin_call before forwarding (the record
// gets its sequence number, shape, call-site fingerprint — an all-gather's, or any call's when
// traced — and position in the communicator's step) and end_call after (the result and duration
// are added, the record goes to the trace). Between the two the shim holds the record on its
// stack: the call path allocates nothing.
//
// Memory stays bounded however long the program runs: per communicator, the step detector's
// ring and the current step; every record streams to the trace file (MAGI_TRACE_DIR) or is
// dropped.
#pragma once

#include <nccl.h>

#include <cstdint>
#include <span>

#include "capture/communicator.h"
#include "capture/skeleton.h"
#include "capture/trace_format.h"

namespace magi::capture {

using trace::CallRecord;
using trace::CommEndKind;
using trace::CommOrigin;
using trace::Op;

struct CallArgs {
  Op op;
  ncclDataType_t dtype;
  size_t count;      // the count argument of the API (sendcount for AllGather, recvcount for
                     // ReduceScatter)
  int root_or_peer;  // root of rooted collectives, peer of Send/Recv, else -1
  int redop;         // ncclRedOp_t of reductions, else -1
  const void* sendbuf;
  void* recvbuf;
  cudaStream_t stream;
};

// What a communicator created out of the shim's sight is recorded as: a rank-local identity,
// unknown rank and size. It is recorded, never agreed on.
CommInfo unseen_comm_info(ncclComm_t comm);

// ---- identities: equal on every rank, computed only from what every rank passes alike ----
uint64_t identity_from_unique_ids(std::span<const ncclUniqueId> ids);
// For ncclCommInitAll: one communicator whose ranks all live in this process.
uint64_t identity_for_init_all(int ndev);
// For a child of `parent` (Split: color; Shrink: the excluded ranks). Every rank of the parent
// takes part in each split or shrink, in the same order, so the parent's derivation count is
// equal on all of them and tells apart two children made with the same color.
uint64_t derive_identity(Communicator& parent, CommOrigin origin, int color,
                         std::span<const int> excluded_ranks);

// ---- lifecycle (the order is the shim's: shim/lifecycle.cc) ----
// This thread enters an init (ncclCommInitRank*) of `identity` as `rank` of `nranks`: the flight
// recorder keeps that it is joining, so a hang in the init (a rank that never comes) shows.
// `comm_join_failed` when the init returned an error; comm_joined otherwise.
void comm_joining(uint64_t identity, int rank, int nranks, CommOrigin origin);
void comm_join_failed(uint64_t identity);
// A communicator joined: its Comm record goes to the trace, its ring to the flight recorder.
void comm_joined(ncclComm_t comm, Communicator& state);
// It ended (destroy, abort, finalize, revoke, or the process exits with it alive): its CommEnd
// record goes to the trace. Flushes the trace unless `how` is ProcessExit (the lifecycle flushes
// once after every communicator ended).
void comm_ended(const Communicator& state, CommEndKind how);
void group_start();
void group_end();
// After the outermost ncclGroupEnd (and what rewrite/ launched at it) returned `result`: the
// flight recorder's completion watches the group's calls from here.
void group_launched(ncclResult_t result);
// After the outermost ncclGroupSimulateEnd: the group's calls never run.
void group_simulated();
// Hands every buffered record to the disk and waits until it is there (never opens a trace
// file); close_trace also closes it, at exit. After fork(), the child's trace is a file of its
// own, opened at its first record.
void flush_trace();
void close_trace();
// At exit, before anything else of ours: the flight recorder's completion poller (if it runs)
// marks what finished last and stops, before CUDA's own exit handlers, which run after the
// lifecycle's (it is armed once a communicator exists, so after the program's CUDA started).
void stop_completion() noexcept;
void forget_trace_in_child();

// ---- the call path ----

// Where a collective stands in its communicator's step, as begin_call saw it. Computed from
// shapes alone, so equal on every rank that issued the same collectives.
struct StepView {
  bool collective = false;  // fed to the step detector (Send/Recv are not)
  StepDetector::Event event = StepDetector::Event::None;
  bool found = false;     // a step is established, including this call
  uint32_t position = 0;  // of this call in the step (found only)
  uint32_t period = 0;
  uint64_t digest = 0;            // of the step's shapes
  uint64_t repeats = 0;           // complete steps since the run began
  uint64_t origin = 0;            // found only: collective index of the run's first call
  uint64_t collective_index = 0;  // of this call among the communicator's collectives
};

// `view`, when given, receives the call's place in the step.
void begin_call(Communicator& comm, const CallArgs& args, CallRecord& record,
                StepView* view = nullptr);
void end_call(CallRecord& record, ncclResult_t result);
// The communicator's untraced all-gathers need no call site from now on (rewrite/ said, when it
// joined or in a call's outcome, that it will never explore it again): capture stops unwinding
// them, for good. Written once, not at every call: the record's cache line stays shared. Inline:
// a communicator that never explores asks it at every call.
inline void stop_gather_callsites(Communicator& comm) noexcept {
  if (comm.gather_callsites.load(std::memory_order_relaxed))
    comm.gather_callsites.store(false, std::memory_order_relaxed);
}
// Whether the call's stream is capturing a CUDA graph, asked of the driver once per call and
// kept in record.flags. begin_call asks only for a traced call: elsewhere the caller asks where
// its decision depends on it.
bool stream_capturing(const CallArgs& args, CallRecord& record);

// The calling thread's ncclGroupStart nesting, and the ordinal of its outermost open group.
int group_depth();
uint32_t group_ordinal();
// Whether the calling thread's open group holds a Send or Recv so far (on any communicator).
bool group_holds_point_to_point();
// The calls the calling thread's open group holds so far, the one being recorded included.
uint32_t group_calls();

// Appends a record of a later stage (agreement, decisions) to this process's trace; nothing
// without a trace.
void trace_record(trace::RecordType type, const void* payload, uint32_t bytes);

}  // namespace magi::capture
