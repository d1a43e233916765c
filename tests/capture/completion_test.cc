// Completion in the flight recorder without a GPU: the return path's marking (grouped calls at
// their group's end), a ring slot reused after wraparound never marked for its old call, the
// poller's pass over watched calls with a fake event query, and `magice-trace hang`'s GPU
// verdicts from ring files built here.
#include "capture/completion.h"

#include <gtest/gtest.h>
#include <nccl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/cuda_driver.h"
#include "capture/trace_format.h"
#include "tests/capture/ring_file.h"
#include "tests/support/tool_run.h"

namespace magi::capture {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kComm = 0x5e6f77881a2b3c4dull;

// A ring file of rank `rank` of `nranks`, whose process is pid 1000 + rank.
struct RingFile : TestRingFile {
  RingFile(uint32_t capacity, int rank, int nranks, flight::CompletionSource completion)
      : TestRingFile(capacity, kComm, rank, nranks, 1000 + static_cast<uint64_t>(rank),
                     completion) {}
};

uint64_t word(const std::atomic_ref<uint64_t>& w) { return w.load(); }
uint64_t reached(flight::Record& r) { return word(std::atomic_ref<uint64_t>(r.reached)); }
uint64_t completed(flight::Record& r) { return word(std::atomic_ref<uint64_t>(r.completed)); }

// ---- the return path (no CUDA driver: complete when returned) ----

TEST(Completion, AReturnedCallIsReachedAndCompletedWhenCompletionIsByReturn) {
  RingFile file(16, 0, 1, flight::kCompletionReturn);
  const FlightSlot slot = file.issue(5);
  ASSERT_NE(slot.record, nullptr);
  EXPECT_EQ(slot.completion, flight::kCompletionReturn);
  completion_issue(slot, 5, nullptr, false);
  EXPECT_EQ(completed(*slot.record), 0u) << "not before it returns";
  completion_return(ncclSuccess, 0);
  EXPECT_EQ(reached(*slot.record), 6u);
  EXPECT_EQ(completed(*slot.record), 6u);
  const flight::FileView view = file.read();
  ASSERT_EQ(view.rings.size(), 1u);
  EXPECT_EQ(view.rings[0].header.completion, flight::kCompletionReturn);
  EXPECT_EQ(view.rings[0].records[0].completed, 6u);
}

TEST(Completion, ACallThatFailedOrIsInProgressIsNotMarked) {
  RingFile file(16, 0, 1, flight::kCompletionReturn);
  const FlightSlot failed = file.issue(0);
  completion_issue(failed, 0, nullptr, false);
  completion_return(ncclSystemError, 0);
  const FlightSlot pending = file.issue(1);
  completion_issue(pending, 1, nullptr, false);
  completion_return(ncclInProgress, 0);
  for (flight::Record* r : {failed.record, pending.record}) {
    EXPECT_EQ(reached(*r), 0u);
    EXPECT_EQ(completed(*r), 0u);
  }
  // Each says why it is not watched, so a reader does not take it for one never reached.
  EXPECT_EQ(word(std::atomic_ref<uint64_t>(failed.record->unwatched)),
            uint64_t{flight::kUnwatchedFailed} << 56 | 1);
  EXPECT_EQ(word(std::atomic_ref<uint64_t>(pending.record->unwatched)),
            uint64_t{flight::kUnwatchedInProgress} << 56 | 2);
  completion_return(ncclSuccess, 0);  // no call outstanding: marks nothing
  EXPECT_EQ(completed(*pending.record), 0u);
}

TEST(Completion, WithCompletionOffFlightIssueHandsNoRecordToTheWatcher) {
  RingFile file(16, 0, 1, flight::kCompletionOff);
  const FlightSlot slot = file.issue(0);
  EXPECT_EQ(slot.record, nullptr);
  completion_issue(slot, 0, nullptr, false);
  completion_return(ncclSuccess, 0);
  EXPECT_EQ(completed(file.slot(0)), 0u);
  EXPECT_EQ(file.read().rings[0].header.completion, flight::kCompletionOff);
}

TEST(Completion, GroupedCallsCompleteAtTheOutermostGroupEnd) {
  RingFile file(16, 0, 1, flight::kCompletionReturn);
  for (uint64_t seq = 0; seq < 3; ++seq) {
    completion_issue(file.issue(seq), seq, nullptr, false);
    completion_return(ncclSuccess, 1);
  }
  for (uint64_t seq = 0; seq < 3; ++seq) EXPECT_EQ(completed(file.slot(seq)), 0u) << seq;
  completion_group_ended(ncclSuccess);
  for (uint64_t seq = 0; seq < 3; ++seq) {
    EXPECT_EQ(reached(file.slot(seq)), seq + 1) << seq;
    EXPECT_EQ(completed(file.slot(seq)), seq + 1) << seq;
  }
  // A group whose end failed, or that was only simulated, ran nothing.
  completion_issue(file.issue(3), 3, nullptr, false);
  completion_return(ncclSuccess, 2);
  completion_group_ended(ncclInternalError);
  completion_issue(file.issue(4), 4, nullptr, false);
  completion_return(ncclSuccess, 1);
  completion_group_discarded();
  completion_group_ended(ncclSuccess);  // nothing left to mark
  EXPECT_EQ(completed(file.slot(3)), 0u);
  EXPECT_EQ(completed(file.slot(4)), 0u);
}

// ---- wraparound: the slot names another call by the time its old call would be marked ----

TEST(Completion, ASlotReusedAfterWraparoundIsNeverMarkedForItsOldCall) {
  RingFile file(16, 0, 1, flight::kCompletionReturn);
  flight::Record& slot = file.slot(0);
  file.issue(0);
  file.issue(16);  // the same slot
  EXPECT_FALSE(mark_completion(slot, 0, &flight::Record::completed));
  EXPECT_FALSE(mark_completion(slot, 0, &flight::Record::reached));
  EXPECT_EQ(completed(slot), 0u);
  EXPECT_EQ(reached(slot), 0u);
  EXPECT_TRUE(mark_completion(slot, 16, &flight::Record::completed));
  EXPECT_EQ(completed(slot), 17u);

  // A grouped call whose slot a later call took before the group ended.
  RingFile grouped(16, 0, 1, flight::kCompletionReturn);
  completion_issue(grouped.issue(0), 0, nullptr, false);
  completion_return(ncclSuccess, 1);
  for (uint64_t seq = 1; seq <= 16; ++seq) grouped.issue(seq);
  completion_group_ended(ncclSuccess);
  EXPECT_EQ(completed(grouped.slot(16)), 0u);
  EXPECT_EQ(reached(grouped.slot(16)), 0u);
  EXPECT_EQ(grouped.slot(16).seq, 16u);
}

// ---- the poller's pass, with a fake query ----

std::map<void*, EventState>* g_events = nullptr;
std::vector<void*>* g_asked = nullptr;

EventState fake_query(const WatchedCall&, void* event) {
  g_asked->push_back(event);
  auto it = g_events->find(event);
  return it == g_events->end() ? EventState::Failed : it->second;
}

void* tag(uintptr_t value) { return reinterpret_cast<void*>(value); }

class CompletionPass : public ::testing::Test {
 protected:
  void SetUp() override {
    g_events = &events_;
    g_asked = &asked_;
  }
  void TearDown() override {
    g_events = nullptr;
    g_asked = nullptr;
  }
  // Call `seq` on `stream` with events 100 + 2 seq (reached) and 101 + 2 seq (completed).
  WatchedCall watched(RingFile& file, uint64_t seq, uintptr_t stream) {
    file.issue(seq);
    return {&file.slot(seq),    seq,  tag(1), tag(stream), tag(100 + 2 * seq),
            tag(101 + 2 * seq), false};
  }
  void set(uint64_t seq, EventState reached_state, EventState completed_state) {
    events_[tag(100 + 2 * seq)] = reached_state;
    events_[tag(101 + 2 * seq)] = completed_state;
  }
  std::map<void*, EventState> events_;
  std::vector<void*> asked_;
};

TEST_F(CompletionPass, MarksWhatFinishedAndKeepsThePendingInOrder) {
  RingFile file(16, 0, 1, flight::kCompletionEvents);
  WatchedCall calls[4] = {watched(file, 0, 1), watched(file, 1, 1), watched(file, 2, 1),
                          watched(file, 3, 2)};
  set(0, EventState::Done, EventState::Done);
  set(1, EventState::Done, EventState::Pending);  // stream 1 is inside call 1
  set(2, EventState::Pending, EventState::Pending);
  set(3, EventState::Done, EventState::Done);  // another stream, done
  WatchedCall finished[4];
  bool failed[4];
  size_t finished_count = 0;
  size_t n = completion_pass(calls, 4, &fake_query, finished, failed, &finished_count);
  ASSERT_EQ(n, 2u);
  EXPECT_EQ(calls[0].seq, 1u);
  EXPECT_TRUE(calls[0].reached_seen);
  EXPECT_EQ(calls[1].seq, 2u);
  EXPECT_FALSE(calls[1].reached_seen);
  ASSERT_EQ(finished_count, 2u);
  EXPECT_EQ(finished[0].seq, 0u);
  EXPECT_EQ(finished[1].seq, 3u);
  EXPECT_FALSE(failed[0]);
  EXPECT_FALSE(failed[1]);
  EXPECT_EQ(reached(file.slot(0)), 1u);
  EXPECT_EQ(completed(file.slot(0)), 1u);
  EXPECT_EQ(reached(file.slot(1)), 2u);
  EXPECT_EQ(completed(file.slot(1)), 0u);
  EXPECT_EQ(reached(file.slot(2)), 0u);
  EXPECT_EQ(completed(file.slot(3)), 4u);
  // Call 2's completion is not asked while call 1, before it on stream 1, is pending.
  for (void* e : asked_) EXPECT_NE(e, tag(105)) << "call 2's completed event was queried";

  // Later: call 1 finishes; call 2 is reached but not complete.
  set(1, EventState::Done, EventState::Done);
  set(2, EventState::Done, EventState::Pending);
  asked_.clear();
  n = completion_pass(calls, n, &fake_query, finished, failed, &finished_count);
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(calls[0].seq, 2u);
  ASSERT_EQ(finished_count, 1u);
  EXPECT_EQ(finished[0].seq, 1u);
  EXPECT_EQ(completed(file.slot(1)), 2u);
  EXPECT_EQ(reached(file.slot(2)), 3u);
  EXPECT_EQ(completed(file.slot(2)), 0u);
  for (void* e : asked_) EXPECT_NE(e, tag(102)) << "call 1's reached event was asked again";
}

TEST_F(CompletionPass, AFailedQueryFinishesTheCallUnmarked) {
  RingFile file(16, 0, 1, flight::kCompletionEvents);
  WatchedCall calls[1] = {watched(file, 0, 1)};
  set(0, EventState::Failed, EventState::Done);
  WatchedCall finished[1];
  bool failed[1] = {false};
  size_t finished_count = 0;
  EXPECT_EQ(completion_pass(calls, 1, &fake_query, finished, failed, &finished_count), 0u);
  ASSERT_EQ(finished_count, 1u);
  EXPECT_TRUE(failed[0]);
  EXPECT_EQ(reached(file.slot(0)), 0u);
  EXPECT_EQ(completed(file.slot(0)), 0u);
}

TEST_F(CompletionPass, ACallWhoseSlotWasReusedFinishesWithoutMarkingTheNewCall) {
  RingFile file(16, 0, 1, flight::kCompletionEvents);
  WatchedCall calls[1] = {watched(file, 0, 1)};
  file.issue(16);  // wraparound before the poller saw call 0 finish
  set(0, EventState::Done, EventState::Done);
  WatchedCall finished[1];
  bool failed[1];
  size_t finished_count = 0;
  EXPECT_EQ(completion_pass(calls, 1, &fake_query, finished, failed, &finished_count), 0u);
  EXPECT_EQ(finished_count, 1u);
  EXPECT_EQ(file.slot(16).seq, 16u);
  EXPECT_EQ(reached(file.slot(16)), 0u);
  EXPECT_EQ(completed(file.slot(16)), 0u);
}

// ---- the event source end to end, with a fake driver: pool, poller thread, group end ----

// A fake CUDA driver: each stream is a queue of recorded events that finish, in order, when the
// test says; the poller thread queries them like real ones.
class FakeGpu {
 public:
  static FakeGpu& get() {
    static FakeGpu gpu;
    return gpu;
  }
  // The first `count` records ever made on `stream` are done.
  void finish(CUstream stream, size_t count) {
    std::lock_guard<std::mutex> lock(mutex_);
    done_[stream] = std::max(done_[stream], count);
  }
  void finish_all(CUstream stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    done_[stream] = recorded_[stream];
  }
  size_t recorded(CUstream stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    return recorded_[stream];
  }
  size_t created() {
    std::lock_guard<std::mutex> lock(mutex_);
    return created_;
  }
  const CudaDriver& driver() const { return driver_; }
  // The host nodes put into the graph `stream` was capturing, in order (a replay runs them).
  std::vector<std::pair<CUhostFn, void*>> host_nodes(CUstream stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    return host_nodes_[stream];
  }
  // Another thread captures a graph in the global mode: the driver refuses every query.
  void capture_elsewhere(bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    capturing_elsewhere_ = on;
  }

