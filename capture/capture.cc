#include "capture/capture.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "base/base.h"
#include "capture/callsite.h"
#include "capture/completion.h"
#include "capture/dump_signal.h"
#include "capture/flight_recorder.h"
#include "capture/py_callsite.h"
#include "capture/stream_capture.h"
#include "capture/trace_writer.h"

namespace magi::capture {
namespace {

uint32_t thread_id() {
  thread_local const uint32_t tid = static_cast<uint32_t>(syscall(SYS_gettid));
  return tid;
}

thread_local int t_group_depth = 0;
thread_local uint32_t t_group_ordinal = 0;
thread_local bool t_group_point_to_point = false;
thread_local uint32_t t_group_calls = 0;

// Only rank-independent facts go into a shape: the op, datatype and count every rank passes
// alike, the root, and the reduction op. Pointers and peers (which differ by rank) stay out.
uint64_t shape_of(const CallArgs& a) {
  struct {
    uint64_t count;
    int32_t root_or_peer;
    int32_t redop;
    uint8_t op;
    uint8_t dtype;
    uint8_t pad[6];
  } key{};
  key.count = a.count;
  key.root_or_peer = trace::is_collective(a.op) ? a.root_or_peer : -1;
  key.redop = a.redop;
  key.op = static_cast<uint8_t>(a.op);
  key.dtype = static_cast<uint8_t>(a.dtype);
  return XXH3_64bits(&key, sizeof(key));
}

// Call sites and modules already described, one pair of sets per destination (the trace, the
// recorder's file), so each holds every description its calls refer to; direct-mapped sets, so
// a collision only costs writing the same description twice.
constexpr size_t kSeenCallsites = 4096;
constexpr size_t kSeenModules = 512;
struct Described {
  std::atomic<uint64_t> callsites[kSeenCallsites];
  std::atomic<uint64_t> modules[kSeenModules];
};
Described g_in_trace;
Described g_in_recorder;

bool first_sighting(std::atomic<uint64_t>* set, size_t size, uint64_t key) {
  std::atomic<uint64_t>& slot = set[key % size];
  if (slot.load(std::memory_order_relaxed) == key) return false;  // the common case: no locked op
  return slot.exchange(key, std::memory_order_relaxed) != key;
}

void forget_described(Described& seen) {
  for (auto& slot : seen.callsites) slot.store(0, std::memory_order_relaxed);
  for (auto& slot : seen.modules) slot.store(0, std::memory_order_relaxed);
}

// Module records for the frames' modules not yet described, then the Callsite record: to the
// trace (`writer`) or to the recorder's file (null `writer`).
void describe_callsite_to(TraceWriter* writer, Described& seen, uint64_t callsite,
                          const trace::Frame* frames, int count) {
  if (!first_sighting(seen.callsites, kSeenCallsites, callsite)) return;
  auto append = [writer](trace::RecordType type, const void* payload, uint32_t payload_bytes,
                         const void* tail, uint32_t tail_bytes) {
    if (writer != nullptr)
      trace_append(writer, type, payload, payload_bytes, tail, tail_bytes);
    else
      flight_add_site(type, payload, payload_bytes, tail, tail_bytes);
  };
  for (int i = 0; i < count; ++i) {
    const uint64_t module = frames[i].module;
    if (module == 0 || !first_sighting(seen.modules, kSeenModules, module)) continue;
    const ModuleIdentity identity = module_identity(module);
    const std::string tail = identity.path + identity.build_id;
    const trace::ModuleRecord record{module, static_cast<uint32_t>(identity.path.size()),
                                     static_cast<uint32_t>(identity.build_id.size())};
    append(trace::RecordType::Module, &record, sizeof(record), tail.data(),
           static_cast<uint32_t>(tail.size()));
  }
  const trace::CallsiteRecord record{callsite, static_cast<uint32_t>(count), 0};
  append(trace::RecordType::Callsite, &record, sizeof(record), frames,
         static_cast<uint32_t>(count * sizeof(trace::Frame)));
}

void describe_callsite(TraceWriter* writer, bool recorder, uint64_t callsite,
                       const trace::Frame* frames, int count) {
  if (writer != nullptr) describe_callsite_to(writer, g_in_trace, callsite, frames, count);
  if (recorder) describe_callsite_to(nullptr, g_in_recorder, callsite, frames, count);
}

void record_step_event(TraceWriter* writer, const Communicator& comm, StepDetector::Event event) {
  const StepDetector& s = comm.steps;
  trace::StepRecord record{};
  record.comm_id = comm.info.identity;
  record.seq = comm.collectives - 1;
  const bool found = event == StepDetector::Event::Found;
  record.origin = s.origin();
  record.digest = found ? s.digest() : s.lost_digest();  // a lost step is no longer current
  record.repeats = s.repeats();
  record.period = found ? s.period() : s.lost_period();
  record.event = static_cast<uint8_t>(event == StepDetector::Event::Found ? trace::StepEvent::Found
                                                                          : trace::StepEvent::Lost);
  trace_append(writer, trace::RecordType::Step, &record, sizeof(record));
  if (event == StepDetector::Event::Found)
    MAGI_INFO(Capture, "comm %012llx: step of %u collectives found at collective #%llu",
              short_id(comm.info.identity), s.period(),
              static_cast<unsigned long long>(record.seq));
  else
    MAGI_INFO(Capture, "comm %012llx: step lost at collective #%llu after %llu repeats",
              short_id(comm.info.identity), static_cast<unsigned long long>(record.seq),
              static_cast<unsigned long long>(s.repeats()));
}

}  // namespace

uint64_t identity_from_unique_ids(std::span<const ncclUniqueId> ids) {
  return XXH3_64bits(ids.data(), ids.size_bytes());
}

uint64_t identity_for_init_all(int ndev) {
  static std::atomic<uint32_t> calls{0};
  struct {
    uint64_t pid;
    uint32_t ordinal;
    int32_t ndev;
  } key{static_cast<uint64_t>(getpid()), calls.fetch_add(1), ndev};
  return XXH3_64bits(&key, sizeof(key));
}

uint64_t derive_identity(Communicator& p, CommOrigin origin, int color,
                         std::span<const int> excluded_ranks) {
  struct {
    uint64_t parent;
    uint32_t derivation;
    int32_t color;
    uint8_t origin;
    uint8_t pad[7];
  } key{};
  key.parent = p.info.identity;
  key.derivation = p.derivations.fetch_add(1, std::memory_order_relaxed);
  key.color = color;
  key.origin = static_cast<uint8_t>(origin);
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, &key, sizeof(key));
  XXH3_64bits_update(&state, excluded_ranks.data(), excluded_ranks.size_bytes());
  return XXH3_64bits_digest(&state);
}

