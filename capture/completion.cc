#include "capture/completion.h"

#include <nccl.h>
#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

#include "base/base.h"
#include "base/cuda_driver.h"
#include "base/spin_lock.h"

namespace magi::capture {

bool mark_completion(flight::Record& record, uint64_t seq, uint64_t flight::Record::*word) {
  if (std::atomic_ref<uint64_t>(record.stamp).load(std::memory_order_acquire) != seq + 1)
    return false;
  // A later call may take the slot between the check and the store (another thread on the same
  // communicator, ring capacity calls later): its word then holds this call's seq + 1 until it
  // is marked itself, which no reader takes for it (a word counts only when it names the
  // record's own seq). Closing that window would cost a locked instruction per mark.
  std::atomic_ref<uint64_t>(record.*word).store(seq + 1, std::memory_order_release);
  return true;
}

bool mark_unwatched(flight::Record& record, uint64_t seq, flight::UnwatchedReason why) {
  if (std::atomic_ref<uint64_t>(record.stamp).load(std::memory_order_acquire) != seq + 1)
    return false;
  std::atomic_ref<uint64_t>(record.unwatched)
      .store(uint64_t{why} << 56 | (seq + 1), std::memory_order_release);
  return true;
}

bool mark_replay_reached(flight::Record& record, uint64_t seq) {
  if (std::atomic_ref<uint64_t>(record.stamp).load(std::memory_order_acquire) != seq + 1)
    return false;
  std::atomic_ref<uint64_t>(record.completed).store(0, std::memory_order_release);
  std::atomic_ref<uint64_t>(record.reached).store(seq + 1, std::memory_order_release);
  std::atomic_ref<uint64_t>(record.unwatched).store(0, std::memory_order_release);
  return true;
}

size_t completion_pass(WatchedCall* calls, size_t n, EventQuery query, WatchedCall* finished,
                       bool* failed, size_t* finished_count) {
  // Streams with a call found pending in this pass; a full set only costs extra queries.
  constexpr size_t kStreams = 16;
  struct StreamSet {
    void* streams[kStreams];
    size_t count = 0;
    bool has(void* s) const { return std::find(streams, streams + count, s) != streams + count; }
    void add(void* s) {
      if (count < kStreams && !has(s)) streams[count++] = s;
    }
  } not_reached, not_completed;
  size_t kept = 0;
  *finished_count = 0;
  for (size_t i = 0; i < n; ++i) {
    WatchedCall call = calls[i];
    bool done = false, fail = false;
    if (!call.reached_seen && !not_reached.has(call.stream)) {
      switch (query(call, call.reached)) {
        case EventState::Done:
          mark_completion(*call.record, call.seq, &flight::Record::reached);
          call.reached_seen = true;
          break;
        case EventState::Failed: fail = true; break;
        case EventState::Pending: break;
      }
    }
    // A grouped call's "reached" is recorded at the call, its "completed" at the group end: a
    // later call on the stream may be reached while this one has not completed, never before
    // this one is reached.
    if (!call.reached_seen && !fail) not_reached.add(call.stream);
    if (call.reached_seen && !not_completed.has(call.stream)) {
      switch (query(call, call.completed)) {
        case EventState::Done:
          mark_completion(*call.record, call.seq, &flight::Record::completed);
          done = true;
          break;
        case EventState::Failed: fail = true; break;
        case EventState::Pending: break;
      }
    }
    if (done || fail) {
      failed[*finished_count] = fail;
      finished[(*finished_count)++] = call;
      continue;
    }
    not_completed.add(call.stream);
    calls[kept++] = call;
  }
  return kept;
}

namespace {

constexpr size_t kMaxContexts = 8;
constexpr uint32_t kPoolEvents = 1024;  // per context: 512 calls watched at once
constexpr size_t kMaxWatched = kMaxContexts * kPoolEvents / 2;
constexpr size_t kMaxPending = 128;  // grouped calls of one thread waiting for the group's end

// Guards the pools' free lists and the queue to the poller: held for a few stores, never across
// a driver call.
SpinLock g_lock;
struct Locked : std::lock_guard<SpinLock> {
  Locked() : std::lock_guard<SpinLock>(g_lock) {}
};

// Events of one context, made the first time a call needs them (never at load time). All
// state here is trivially destructible: the poller may still run while the process exits.
struct Pool {
  std::atomic<CUcontext> context;
  std::atomic<uint32_t> created;
  uint32_t free_count;  // under g_lock
  CUevent free[kPoolEvents];
};
Pool g_pools[kMaxContexts];

WatchedCall g_queue[kMaxWatched];  // under g_lock: handed over, not yet taken by the poller
size_t g_queue_count = 0;

std::atomic<const CudaDriver*> g_events_driver{nullptr};  // set once Events is the source
std::atomic<bool> g_in_child{false};
std::atomic<bool> g_poller_started{false};
std::atomic<bool> g_stop{false};
std::atomic<bool> g_poller_done{false};
std::atomic<uint64_t> g_unwatched{0};

struct Current {
  WatchedCall call;
  bool active;
};
thread_local Current t_current{};
thread_local WatchedCall t_pending[kMaxPending];
thread_local size_t t_pending_count = 0;

Pool* pool_for(CUcontext context) {
  for (Pool& pool : g_pools) {
    CUcontext held = pool.context.load(std::memory_order_acquire);
    if (held == nullptr) {
      Locked lock;
      held = pool.context.load(std::memory_order_relaxed);
      if (held == nullptr) {
        pool.context.store(context, std::memory_order_release);
        return &pool;
      }
    }
    if (held == context) return &pool;
  }
  return nullptr;  // more contexts than kMaxContexts: their calls are not watched
}

void give_events(CUcontext context, CUevent* events, size_t count) {
  if (count == 0 || context == nullptr) return;
  Pool* pool = pool_for(context);
  if (pool == nullptr) return;
  Locked lock;
  for (size_t i = 0; i < count && pool->free_count < kPoolEvents; ++i)
    pool->free[pool->free_count++] = events[i];
}

bool create_event(const CudaDriver& d, CUcontext context, CUevent* event) {
  CUcontext current = nullptr;
  if (d.cuCtxGetCurrent_fn(&current) != CUDA_SUCCESS) return false;
  const bool push = current != context;
  if (push && d.cuCtxPushCurrent_fn(context) != CUDA_SUCCESS) return false;
  const CUresult made = d.cuEventCreate_fn(event, CU_EVENT_DISABLE_TIMING);
  if (push) {
    CUcontext popped = nullptr;
    d.cuCtxPopCurrent_fn(&popped);
  }
  return made == CUDA_SUCCESS;
}

bool take_events(const CudaDriver& d, Pool& pool, CUevent* out) {
  size_t have = 0;
  {
    Locked lock;
    while (have < 2 && pool.free_count > 0) out[have++] = pool.free[--pool.free_count];
  }
  const CUcontext context = pool.context.load(std::memory_order_relaxed);
  while (have < 2) {
    if (pool.created.fetch_add(1, std::memory_order_relaxed) >= kPoolEvents ||
        !create_event(d, context, &out[have])) {
      pool.created.fetch_sub(1, std::memory_order_relaxed);
      give_events(context, out, have);
      return false;
    }
    ++have;
  }
  return true;
}

void note_unwatched() {
  if (g_unwatched.fetch_add(1, std::memory_order_relaxed) == 0)
    MAGI_INFO(Trace,
              "flight recorder: %u calls of a context are watched at once (the GPU is far "
              "behind, or calls come faster than the poller gives events back): later calls go "
              "unwatched until events come back (their completion stays 0)",
              kPoolEvents / 2);
}

void release(const WatchedCall& call) {
  if (call.captured) return;  // no events: its marks stay with its graph
  CUevent events[2] = {static_cast<CUevent>(call.reached), static_cast<CUevent>(call.completed)};
  give_events(static_cast<CUcontext>(call.context), events, 2);
}

// A call given up: its record says why, so a reader does not take it for one the GPU never
// reached.
void unwatch(const WatchedCall& call, flight::UnwatchedReason why) {
  mark_unwatched(*call.record, call.seq, why);
  release(call);
}

// A captured call's marks, which its graph's host nodes are handed. A graph may outlive the
// communicator and the call's thread, so they are never freed: bounded instead, past which
// captured calls go unwatched (busy). `armed` once both nodes are in the graph: a graph whose
// second node could not be added must not leave a "reached" that nothing completes.
struct ReplayMarks {
  flight::Record* record;
  uint64_t seq;
  std::atomic<bool> armed;
};
constexpr size_t kReplayMarks = size_t{1} << 14;
ReplayMarks g_replay_marks[kReplayMarks];
std::atomic<size_t> g_replay_marks_used{0};

// Host nodes run on a thread of the driver's and may make no CUDA call: stores only.
void CUDA_CB replay_reached(void* marks) {
  auto& m = *static_cast<ReplayMarks*>(marks);
  if (m.armed.load(std::memory_order_acquire)) mark_replay_reached(*m.record, m.seq);
}
void CUDA_CB replay_completed(void* marks) {
  auto& m = *static_cast<ReplayMarks*>(marks);
  if (m.armed.load(std::memory_order_acquire))
    mark_completion(*m.record, m.seq, &flight::Record::completed);
}

// The first host node goes into the graph now, before the call's work; finish() adds the
// second. False (the call then stays "not watched (captured)") without room or the entry point.
bool watch_replays(const CudaDriver& d, WatchedCall& call, cudaStream_t stream) {
  if (d.cuLaunchHostFunc_fn == nullptr) return false;
  const size_t index = g_replay_marks_used.fetch_add(1, std::memory_order_relaxed);
  if (index >= kReplayMarks) return false;
  ReplayMarks& marks = g_replay_marks[index];
  marks.record = call.record;
  marks.seq = call.seq;
  marks.armed.store(false, std::memory_order_relaxed);
  if (d.cuLaunchHostFunc_fn(reinterpret_cast<CUstream>(stream), &replay_reached, &marks) !=
      CUDA_SUCCESS)
    return false;
  call.captured = true;
  call.reached = &marks;
  return true;
}

CUcontext g_poller_context = nullptr;  // the poller thread's current context

// While another thread captures a CUDA graph in the global mode (torch.cuda.graph's default),
// the driver may refuse a query from this thread as potentially unsafe. The event itself is
// fine: it is asked again at the next pass. (The poller asks for the relaxed mode first, which
// exempts it; this covers a driver that refuses anyway.)
bool refused_while_capturing(CUresult result) {
  return result == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ||
         result == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
}

EventState query_event(const WatchedCall& call, void* event) {
  const CudaDriver& d = *g_events_driver.load(std::memory_order_acquire);
  if (call.context != g_poller_context) {
    if (d.cuCtxSetCurrent_fn(static_cast<CUcontext>(call.context)) != CUDA_SUCCESS)
      return EventState::Failed;
    g_poller_context = static_cast<CUcontext>(call.context);
  }
  const CUresult result = d.cuEventQuery_fn(static_cast<CUevent>(event));
  if (result == CUDA_SUCCESS) return EventState::Done;
  return result == CUDA_ERROR_NOT_READY || refused_while_capturing(result) ? EventState::Pending
                                                                           : EventState::Failed;
}

WatchedCall g_watching[kMaxWatched];  // the poller's own
WatchedCall g_finished[kMaxWatched];
bool g_finished_failed[kMaxWatched];

void* poll_events(void*) {
  pthread_setname_np(pthread_self(), "magice-complete");
  // The poller only queries events of calls already issued: it takes no part in any capture,
  // and another thread's capture in the global mode must not refuse its queries (calls in
  // flight when a program starts capturing were once given up as "an event call failed").
  if (const CudaDriver* d = g_events_driver.load(std::memory_order_acquire);
      d != nullptr && d->cuThreadExchangeStreamCaptureMode_fn != nullptr) {
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    d->cuThreadExchangeStreamCaptureMode_fn(&mode);
  }
  size_t n = 0;
  uint64_t failures = 0;
  for (;;) {
    // Once asked to stop (at exit), one last pass: what finished in the last millisecond of a
    // job that ended is marked.
    const bool stopping = g_stop.load(std::memory_order_acquire);
    if (!stopping) {
      const timespec period{0, 1000000};
      nanosleep(&period, nullptr);
    }
    {
      Locked lock;
      const size_t take = std::min(g_queue_count, kMaxWatched - n);
      std::memcpy(g_watching + n, g_queue, take * sizeof(WatchedCall));
      std::memmove(g_queue, g_queue + take, (g_queue_count - take) * sizeof(WatchedCall));
      g_queue_count -= take;
      n += take;
    }
    size_t finished = 0;
    n = completion_pass(g_watching, n, &query_event, g_finished, g_finished_failed, &finished);
    for (size_t i = 0; i < finished; ++i) {
      if (!g_finished_failed[i]) {
        release(g_finished[i]);
        continue;
      }
      mark_unwatched(*g_finished[i].record, g_finished[i].seq, flight::kUnwatchedDriver);
      if (failures++ == 0) {  // its context is gone or broken: the events with it
        MAGI_INFO(Trace,
                  "flight recorder: a call's completion could not be queried; such calls "
                  "stay not completed");
      }
    }
    if (stopping) break;
  }
  g_poller_done.store(true, std::memory_order_release);
  return nullptr;
}

// The poller may be inside the driver while the process exits: it is asked to stop first, and
// waited for briefly (completion_stop, from the lifecycle's exit).
void stop_poller() {
  g_stop.store(true, std::memory_order_release);
  for (int i = 0; i < 100 && !g_poller_done.load(std::memory_order_acquire); ++i) {
    const timespec pause{0, 1000000};
    nanosleep(&pause, nullptr);
  }
}

void start_poller() {
  if (g_poller_started.exchange(true, std::memory_order_acq_rel)) return;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t thread;
  const int err = pthread_create(&thread, &attr, &poll_events, nullptr);
  pthread_attr_destroy(&attr);
  if (err != 0) {
    g_poller_done.store(true, std::memory_order_release);
    MAGI_WARN(Trace,
              "flight recorder: no thread to watch completion (%s); calls stay not "
              "completed",
              std::strerror(err));
  }
}

void hand_to_poller(const WatchedCall& call) {
  bool queued = false;
  {
    Locked lock;
    if (g_queue_count < kMaxWatched) {
      g_queue[g_queue_count++] = call;
      queued = true;
    }
  }
  if (!queued) {
    unwatch(call, flight::kUnwatchedBusy);
    return;
  }
  if (!g_poller_started.load(std::memory_order_relaxed)) start_poller();
}

// The call's work is all queued: with events, the "completed" event goes on its stream.
void finish(const WatchedCall& call) {
  const CudaDriver* d = g_events_driver.load(std::memory_order_acquire);
  if (call.captured) {  // still capturing: the second host node follows the call's work
    auto& marks = *static_cast<ReplayMarks*>(call.reached);
    if (d->cuLaunchHostFunc_fn(static_cast<CUstream>(call.stream), &replay_completed, &marks) ==
        CUDA_SUCCESS)
      marks.armed.store(true, std::memory_order_release);
    return;  // else unarmed: "not watched (captured)" for good
  }
  if (call.context == nullptr) {  // Return: nothing asynchronous
    mark_completion(*call.record, call.seq, &flight::Record::reached);
    mark_completion(*call.record, call.seq, &flight::Record::completed);
    return;
  }
  if (d->cuEventRecord_fn(static_cast<CUevent>(call.completed),
                          static_cast<CUstream>(call.stream)) != CUDA_SUCCESS) {
    unwatch(call, flight::kUnwatchedDriver);
    return;
  }
  hand_to_poller(call);
}

}  // namespace

flight::CompletionSource completion_source() {
  if (!Options::get().flight_recorder_completion || g_in_child.load(std::memory_order_relaxed))
    return flight::kCompletionOff;
  const CudaDriver* d = cuda_driver();
  static std::atomic<int> said{-1};
  flight::CompletionSource source = flight::kCompletionReturn;
  if (d != nullptr) {
    const bool complete = d->cuStreamGetCtx_fn && d->cuCtxGetCurrent_fn && d->cuCtxSetCurrent_fn &&
                          d->cuCtxPushCurrent_fn && d->cuCtxPopCurrent_fn && d->cuEventCreate_fn &&
                          d->cuEventRecord_fn && d->cuEventQuery_fn;
    source = complete ? flight::kCompletionEvents : flight::kCompletionOff;
    if (complete) g_events_driver.store(d, std::memory_order_release);
  }
  if (said.exchange(source, std::memory_order_relaxed) != source) {
    if (source == flight::kCompletionEvents)
      MAGI_INFO(Trace,
                "flight recorder: completion watched by CUDA events, polled off the "
                "call path");
    else if (source == flight::kCompletionReturn)
      MAGI_INFO(Trace,
                "flight recorder: no CUDA driver in the process: a call counts as "
                "completed when it returns");
    else
      MAGI_INFO(Trace,
                "flight recorder: the CUDA driver lacks the event calls: completion is "
                "not watched");
  }
  return source;
}

void completion_issue(const FlightSlot& slot, uint64_t seq, cudaStream_t stream,
                      bool capturing) noexcept {
  if (t_current.active) release(t_current.call);  // a call whose end was never recorded
  t_current.active = false;
  if (slot.record == nullptr || g_in_child.load(std::memory_order_relaxed)) return;
  WatchedCall call{slot.record, seq, nullptr, stream, nullptr, nullptr, false, false};
  if (slot.completion == flight::kCompletionEvents) {
    const CudaDriver* d = g_events_driver.load(std::memory_order_acquire);
    if (d == nullptr) return;
    if (capturing) {  // an event in a graph is no record of a replay: host nodes are
      mark_unwatched(*call.record, call.seq, flight::kUnwatchedCaptured);  // until a replay
      if (watch_replays(*d, call, stream)) t_current = {call, true};
      return;
    }
    CUcontext context = nullptr;
    if (d->cuStreamGetCtx_fn(static_cast<CUstream>(stream), &context) != CUDA_SUCCESS ||
        context == nullptr) {
      unwatch(call, flight::kUnwatchedDriver);
      return;
    }
    Pool* pool = pool_for(context);
    CUevent events[2];
    if (pool == nullptr || !take_events(*d, *pool, events)) {
      note_unwatched();
      unwatch(call, flight::kUnwatchedBusy);
      return;
    }
    call.context = context;
    call.reached = events[0];
    call.completed = events[1];
    if (d->cuEventRecord_fn(events[0], static_cast<CUstream>(stream)) != CUDA_SUCCESS) {
      unwatch(call, flight::kUnwatchedDriver);
      return;
    }
  } else if (slot.completion != flight::kCompletionReturn) {
    return;
  }
  t_current = {call, true};
}

void completion_return(int32_t result, int group_depth) noexcept {
  if (!t_current.active) return;
  t_current.active = false;
  const WatchedCall& call = t_current.call;
  // An error enqueued nothing; ncclInProgress (a non-blocking communicator) enqueues later.
  if (result != ncclSuccess) {
    unwatch(call,
            result == ncclInProgress ? flight::kUnwatchedInProgress : flight::kUnwatchedFailed);
    return;
  }
  if (group_depth == 0) {
    finish(call);
    return;
  }
  if (t_pending_count == kMaxPending) {
    unwatch(call, flight::kUnwatchedBusy);
    return;
  }
  t_pending[t_pending_count++] = call;
}

namespace {

void end_group(int32_t result, flight::UnwatchedReason why_not) {
  const size_t count = t_pending_count;
  t_pending_count = 0;
  for (size_t i = 0; i < count; ++i) {
    if (result == ncclSuccess)
      finish(t_pending[i]);
    else
      unwatch(t_pending[i], result == ncclInProgress ? flight::kUnwatchedInProgress : why_not);
  }
}

}  // namespace

void completion_group_ended(int32_t result) noexcept {
  end_group(result, flight::kUnwatchedFailed);
}

void completion_group_discarded() noexcept {
  end_group(ncclInvalidUsage, flight::kUnwatchedNotRun);
}

void completion_stop() noexcept {
  if (g_poller_started.load(std::memory_order_acquire)) stop_poller();
}

void completion_forget_in_child() {
  g_in_child.store(true, std::memory_order_relaxed);
  g_lock.unlock();  // a parent thread may have held it at the fork
  t_current.active = false;
  t_pending_count = 0;
}

void completion_use_driver(const CudaDriver* driver) {
  g_events_driver.store(driver, std::memory_order_release);
}

uint64_t completion_unwatched() { return g_unwatched.load(std::memory_order_relaxed); }

}  // namespace magi::capture