  static constexpr uintptr_t kContext = 0xc0;

 private:
  FakeGpu() {
    driver_.cuStreamGetCtx_fn = [](CUstream, CUcontext* context) {
      *context = reinterpret_cast<CUcontext>(kContext);
      return CUDA_SUCCESS;
    };
    driver_.cuCtxGetCurrent_fn = [](CUcontext* context) {
      *context = reinterpret_cast<CUcontext>(kContext);
      return CUDA_SUCCESS;
    };
    driver_.cuCtxSetCurrent_fn = [](CUcontext context) {
      return reinterpret_cast<uintptr_t>(context) == kContext ? CUDA_SUCCESS
                                                              : CUDA_ERROR_INVALID_CONTEXT;
    };
    driver_.cuCtxPushCurrent_fn = [](CUcontext) { return CUDA_SUCCESS; };
    driver_.cuCtxPopCurrent_fn = [](CUcontext*) { return CUDA_SUCCESS; };
    driver_.cuEventCreate_fn = [](CUevent* event, unsigned flags) {
      FakeGpu& gpu = get();
      std::lock_guard<std::mutex> lock(gpu.mutex_);
      if (flags != CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_VALUE;
      *event = reinterpret_cast<CUevent>(0x10000 + gpu.created_++);
      return CUDA_SUCCESS;
    };
    driver_.cuEventRecord_fn = [](CUevent event, CUstream stream) {
      FakeGpu& gpu = get();
      std::lock_guard<std::mutex> lock(gpu.mutex_);
      gpu.events_[event] = {stream, ++gpu.recorded_[stream]};
      return CUDA_SUCCESS;
    };
    driver_.cuLaunchHostFunc_fn = [](CUstream stream, CUhostFn fn, void* data) {
      FakeGpu& gpu = get();
      std::lock_guard<std::mutex> lock(gpu.mutex_);
      gpu.host_nodes_[stream].push_back({fn, data});
      return CUDA_SUCCESS;
    };
    driver_.cuEventQuery_fn = [](CUevent event) {
      FakeGpu& gpu = get();
      std::lock_guard<std::mutex> lock(gpu.mutex_);
      if (gpu.capturing_elsewhere_) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
      auto it = gpu.events_.find(event);
      if (it == gpu.events_.end()) return CUDA_ERROR_INVALID_HANDLE;
      return it->second.second <= gpu.done_[it->second.first] ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
    };
  }

  CudaDriver driver_;
  std::mutex mutex_;
  bool capturing_elsewhere_ = false;
  size_t created_ = 0;
  std::map<CUevent, std::pair<CUstream, size_t>> events_;  // -> stream, position on it
  std::map<CUstream, size_t> recorded_, done_;
  std::map<CUstream, std::vector<std::pair<CUhostFn, void*>>> host_nodes_;
};

// Waits (at most 5 s) for the poller to make `done` true.
template <class Done>
bool eventually(Done done) {
  for (int i = 0; i < 5000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

// The library stops the poller first thing at exit (shim/lifecycle.cc), which this binary does
// not arm: the same step once every test ran, before the fake driver it queries is destroyed.
class StopPollerAtEnd : public ::testing::Environment {
  void TearDown() override { completion_stop(); }
};
[[maybe_unused]] const ::testing::Environment* const g_stop_poller_at_end =
    ::testing::AddGlobalTestEnvironment(new StopPollerAtEnd);

class CompletionEvents : public ::testing::Test {
 protected:
  void SetUp() override { completion_use_driver(&FakeGpu::get().driver()); }
  // A call on `stream`, issued and returned as the shim's call path does it.
  FlightSlot call(RingFile& file, uint64_t seq, CUstream stream, int32_t result = ncclSuccess,
                  int group_depth = 0, bool capturing = false) {
    const FlightSlot slot = file.issue(seq);
    completion_issue(slot, seq, reinterpret_cast<cudaStream_t>(stream), capturing);
    completion_return(result, group_depth);
    return slot;
  }
  static CUstream stream(uintptr_t n) { return reinterpret_cast<CUstream>(0x5000 + n); }
};

TEST_F(CompletionEvents, ThePollerMarksWhatTheStreamFinishedInOrder) {
  FakeGpu& gpu = FakeGpu::get();
  const CUstream s = stream(1);
  RingFile file(16, 0, 1, flight::kCompletionEvents);
  for (uint64_t seq = 0; seq < 3; ++seq) call(file, seq, s);
  // Per call: "reached" before it, "completed" after it.
  ASSERT_EQ(gpu.recorded(s), 6u);
  gpu.finish(s, 3);  // call 0 done; call 1 reached
  ASSERT_TRUE(
      eventually([&] { return completed(file.slot(0)) == 1 && reached(file.slot(1)) == 2; }));
  EXPECT_EQ(reached(file.slot(0)), 1u);
  EXPECT_EQ(completed(file.slot(1)), 0u);
  EXPECT_EQ(reached(file.slot(2)), 0u);
  EXPECT_EQ(completed(file.slot(2)), 0u);
  gpu.finish_all(s);
  ASSERT_TRUE(eventually([&] { return completed(file.slot(2)) == 3; }));
  EXPECT_EQ(completed(file.slot(1)), 2u);
  EXPECT_EQ(reached(file.slot(2)), 3u);
}

// Calls in flight while another thread captures a CUDA graph (queries refused as unsafe) are
// watched on, and marked complete once the capture ends: never given up as "an event call
// failed".
TEST_F(CompletionEvents, QueriesRefusedDuringAnotherThreadsCaptureAreAskedAgain) {
  FakeGpu& gpu = FakeGpu::get();
  const CUstream s = stream(5);
  RingFile file(16, 0, 1, flight::kCompletionEvents);
  gpu.capture_elsewhere(true);
  for (uint64_t seq = 0; seq < 3; ++seq) call(file, seq, s);
  gpu.finish_all(s);
  std::this_thread::sleep_for(std::chrono::milliseconds(10));  // several passes, all refused
  for (uint64_t seq = 0; seq < 3; ++seq) {
    EXPECT_EQ(completed(file.slot(seq)), 0u) << seq;
    EXPECT_EQ(word(std::atomic_ref<uint64_t>(file.slot(seq).unwatched)), 0u) << seq;
  }
  gpu.capture_elsewhere(false);
  ASSERT_TRUE(eventually([&] { return completed(file.slot(2)) == 3; }));
  for (uint64_t seq = 0; seq < 3; ++seq) {
    EXPECT_EQ(reached(file.slot(seq)), seq + 1) << seq;
    EXPECT_EQ(word(std::atomic_ref<uint64_t>(file.slot(seq).unwatched)), 0u) << seq;
  }
}

TEST_F(CompletionEvents, AGroupedCallsCompletedEventFollowsTheGroupEnd) {
  FakeGpu& gpu = FakeGpu::get();
  const CUstream s = stream(2);
  RingFile file(16, 0, 1, flight::kCompletionEvents);
  call(file, 0, s, ncclSuccess, 1);
  call(file, 1, s, ncclSuccess, 1);
  EXPECT_EQ(gpu.recorded(s), 2u) << "only the reached events, at the calls";
  completion_group_ended(ncclSuccess);
  ASSERT_EQ(gpu.recorded(s), 4u);
  gpu.finish(s, 2);  // both reached: the group's work has not run
  ASSERT_TRUE(eventually([&] { return reached(file.slot(1)) == 2; }));
  EXPECT_EQ(reached(file.slot(0)), 1u);
  EXPECT_EQ(completed(file.slot(0)), 0u);
  gpu.finish_all(s);
  ASSERT_TRUE(eventually([&] { return completed(file.slot(1)) == 2; }));
  EXPECT_EQ(completed(file.slot(0)), 1u);
}

TEST_F(CompletionEvents, CapturedFailedAndInProgressCallsAreNotWatchedAndGiveTheirEventsBack) {
  FakeGpu& gpu = FakeGpu::get();
  const CUstream s = stream(3);
  RingFile file(16, 0, 1, flight::kCompletionEvents);
  call(file, 0, s, ncclSuccess, 0, /*capturing=*/true);
  EXPECT_EQ(gpu.recorded(s), 0u) << "no event goes into a graph";
  call(file, 1, s, ncclInternalError);
  const size_t created = gpu.created();
  call(file, 2, s, ncclInProgress);
  call(file, 3, s, ncclSuccess, 1);
  completion_group_ended(ncclInProgress);  // a non-blocking group end: enqueued later
  EXPECT_EQ(gpu.created(), created) << "the events of a call not watched are reused";
  call(file, 4, s);
  gpu.finish_all(s);
  ASSERT_TRUE(eventually([&] { return completed(file.slot(4)) == 5; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a pass or more after
  for (uint64_t seq = 0; seq < 4; ++seq) {
    EXPECT_EQ(reached(file.slot(seq)), 0u) << seq;
    EXPECT_EQ(completed(file.slot(seq)), 0u) << seq;
  }
  const flight::UnwatchedReason why[4] = {flight::kUnwatchedCaptured, flight::kUnwatchedFailed,
                                          flight::kUnwatchedInProgress,
                                          flight::kUnwatchedInProgress};
  for (uint64_t seq = 0; seq < 4; ++seq)
    EXPECT_EQ(word(std::atomic_ref<uint64_t>(file.slot(seq).unwatched)),
              uint64_t{why[seq]} << 56 | (seq + 1))
        << seq;
  EXPECT_EQ(word(std::atomic_ref<uint64_t>(file.slot(4).unwatched)), 0u);
}

// A captured call is watched at each replay: a host node before its work and one after (after
// the group's end for a grouped call). Until the first replay it reads "not watched (captured)";
// during a replay, reached and not completed; after, completed. A call whose group failed gets
// one node only, which then marks nothing.
TEST_F(CompletionEvents, ACapturedCallIsWatchedAtEachReplayByTwoHostNodes) {
  FakeGpu& gpu = FakeGpu::get();
  const CUstream s = stream(6);
  RingFile file(16, 0, 1, flight::kCompletionEvents);
  call(file, 0, s, ncclSuccess, 0, /*capturing=*/true);
  call(file, 1, s, ncclSuccess, 1, /*capturing=*/true);
  completion_group_ended(ncclSuccess);
  call(file, 2, s, ncclSuccess, 1, /*capturing=*/true);
  completion_group_ended(ncclInternalError);
  EXPECT_EQ(gpu.recorded(s), 0u) << "no event goes into a graph";
  const auto nodes = gpu.host_nodes(s);
  ASSERT_EQ(nodes.size(), 5u);            // call 0's two, call 1's two, call 2's first
  const auto state = [&](uint64_t seq) {  // reached, completed, why not watched
    flight::Record& r = file.slot(seq);
    return std::vector<uint64_t>{reached(r), completed(r),
                                 word(std::atomic_ref<uint64_t>(r.unwatched)) >> 56};
  };
  const uint64_t captured = flight::kUnwatchedCaptured, failed = flight::kUnwatchedFailed;
  EXPECT_EQ(state(0), (std::vector<uint64_t>{0, 0, captured}));
  EXPECT_EQ(state(1), (std::vector<uint64_t>{0, 0, captured}));
  for (int replay = 0; replay < 3; ++replay) {
    nodes[0].first(nodes[0].second);  // a replay reaches call 0
    EXPECT_EQ(state(0), (std::vector<uint64_t>{1, 0, 0})) << "replay " << replay;
    nodes[1].first(nodes[1].second);
    EXPECT_EQ(state(0), (std::vector<uint64_t>{1, 1, 0})) << "replay " << replay;
    nodes[2].first(nodes[2].second);
    nodes[3].first(nodes[3].second);
    EXPECT_EQ(state(1), (std::vector<uint64_t>{2, 2, 0})) << "replay " << replay;
    nodes[4].first(nodes[4].second);
    EXPECT_EQ(state(2), (std::vector<uint64_t>{0, 0, failed})) << "replay " << replay;
  }
}

// Under the rule of every mark: a replay of a call whose slot a later call took marks nothing.
TEST(Completion, AReplayOfACallWhoseSlotWasReusedMarksNothing) {
  RingFile file(16, 0, 1, flight::kCompletionEvents);
  flight::Record& slot = file.slot(3);
  file.issue(3);
  file.issue(3 + 16);  // the slot now holds call 19
  EXPECT_FALSE(mark_replay_reached(slot, 3));
  EXPECT_EQ(reached(slot), 0u);
  EXPECT_TRUE(mark_replay_reached(slot, 19));
  EXPECT_EQ(reached(slot), 20u);
}

TEST_F(CompletionEvents, WhenThePoolIsEmptyCallsGoUnwatchedUntilEventsComeBack) {
  FakeGpu& gpu = FakeGpu::get();
  const CUstream s = stream(4);
  RingFile file(1024, 0, 1, flight::kCompletionEvents);
  const uint64_t unwatched = completion_unwatched();
  // Every event of the context in flight: 512 calls the GPU has not finished.
  uint64_t seq = 0;
  while (completion_unwatched() == unwatched && seq < 1000) call(file, seq++, s);
  EXPECT_EQ(completion_unwatched(), unwatched + 1);
  EXPECT_GE(seq, 2u);
  EXPECT_LE(seq, 513u);
  EXPECT_EQ(gpu.created(), 1024u) << "the pool's bound";
  const uint64_t last_watched = seq - 2;
  const size_t records = gpu.recorded(s);
  gpu.finish_all(s);
  ASSERT_TRUE(eventually([&] { return completed(file.slot(last_watched)) == last_watched + 1; }));
  EXPECT_EQ(completed(file.slot(seq - 1)), 0u) << "the unwatched call";
  // The events came back: a later call is watched with them, no new event made.
  ASSERT_TRUE(eventually([&] {
    call(file, seq, s);
    return gpu.recorded(s) > records;
  }));
  EXPECT_EQ(gpu.created(), 1024u);
  gpu.finish_all(s);
  ASSERT_TRUE(eventually([&] { return completed(file.slot(seq)) == seq + 1; }));
}

// ---- magice-trace hang on ring files made here ----

using test::TempDir;

int run_hang(std::vector<std::string> args, std::string* out) {
  args.insert(args.begin(), "hang");
  return test::run_magice_trace(args, out);
}

// Four ranks issued and returned from collectives #0..#9 (AllGather float32 x 256); on its GPU,
// each completed those before `first_open[rank]` and, of collective first_open, `state[rank]`:
// 'c' completed, 'r' reached only, 'n' not reached, 'u' it and those after captured into a
// graph (not watched).
std::vector<std::string> write_job(const std::string& dir, flight::CompletionSource completion,
                                   const std::vector<uint64_t>& first_open,
                                   const std::string& state) {
  std::vector<std::string> files;
  for (int rank = 0; rank < 4; ++rank) {
    RingFile file(16, rank, 4, completion);
    for (uint64_t seq = 0; seq < 10; ++seq) {
      file.issue(seq);
      flight::Record& r = file.slot(seq);
      std::atomic_ref<uint64_t>(r.returned).store(seq + 1);
      const bool done = seq < first_open[rank] || (seq == first_open[rank] && state[rank] == 'c');
      const bool in = done || (seq == first_open[rank] && state[rank] == 'r');
      if (in) mark_completion(r, seq, &flight::Record::reached);
      if (done) mark_completion(r, seq, &flight::Record::completed);
      if (state[rank] == 'u' && seq >= first_open[rank])
        mark_unwatched(r, seq, flight::kUnwatchedCaptured);
    }
    files.push_back(dir + "/magice.testhost." + std::to_string(1000 + rank) + ".flight");
    file.write(files.back());
  }
  return files;
}

TEST(CompletionHang, NamesTheRankWhoseGpuNeverReachedTheCollectiveTheOthersWaitIn) {
  TempDir dir;
  const auto files = write_job(dir.path, flight::kCompletionEvents, {9, 9, 9, 9}, "rrrn");
  std::string out;
  EXPECT_EQ(run_hang(files, &out), 1) << out;
  const std::string verdict = out.substr(0, out.find('\n'));
  EXPECT_EQ(verdict,
            "comm 77881a2b3c4d: rank 3's GPU never reached collective #9 (AllGather float32 x "
            "256): work queued before it on its stream has not finished; ranks 0-2 wait in it on "
            "the GPU")
      << out;
  EXPECT_NE(out.find("rank 3: issued 10, returned from 10, completed 9 collectives; last call #9 "
                     "AllGather float32 x 256 (collective #9), returned 0, not reached"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("rank 0: issued 10, returned from 10, completed 9 collectives; last call #9 "
                     "AllGather float32 x 256 (collective #9), returned 0, reached, not completed"),
            std::string::npos)
      << out;
  std::vector<std::string> json = {"--json"};
  json.insert(json.end(), files.begin(), files.end());
  EXPECT_EQ(run_hang(json, &out), 1) << out;
  EXPECT_NE(out.find("\"gpu_collective\":9,\"not_reached\":[3],\"inside_on_gpu\":[0,1,2]"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("\"completion\":\"events\",\"reached\":9,\"completed\":9"), std::string::npos)
      << out;
  EXPECT_NE(out.find("\"completion\":\"events\",\"reached\":10,\"completed\":9"), std::string::npos)
      << out;
}

TEST(CompletionHang, SaysWhenEveryRankIsInsideTheSameCollectiveOnTheGpu) {
  TempDir dir;
  const auto files = write_job(dir.path, flight::kCompletionEvents, {7, 7, 7, 7}, "rrrr");
  std::string out;
  EXPECT_EQ(run_hang(files, &out), 1) << out;
  EXPECT_EQ(out.substr(0, out.find('\n')),
            "comm 77881a2b3c4d: ranks 0-3 are all inside collective #7 (AllGather float32 x 256) "
            "on the GPU: none completed it")
      << out;
}

// The last collectives were captured into a graph on every rank: their GPU side is unknown, the
// report says so instead of calling them not reached, and gives no GPU verdict.
TEST(CompletionHang, CallsNotWatchedAreSaidSoAndGiveNoGpuVerdict) {
  TempDir dir;
  const auto files = write_job(dir.path, flight::kCompletionEvents, {8, 8, 8, 8}, "uuuu");
  std::string out;
  EXPECT_EQ(run_hang(files, &out), 0) << out;
  EXPECT_NE(out.find("no hang seen: 4 ranks issued 10 collectives each"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 1: issued 10, returned from 10, completed 8 collectives, then 2 not "
                     "watched (2 captured into a CUDA graph); last call #9 AllGather float32 x "
                     "256 (collective #9), returned 0, not watched (captured into a CUDA graph)"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("not reached"), std::string::npos) << out;
  std::vector<std::string> json = {"--json"};
  json.insert(json.end(), files.begin(), files.end());
  EXPECT_EQ(run_hang(json, &out), 0) << out;
  EXPECT_NE(out.find("\"completed\":8,\"unwatched_after\":2"), std::string::npos) << out;
  EXPECT_NE(out.find("\"unwatched\":\"captured into a CUDA graph\""), std::string::npos) << out;
}

TEST(CompletionHang, NoGpuVerdictWhenEveryCollectiveCompletedOrCompletionWasNotWatched) {
  TempDir dir;
  std::string out;
  const auto done = write_job(dir.path, flight::kCompletionEvents, {10, 10, 10, 10}, "cccc");
  EXPECT_EQ(run_hang(done, &out), 0) << out;
  EXPECT_NE(out.find("no hang seen: 4 ranks issued 10 collectives each"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 2: issued 10, returned from 10, completed 10 collectives"),
            std::string::npos)
      << out;

  // The same words unwatched (completion off) mean nothing: the report is the host side's.
  TempDir off;
  const auto unwatched = write_job(off.path, flight::kCompletionOff, {9, 9, 9, 9}, "rrrn");
  EXPECT_EQ(run_hang(unwatched, &out), 0) << out;
  EXPECT_NE(out.find("no hang seen: 4 ranks issued 10 collectives each"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 3: issued 10, returned from 10 collectives; last call #9"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("completed"), std::string::npos) << out;

  // Completed at return (no driver): the words say no more than "returned", so no GPU verdict.
  TempDir by_return;
  const auto returned = write_job(by_return.path, flight::kCompletionReturn, {9, 9, 9, 9}, "nnnn");
  EXPECT_EQ(run_hang(returned, &out), 0) << out;
  EXPECT_NE(out.find("no hang seen: 4 ranks issued 10 collectives each"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 1: issued 10, returned from 10, completed 9 collectives"),
            std::string::npos)
      << out;
}

}  // namespace
}  // namespace magi::capture