CommInfo unseen_comm_info(ncclComm_t comm) {
  CommInfo info{};
  info.identity = reinterpret_cast<uintptr_t>(comm) ^ 0x9e3779b97f4a7c15ull;  // rank-local
  info.rank = -1;
  info.nranks = -1;
  info.cuda_device = -1;
  info.origin = CommOrigin::Unknown;
  MAGI_INFO(Capture, "communicator %p was created out of sight; it is recorded, never agreed on",
            static_cast<void*>(comm));
  return info;
}

void comm_joining(uint64_t identity, int rank, int nranks, CommOrigin origin) {
  (void)flight_join(identity, 0, rank, nranks, static_cast<uint8_t>(origin), flight::kJoining,
                    completion_source());
}

void comm_join_failed(uint64_t identity) {
  flight_set_joined(flight_take_joining(identity), flight::kJoinFailed, 0);
}

void comm_joined(ncclComm_t comm, Communicator& state) {
  probe_cuda_driver();
  arm_dump_signal();
  const CommInfo& info = state.info;
  if (info.rank >= 0) set_log_rank(info.rank);
  trace::CommRecord record{};
  record.comm_id = info.identity;
  record.parent_id = info.parent_identity;
  record.handle = reinterpret_cast<uintptr_t>(comm);
  record.time_ns = clock_ns();
  record.rank = info.rank;
  record.nranks = info.nranks;
  record.cuda_device = info.cuda_device;
  record.origin = static_cast<uint8_t>(info.origin);
  trace_append(trace_writer(), trace::RecordType::Comm, &record, sizeof(record));
  state.flight = flight_take_joining(info.identity);
  if (state.flight != nullptr) {
    flight_set_joined(state.flight, flight::kJoined, info.parent_identity);
    flight_set_completion(state.flight, completion_source());
  } else {
    state.flight = flight_join(info.identity, info.parent_identity, info.rank, info.nranks,
                               record.origin, flight::kJoined, completion_source());
  }
  MAGI_INFO(Capture, "comm %012llx joined: rank %d of %d (%s)", short_id(info.identity), info.rank,
            info.nranks, std::string(trace::origin_name(info.origin)).c_str());
}

