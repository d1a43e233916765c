// Completion in the flight recorder (MAGI_FLIGHT_RECORDER_COMPLETION=1): for each recorded call,
// when its stream reached it (all work queued before it finished) and when its own work
// finished, observed without ever waiting on the GPU. Fills Record::reached and
// Record::completed with seq + 1; RingHeader::completion says how:
//
// - kCompletionEvents (the CUDA driver is in the process): an event is recorded on the call's
//   stream before the real call ("reached") and one after it returns ("completed"); for a call
//   inside ncclGroupStart/End, after the outermost group end returns, since NCCL launches there.
//   Events come from a bounded pool per context, made lazily; a poller thread, started at the
//   first watched call, queries them (cuEventQuery, never a wait) about every millisecond and
//   marks the records. Not watched: calls that returned an error or ncclInProgress, calls made
//   while the pool is exhausted (the GPU far behind).
//   A call on a stream capturing a CUDA graph is watched at each replay instead: two host nodes
//   go into the graph around its work (cuLaunchHostFunc), the first clears `completed` and sets
//   `reached` when a replay gets there, the second sets `completed` when its work is done. Until
//   its first replay it is "not watched (captured)"; after, its words are those of its latest
//   replay, so a replay stuck in it reads "reached, not completed", as an eager call would.
// - kCompletionReturn (no driver: no asynchronous work): a call is reached and completed when
//   it returns (a grouped call when its outermost group end returns).
//
// The call path takes one short lock (no driver call under it) to take and give events; the
// driver calls it makes are cuStreamGetCtx and two cuEventRecord (a captured call: two
// cuLaunchHostFunc).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "capture/flight_recorder.h"

namespace magi {
struct CudaDriver;
}

namespace magi::capture {

// The source for a ring joining now: Off when MAGI_FLIGHT_RECORDER_COMPLETION is 0 or in a
// forked child (CUDA does not survive fork); Events when the driver is loaded and offers the
// event calls; Return when no driver is loaded. Off the call path.
flight::CompletionSource completion_source();

// ---- the call path ----

// After flight_issue, for a ring whose source is not Off. `capturing`: the stream is capturing
// a graph, or that is unknown.
void completion_issue(const FlightSlot& slot, uint64_t seq, cudaStream_t stream,
                      bool capturing) noexcept;
// After the real call returned `result`; `group_depth` is the calling thread's at that point.
void completion_return(int32_t result, int group_depth) noexcept;
// After the outermost ncclGroupEnd and everything it launched returned `result`.
void completion_group_ended(int32_t result) noexcept;
// The outermost group was only simulated (ncclGroupSimulateEnd): its calls never run.
void completion_group_discarded() noexcept;

// At exit (the lifecycle's first step, capture::stop_completion): the poller makes one last pass,
// marking what finished in the job's last millisecond, and stops, waited for at most 100 ms, so
// it is not inside the driver while CUDA's own exit handlers run. Nothing without a poller.
void completion_stop() noexcept;

// In a child after fork(): nothing is watched any more (the poller thread is not there).
void completion_forget_in_child();

// Calls not watched because the event pool was exhausted, since the process started.
uint64_t completion_unwatched();

// Test seam: the driver table the event source calls (tests give a fake one, whose events
// finish when the test says), as completion_source() sets it when it finds the driver.
void completion_use_driver(const CudaDriver* driver);

// ---- the poller's logic, apart from the driver (tests drive it with a fake query) ----

// Marks `word` (&Record::reached or &Record::completed) of `record` with seq + 1, only while
// the slot still holds call `seq`: after wraparound a later call owns it and is left alone.
// True when marked.
bool mark_completion(flight::Record& record, uint64_t seq, uint64_t flight::Record::*word);
// Marks call `seq` of `record` as not watched, and why (Record::unwatched), under the same rule.
bool mark_unwatched(flight::Record& record, uint64_t seq, flight::UnwatchedReason why);
// A replay of a graph reached captured call `seq`: `completed` cleared, `reached` set, and the
// call watched from now on (`unwatched` cleared), under the same rule. Then mark_completion of
// `completed` when the replay's work for it is done.
bool mark_replay_reached(flight::Record& record, uint64_t seq);

// One watched call between the call path and the poller.
struct WatchedCall {
  flight::Record* record;
  uint64_t seq;
  void* context;  // CUcontext the events were made in
  void* stream;   // CUstream
  void* reached;  // CUevent; for a captured call, its graph's marks (no event)
  void* completed;
  bool reached_seen;
  bool captured = false;  // watched at each replay by host nodes, not by events
};

enum class EventState : uint8_t { Pending, Done, Failed };
using EventQuery = EventState (*)(const WatchedCall& call, void* event);

// One pass of the poller over `calls[0, n)`: marks what `query` says finished. Calls still
// pending stay at the front, in order; the rest (completed, or whose query failed: `failed`
// then true for them) go to `finished`. Returns how many stay. On a stream, work finishes in
// the order it was queued: after a call found pending there, later calls on that stream are
// not asked again in this pass.
size_t completion_pass(WatchedCall* calls, size_t n, EventQuery query, WatchedCall* finished,
                       bool* failed, size_t* finished_count);

}  // namespace magi::capture