void comm_ended(const Communicator& state, CommEndKind how) {
  trace::CommEndRecord record{};
  record.comm_id = state.info.identity;
  record.time_ns = clock_ns();
  record.calls = state.calls.load(std::memory_order_relaxed);
  record.how = static_cast<uint8_t>(how);
  flight_end(state.flight, record.how);
  TraceWriter* writer = trace_writer();
  trace_append(writer, trace::RecordType::CommEnd, &record, sizeof(record));
  if (how != CommEndKind::ProcessExit) trace_flush(writer);
}

void flush_trace() { trace_flush_if_open(); }
void close_trace() { trace_close(); }
void stop_completion() noexcept { completion_stop(); }
void forget_trace_in_child() {
  trace_forget_in_child();
  flight_forget_in_child();
  // The child writes files of its own: each must describe the sites its calls name again.
  forget_described(g_in_trace);
  forget_described(g_in_recorder);
  python_callsites_forget_in_child();
  completion_forget_in_child();
}

void group_start() {
  if (t_group_depth++ == 0) {
    completion_group_discarded();  // calls of a group this thread never ended: never watched
    ++t_group_ordinal;
    t_group_point_to_point = false;
    t_group_calls = 0;
  }
}

void group_end() {
  if (t_group_depth > 0) --t_group_depth;
}

void group_launched(ncclResult_t result) {
  if (t_group_depth == 0) completion_group_ended(result);
}

void group_simulated() {
  if (t_group_depth == 0) completion_group_discarded();
}

int group_depth() { return t_group_depth; }
uint32_t group_ordinal() { return t_group_ordinal; }
bool group_holds_point_to_point() { return t_group_depth > 0 && t_group_point_to_point; }
uint32_t group_calls() { return t_group_depth > 0 ? t_group_calls : 0; }

void trace_record(trace::RecordType type, const void* payload, uint32_t bytes) {
  if (TraceWriter* writer = trace_writer()) trace_append(writer, type, payload, bytes);
}

void begin_call(Communicator& state, const CallArgs& args, CallRecord& record, StepView* view) {
  const Options& options = Options::get();
  record.comm_id = state.info.identity;
  record.seq = state.calls.fetch_add(1, std::memory_order_relaxed);
  record.shape = shape_of(args);
  record.count = args.count;
  record.sendbuf = reinterpret_cast<uintptr_t>(args.sendbuf);
  record.recvbuf = reinterpret_cast<uintptr_t>(args.recvbuf);
  record.stream = reinterpret_cast<uintptr_t>(args.stream);
  record.thread = thread_id();
  record.root_or_peer = args.root_or_peer;
  record.redop = args.redop;
  record.result = 0;
  record.op = static_cast<uint8_t>(args.op);
  record.dtype = static_cast<uint8_t>(args.dtype);
  record.group_depth = static_cast<uint8_t>(t_group_depth > 255 ? 255 : t_group_depth);
  record.rank = state.info.rank;
  record.group = t_group_depth > 0 ? t_group_ordinal : 0;
  record.flags = t_group_depth > 0 ? trace::kCallInGroup : 0;
  if (t_group_depth > 0) {
    ++t_group_calls;
    if (args.op == trace::Op::Send || args.op == trace::Op::Recv) t_group_point_to_point = true;
  }

  TraceWriter* writer = trace_writer();
  const bool recorder = state.flight != nullptr;
  record.callsite = 0;
  // Untraced, only an all-gather's call site is looked at (rewrite/ compares gathers' call
  // sites, while the communicator may explore; the recorder names gathers): the unwinding is
  // most of a call's cost with call sites on, more than the flight recorder's whole cost, so the
  // recorder alone names every call only with MAGI_CALLSITES=2. A trace or the recorder
  // describes each site it names at its first sighting.
  const bool gather_site = args.op == trace::Op::AllGather &&
                           (recorder || state.gather_callsites.load(std::memory_order_relaxed));
  if (options.callsites != 0 &&
      (writer != nullptr || gather_site || (recorder && options.callsites == 2))) {
    trace::Frame frames[64];
    int count = 0;
    record.callsite = callsite_fingerprint(static_cast<int>(options.callsite_depth),
                                           std::span<trace::Frame>(frames, 64), &count);
    if (writer != nullptr || recorder)
      describe_callsite(writer, recorder, record.callsite, frames, count);
  }
  uint64_t python = 0;
  if (options.py_callsites != 0 && (writer != nullptr || recorder)) {
    const auto gil = options.py_callsites == 2 ? PythonGil::Take : PythonGil::IfHeld;
    python = python_callsite(writer, recorder, gil);
    if (python != 0 && writer != nullptr) {
      const trace::PyCallRecord py{record.comm_id, record.seq, python, record.rank, 0};
      trace_append(writer, trace::RecordType::PyCall, &py, sizeof(py));
    }
  }
  const uint64_t pair[2] = {record.shape, record.callsite};
  record.fingerprint = XXH3_64bits(pair, sizeof(pair));

  uint64_t collective = 0;  // index + 1
  if (trace::is_collective(args.op)) {
    state.steps_lock.lock();
    collective = ++state.collectives;
    const StepDetector::Event event = state.steps.push(record.shape);
    if (event != StepDetector::Event::None) record_step_event(writer, state, event);
    if (view != nullptr) {
      const StepDetector& s = state.steps;
      view->collective = true;
      view->event = event;
      view->found = s.found();
      view->position = s.found() ? s.position() : 0;
      view->period = s.period();
      view->digest = s.digest();
      view->repeats = s.repeats();
      view->origin = s.found() ? s.origin() : 0;
      view->collective_index = state.collectives - 1;
    }
    state.steps_lock.unlock();
  }
  if (state.flight != nullptr) {
    const FlightSlot slot =
        flight_issue(state.flight, {record.seq, collective, record.count, record.callsite, python,
                                    record.root_or_peer, record.redop, record.op, record.dtype,
                                    record.group_depth, record.flags});
    if (slot.record != nullptr) {
      // The "reached" event goes on the stream before the real call; never into a graph.
      const bool capturing =
          slot.completion == flight::kCompletionEvents &&
          (stream_capturing(args, record) || (record.flags & trace::kCallCaptureUnknown) != 0);
      completion_issue(slot, record.seq, args.stream, capturing);
    }
  }
  // The clock and the capture state are read only when a trace will keep them: they are most of
  // the pass-through cost (rewrite/ asks for the capture state where it needs it).
  if (writer != nullptr) stream_capturing(args, record);
  record.time_ns = writer != nullptr ? clock_ns() : 0;
  record.duration_ns = 0;
}

bool stream_capturing(const CallArgs& args, CallRecord& record) {
  if (!(record.flags & trace::kCallCaptureAsked)) {
    record.flags |= trace::kCallCaptureAsked;
    switch (stream_capture_status(args.stream)) {
      case StreamCapture::Capturing: record.flags |= trace::kCallCapturing; break;
      case StreamCapture::Unknown: record.flags |= trace::kCallCaptureUnknown; break;
      case StreamCapture::NotCapturing: break;
    }
    // MAGI_INJECT_CAPTURE: the CPU tests' captures (a gather served at once, as its replay).
    const int64_t injected = Options::get().inject_capture_from;
    if (injected > 0 && args.op == trace::Op::AllGather &&
        record.seq >= static_cast<uint64_t>(injected))
      record.flags = static_cast<uint8_t>((record.flags & ~trace::kCallCaptureUnknown) |
                                          trace::kCallCapturing);
  }
  return (record.flags & trace::kCallCapturing) != 0;
}

void end_call(CallRecord& record, ncclResult_t result) {
  record.result = static_cast<int32_t>(result);
  flight_return(record.comm_id, record.seq, record.result);
  completion_return(record.result, t_group_depth);
  if (TraceWriter* writer = trace_writer()) {
    const uint64_t elapsed = clock_ns() - record.time_ns;
    record.duration_ns = elapsed > UINT32_MAX ? UINT32_MAX : static_cast<uint32_t>(elapsed);
    trace_append(writer, trace::RecordType::Call, &record, sizeof(record));
  }
  MAGI_TRACE(Capture, "comm %012llx call #%llu %s count %llu -> %d", short_id(record.comm_id),
             static_cast<unsigned long long>(record.seq),
             std::string(trace::op_name(static_cast<trace::Op>(record.op))).c_str(),
             static_cast<unsigned long long>(record.count), record.result);
}

}  // namespace magi::capture
