// Serving an agreed plan's gathers (rewrite/serving.h) in one process, over a scripted transport
// and NCCL calls that count: which way a bucket goes and how it is timed, what a failure, a
// stale binding, a disagreement or a lost peer leaves behind, and the window's life (open, set up
// off the calls, drop, abandon). Also the window a plan asks for, and the homes of bound shards
// that calls NCCL serves keep up to date.
#include "rewrite/serving.h"

#include "rewrite/machines.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/support/has_line.h"
#include "tests/support/options_env.h"

namespace magi::rewrite {
namespace {

// What the fakes saw and what they do next. The transports hold it too: an orphaned set-up may
// release one after the test is over.
struct Ledger {
  uint64_t clock_ns = 0;
  uint64_t gather_ns = 500;                // what a bucket costs on the transport
  uint64_t nccl_ns = 100;                  // what one gather costs on NCCL
  std::vector<ncclResult_t> nccl_results;  // NCCL's result for each gather, in order (else success)
  ncclResult_t group_end_result = ncclSuccess;
  std::vector<std::string> nccl_calls;  // "start", "gather", "end"
  int timers_made = 0;

  int transports_made = 0;
  std::vector<int> released;   // the transports (by order made) released, in order
  std::vector<int> abandoned;  // likewise abandoned
  std::vector<ce::Transport::Timing> timings;
  enum class Then { Move, FallBack, ThrowOurs, ThrowOther } then = Then::Move;
  std::vector<size_t> stale;  // handed by the next take_stale_bindings
  std::string disagreement;   // handed once by take_disagreement
  std::string lost;           // what lost_peer says
  int lost_asked = 0;
  bool attach_throws = false;
  size_t attached_blobs = 0;
  std::thread::id attached_on;
  // Two levels: whom the transport was made for, its plan's slot, the ops of its last bucket; the
  // sub-communicator's real calls ("id", "init R/N", "destroy", "abort").
  capture::CommInfo made_for{};
  size_t prepared_slot_bytes = 0;
  std::vector<ce::GatherOp> last_ops;
  std::vector<std::string> sub_calls;
  std::vector<void*> gathered_into;      // each NCCL gather's receive buffer
  uint8_t* written_into_slot = nullptr;  // the slot a PartWriter was last given
  uint8_t* held = nullptr;               // the window's held region
};
Ledger* g_ledger = nullptr;

ncclResult_t fake_all_gather(const void*, void* recvbuf, size_t, ncclDataType_t, ncclComm_t,
                             cudaStream_t) {
  g_ledger->gathered_into.push_back(recvbuf);
  const size_t n = static_cast<size_t>(
      std::count(g_ledger->nccl_calls.begin(), g_ledger->nccl_calls.end(), "gather"));
  g_ledger->nccl_calls.push_back("gather");
  g_ledger->clock_ns += g_ledger->nccl_ns;
  return n < g_ledger->nccl_results.size() ? g_ledger->nccl_results[n] : ncclSuccess;
}
ncclResult_t fake_group_start() {
  g_ledger->nccl_calls.push_back("start");
  return ncclSuccess;
}
ncclResult_t fake_group_end() {
  g_ledger->nccl_calls.push_back("end");
  return g_ledger->group_end_result;
}

class ScriptedTransport : public ce::Transport {
 public:
  explicit ScriptedTransport(std::shared_ptr<Ledger> ledger)
      : ledger_(std::move(ledger)), id_(ledger_->transports_made++) {}
  void prepare(const ce::WindowPlan& plan, ce::HandleBlob& out) override {
    bytes_ = 2 * plan.slot_bytes;
    ledger_->prepared_slot_bytes = plan.slot_bytes;
    held_.assign(plan.held_bytes, 0);
    ledger_->held = held_.empty() ? nullptr : held_.data();
    out.bytes[0] = static_cast<uint8_t>(0xa0 + id_);
  }
  uint8_t* held_region() const override {
    return held_.empty() ? nullptr : const_cast<uint8_t*>(held_.data());
  }
  const ce::SourceTable& sources() const override { return sources_; }
  void attach(std::span<const ce::HandleBlob> blobs, std::span<const ce::SourceTable>) override {
    if (ledger_->attach_throws) throw Error(ErrorKind::System, "a peer's window cannot be opened");
    ledger_->attached_blobs = blobs.size();
    ledger_->attached_on = std::this_thread::get_id();
  }
  Served gather(std::span<const ce::GatherOp> ops, void*, Timing timing,
                ce::PartWriter* writer) override {
    ledger_->timings.push_back(timing);
    ledger_->last_ops.assign(ops.begin(), ops.end());
    // Two levels: the parts without a send buffer are written into the slot, as the transport's
    // bucket does once the slot is free.
    if (writer != nullptr) {
      slot_.resize(ledger_->prepared_slot_bytes);
      if (!writer->write_parts(ops, slot_.data(), nullptr)) return Served::FallBack;
      ledger_->written_into_slot = slot_.data();
    }
    switch (ledger_->then) {
      case Ledger::Then::FallBack: return Served::FallBack;
      case Ledger::Then::ThrowOurs: throw Error(ErrorKind::System, "a peer's flag cannot be read");
      case Ledger::Then::ThrowOther: throw std::runtime_error("not one of ours");
      case Ledger::Then::Move: break;
    }
    ledger_->clock_ns += ledger_->gather_ns;
    return Served::Moved;
  }
  void release() override {
    ledger_->released.push_back(id_);
    bytes_ = 0;
  }
  void abandon() override { ledger_->abandoned.push_back(id_); }
  size_t window_bytes() const override { return bytes_; }
  ce::WindowMemory memory() const override { return {}; }
  std::vector<size_t> take_stale_bindings() override { return std::move(ledger_->stale); }
  std::string take_disagreement() override { return std::exchange(ledger_->disagreement, ""); }
  std::string lost_peer() override {
    ++ledger_->lost_asked;
    return ledger_->lost;
  }

 private:
  std::shared_ptr<Ledger> ledger_;
  int id_;
  size_t bytes_ = 0;
  ce::SourceTable sources_;
  std::vector<uint8_t> slot_;  // where a PartWriter writes
  std::vector<uint8_t> held_;  // WindowPlan::held_bytes
};

class LedgerTimer : public ce::CompletionTimer {
 public:
  void start(void*) override { start_ = g_ledger->clock_ns; }
  void stop(void*) override { stop_ = g_ledger->clock_ns; }
  uint64_t elapsed_ns() override { return stop_ - start_; }

 private:
  uint64_t start_ = 0, stop_ = 0;
};

ncclResult_t fake_unique_id(ncclUniqueId* id) {
  g_ledger->sub_calls.push_back("id");
  *id = ncclUniqueId{};
  id->internal[0] = 'S';
  return ncclSuccess;
}
ncclResult_t fake_comm_init(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                            ncclConfig_t*) {
  g_ledger->sub_calls.push_back("init " + std::string(1, id.internal[0]) + " " +
                                std::to_string(rank) + "/" + std::to_string(nranks));
  *comm = reinterpret_cast<ncclComm_t>(uintptr_t{0x2000});
  return ncclSuccess;
}
ncclResult_t fake_async_error(ncclComm_t, ncclResult_t* error) {
  *error = ncclSuccess;
  return ncclSuccess;
}
ncclResult_t fake_comm_destroy(ncclComm_t) {
  g_ledger->sub_calls.push_back("destroy");
  return ncclSuccess;
}
ncclResult_t fake_comm_abort(ncclComm_t) {
  g_ledger->sub_calls.push_back("abort");
  return ncclSuccess;
}

AgreementWorld world_of(const Options& options, const std::shared_ptr<Ledger>& ledger) {
  TransportFactory make;
  make.transport = [ledger](const capture::CommInfo& info) {
    ledger->made_for = info;
    return std::make_unique<ScriptedTransport>(ledger);
  };
  make.timer = [ledger] {
    ++ledger->timers_made;
    return std::make_unique<LedgerTimer>();
  };
  return AgreementWorld{options,
                        {fake_all_gather, fake_group_start, fake_group_end, fake_unique_id,
                         fake_comm_init, fake_async_error, fake_comm_destroy, fake_comm_abort},
                        std::move(make),
                        [] { return GroupView{}; },
                        [](trace::RecordType, const void*, uint32_t) {}};
}

// One communicator's serving, rank 1 of 4, and what it is handed: a staged plan's layout of two
// positions that move (1 and 3) and a bucket of them.
struct Fixture {
  Fixture() { g_ledger = ledger.get(); }
  ~Fixture() { g_ledger = nullptr; }

  ncclResult_t serve(bool via_nccl = false, bool captured = false) {
    bool ignored;
    return serve(via_nccl, captured, ignored);
  }
  ncclResult_t serve(bool via_nccl, bool captured, bool& moved) {
    return serving.serve(ops, calls, nullptr, 0, via_nccl, captured, trial, layout, moved);
  }
  void open_window() {
    ce::HandleBlob handle;
    serving.open_window(plan, handle);
  }

  std::shared_ptr<Ledger> ledger = std::make_shared<Ledger>();
  const Options options = test::options_from({{"MAGI_BACKEND", "host"}});
  const AgreementWorld world = world_of(options, ledger);
  const capture::CommInfo info{0xc0ffee, 0, 1, 4, -1, capture::CommOrigin::InitRank, false};
  Serving serving{world, info, reinterpret_cast<ncclComm_t>(uintptr_t{0x1000})};
  CostTrial trial;
  SlotLayout layout{{SIZE_MAX, 0, SIZE_MAX, 256}, {0, 0, 0, 0}, 512};
  ce::WindowPlan plan{512, false, false, false, 0, {}, 3, 64};
  std::vector<uint8_t> memory = std::vector<uint8_t>(4096);
  std::vector<ce::GatherOp> ops = {{memory.data(), memory.data() + 1024, 64, 0},
                                   {memory.data() + 64, memory.data() + 2048, 64, 256}};
  std::vector<NcclGather> calls = {{memory.data(), memory.data() + 1024, 16, ncclFloat},
                                   {memory.data() + 64, memory.data() + 2048, 16, ncclFloat}};
};

using Timing = ce::Transport::Timing;
using Strings = std::vector<std::string>;

TEST(Serving, ForwardsOneGatherToNcclAloneAndSeveralInOneGroup) {
  Fixture f;
  EXPECT_EQ(f.serving.forward_to_nccl(std::span(f.calls).first(1), nullptr), ncclSuccess);
  EXPECT_EQ(f.ledger->nccl_calls, (Strings{"gather"}));
  f.ledger->nccl_calls.clear();
  EXPECT_EQ(f.serving.forward_to_nccl(f.calls, nullptr), ncclSuccess);
  EXPECT_EQ(f.ledger->nccl_calls, (Strings{"start", "gather", "gather", "end"}));
}

TEST(Serving, ForwardingReturnsTheFirstErrorNcclGave) {
  Fixture f;
  f.ledger->nccl_results = {ncclSuccess, ncclSystemError};
  f.ledger->group_end_result = ncclInternalError;
  EXPECT_EQ(f.serving.forward_to_nccl(f.calls, nullptr), ncclSystemError);
  EXPECT_EQ(f.ledger->nccl_calls, (Strings{"start", "gather", "gather", "end"}));
  f.ledger->nccl_results.clear();
  f.ledger->nccl_calls.clear();
  EXPECT_EQ(f.serving.forward_to_nccl(f.calls, nullptr), ncclInternalError);
}

TEST(Serving, ABucketSentToNcclNeedsNoWindowAndIsTimedAsNccl) {
  Fixture f;
  f.trial.begin(true, 1);
  bool moved = true;
  EXPECT_EQ(f.serve(true, false, moved), ncclSuccess);
  EXPECT_FALSE(moved);
  EXPECT_EQ(f.ledger->nccl_calls, (Strings{"start", "gather", "gather", "end"}));
  EXPECT_TRUE(f.ledger->timings.empty());
  const std::vector<BucketCost> costs = f.trial.medians();
  ASSERT_EQ(costs.size(), 1u);
  EXPECT_EQ(costs[0].nccl_ns, 2 * f.ledger->nccl_ns);
  EXPECT_EQ(costs[0].moved_ns, 0u);
}

TEST(Serving, AMovedBucketWithoutAWindowIsRefusedAndNothingRuns) {
  Fixture f;
  f.trial.begin(true, 1);
  bool moved = true;
  EXPECT_EQ(f.serve(false, false, moved), ncclInternalError);
  EXPECT_FALSE(moved);
  EXPECT_TRUE(f.ledger->nccl_calls.empty());
  EXPECT_EQ(f.ledger->timers_made, 0);
}

TEST(Serving, AMovedBucketIsTimedWhileTheTrialRunsAndNeverWhenCaptured) {
  Fixture f;
  f.open_window();
  f.trial.begin(true, 1);
  bool moved = false;
  EXPECT_EQ(f.serve(false, false, moved), ncclSuccess);
  EXPECT_TRUE(moved);
  EXPECT_EQ(f.ledger->timers_made, 1);
  EXPECT_EQ(f.serve(false, true, moved), ncclSuccess);  // recorded into a CUDA graph
  EXPECT_TRUE(moved);
  EXPECT_EQ(f.ledger->timers_made, 1);
  f.trial.begin(false, 1);  // a plan the trial does not time
  EXPECT_EQ(f.serve(), ncclSuccess);
  EXPECT_EQ(f.ledger->timings,
            (std::vector<Timing>{Timing::Timed, Timing::Captured, Timing::Untimed}));
  EXPECT_TRUE(f.ledger->nccl_calls.empty());
  f.trial.begin(true, 1);
  f.serve();
  const std::vector<BucketCost> costs = f.trial.medians();
  EXPECT_EQ(costs[0].moved_ns, f.ledger->gather_ns);
  EXPECT_EQ(costs[0].nccl_ns, 0u);
}

TEST(Serving, ABucketEveryRankFailedGoesToNcclAndTheWindowIsRefusedLater) {
  Fixture f;
  f.open_window();
  f.ledger->then = Ledger::Then::FallBack;
  testing::internal::CaptureStderr();
  bool moved = true;
  EXPECT_EQ(f.serve(false, false, moved), ncclSuccess);  // NCCL's
  EXPECT_FALSE(moved);
  EXPECT_TRUE(f.serving.failed());
  EXPECT_EQ(f.ledger->nccl_calls, (Strings{"start", "gather", "gather", "end"}));
  f.ledger->nccl_calls.clear();
  f.ledger->nccl_results = {ncclUnhandledCudaError};
  EXPECT_EQ(f.serve(), ncclUnhandledCudaError);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(test::count_lines(log,
                              "comm 000000c0ffee: the transport failed on some rank; its "
                              "gathers go to NCCL until the next agreement round"),
            1u)
      << log;
}

TEST(Serving, ATransportErrorIsReturnedAndFailsTheWindowWithOneWarning) {
  Fixture f;
  f.open_window();
  f.ledger->then = Ledger::Then::ThrowOurs;
  testing::internal::CaptureStderr();
  EXPECT_EQ(f.serve(), ncclSystemError);
  EXPECT_TRUE(f.serving.failed());
  f.ledger->then = Ledger::Then::ThrowOther;  // the bucket's state is unknown
  EXPECT_EQ(f.serve(), ncclInternalError);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(f.ledger->nccl_calls.empty());
  EXPECT_EQ(test::count_lines(log, "a moved gather failed"), 1u) << log;
  EXPECT_TRUE(test::has_line(log,
                             "comm 000000c0ffee: a moved gather failed: a peer's flag cannot "
                             "be read; the communicator goes back to NCCL"))
      << log;
}

TEST(Serving, AStaleBindingNamesEveryPositionBoundAtItsSlot) {
  Fixture f;
  f.open_window();
  f.layout.offset_by_position = {SIZE_MAX, 0, 256, 256};  // 2 and 3 share slot 256
  f.ledger->stale = {256};
  testing::internal::CaptureStderr();
  EXPECT_EQ(f.serve(), ncclSuccess);
  f.serve();  // nothing more found stale
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(f.serving.stale_positions(), (std::vector<uint32_t>{2, 3}));
  EXPECT_EQ(test::count_lines(log,
                              "shard of the gather at position [0-9]+ changed after it was "
                              "bound"),
            2u)
      << log;
  EXPECT_TRUE(test::has_line(log, "position 3 changed after it was bound")) << log;
  EXPECT_FALSE(f.serving.failed()) << "the position goes back to NCCL at the next round only";
  f.serving.forget_stale();
  EXPECT_TRUE(f.serving.stale_positions().empty());
}

TEST(Serving, ADisagreementOfTheRanksReadsIsReturnedByEveryMovedCallAndByAsyncError) {
  Fixture f;
  f.open_window();
  EXPECT_EQ(f.serving.async_error(), ncclSuccess);
  f.ledger->disagreement = "rank 2 read another shard at position 3";
  testing::internal::CaptureStderr();
  bool moved = false;
  EXPECT_EQ(f.serve(false, false, moved), ncclRemoteError);
  EXPECT_TRUE(moved) << "the bucket itself was served";
  EXPECT_TRUE(f.serving.failed());
  f.ledger->stale = {256};  // part of the error reported: no warning of its own
  EXPECT_EQ(f.serve(), ncclRemoteError);
  EXPECT_EQ(f.serving.async_error(), ncclRemoteError);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(test::count_lines(log, "MAGI_STATIC_WEIGHTS=1"), 1u) << log;
  EXPECT_TRUE(test::has_line(log,
                             "comm 000000c0ffee: MAGI_STATIC_WEIGHTS=1: rank 2 read another "
                             "shard at position 3. The communicator reports ncclRemoteError"))
      << log;
  EXPECT_EQ(f.serving.stale_positions(), (std::vector<uint32_t>{3}));
}

TEST(Serving, AsyncErrorFindsADisagreementWithoutAMovedCall) {
  Fixture f;
  f.open_window();
  f.ledger->disagreement = "rank 2 read another shard at position 3";
  testing::internal::CaptureStderr();
  EXPECT_EQ(f.serving.async_error(), ncclRemoteError);
  EXPECT_EQ(f.serving.async_error(), ncclRemoteError);
  testing::internal::GetCapturedStderr();
  EXPECT_TRUE(f.serving.failed());
}

TEST(Serving, APeerIsAskedAboutAtMostOnceASecondAndALostOneIsARemoteError) {
  Fixture f;
  EXPECT_EQ(f.serving.async_error(), ncclSuccess);  // no window: nobody to ask
  EXPECT_EQ(f.ledger->lost_asked, 0);
  f.open_window();
  EXPECT_EQ(f.serving.async_error(), ncclSuccess);
  EXPECT_EQ(f.serving.async_error(), ncclSuccess);
  EXPECT_EQ(f.ledger->lost_asked, 1);

  Fixture g;  // a second communicator asks on its own schedule
  g.open_window();
  g.ledger->lost = "rank 3 (pid 4242)";
  testing::internal::CaptureStderr();
  EXPECT_EQ(g.serving.async_error(), ncclRemoteError);
  EXPECT_EQ(g.serve(), ncclRemoteError);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(g.serving.failed());
  EXPECT_TRUE(test::has_line(log,
                             "comm 000000c0ffee: rank 3 \\(pid 4242\\) ended without "
                             "releasing its window: it died with the communicator in use"))
      << log;
}

TEST(Serving, OpeningAWindowReleasesTheLastOneAndForgetsItsFailure) {
  Fixture f;
  ce::HandleBlob handle;
  f.serving.open_window(f.plan, handle);
  EXPECT_EQ(handle.bytes[0], 0xa0);
  EXPECT_EQ(f.serving.handle().bytes[0], 0xa0);
  EXPECT_EQ(f.serving.window_bytes(), 1024u);
  testing::internal::CaptureStderr();
  f.serving.fail("a test's reason");
  f.serving.fail("another reason");
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(test::count_lines(log,
                              "comm 000000c0ffee: a moved gather failed: a test's reason; the "
                              "communicator goes back to NCCL at its next agreement round"),
            1u)
      << log;
  EXPECT_FALSE(test::has_line(log, "another reason")) << "said once";
  ASSERT_TRUE(f.serving.failed());
  f.plan.slot_bytes = 4096;
  f.serving.open_window(f.plan, handle);
  EXPECT_EQ(f.ledger->released, (std::vector<int>{0}));
  EXPECT_FALSE(f.serving.failed());
  EXPECT_EQ(handle.bytes[0], 0xa1);
  EXPECT_EQ(f.serving.handle().bytes[0], 0xa1);
  EXPECT_EQ(f.serving.window_bytes(), 8192u);
}

TEST(Serving, DropReleasesTheWindowOnceAndTheEndOfServingReleasesTheLast) {
  std::shared_ptr<Ledger> ledger;
  {
    Fixture f;
    ledger = f.ledger;
    f.open_window();
    f.serving.drop();
    EXPECT_EQ(f.ledger->released, (std::vector<int>{0}));
    EXPECT_EQ(f.serving.window_bytes(), 0u);
    EXPECT_EQ(f.serve(), ncclInternalError) << "a dropped window serves nothing";
    f.serving.drop();
    EXPECT_EQ(f.ledger->released, (std::vector<int>{0}));
    f.open_window();
  }
  EXPECT_EQ(ledger->released, (std::vector<int>{0, 1}));
}

TEST(Serving, AnAbandonedServingGivesUpItsWaitsAndOpensNoWindowAgain) {
  Fixture f;
  f.open_window();
  f.serving.abandon();
  EXPECT_EQ(f.ledger->abandoned, (std::vector<int>{0}));
  ce::HandleBlob handle;
  try {
    f.serving.open_window(f.plan, handle);
    ADD_FAILURE() << "a window opened after the abandon";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Usage);
  }
  EXPECT_THROW(f.serving.begin_prepare(f.plan, std::chrono::milliseconds(0)), Error);
  EXPECT_EQ(f.ledger->transports_made, 1);
}

// Polls until the set-up is no longer running (it starts at once: no delay).
Serving::SetUp settled(Serving& serving, std::string& error) {
  Serving::SetUp state = serving.poll_set_up(error);
  for (int i = 0; i < 5000 && state == Serving::SetUp::Running; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    state = serving.poll_set_up(error);
  }
  return state;
}

TEST(Serving, APrepareOffTheCallsHandsTheHandleBackOnceDone) {
  Fixture f;
  f.serving.begin_prepare(f.plan, std::chrono::milliseconds(0));
  std::string error;
  EXPECT_EQ(settled(f.serving, error), Serving::SetUp::Done);
  EXPECT_EQ(error, "");
  EXPECT_EQ(f.serving.handle().bytes[0], 0xa0);
  EXPECT_EQ(f.serving.window_bytes(), 1024u);
  EXPECT_EQ(f.serve(), ncclSuccess) << "the transport is back";
  EXPECT_EQ(f.serving.poll_set_up(error), Serving::SetUp::Done) << "and stays back";
}

TEST(Serving, AnAttachOffTheCallsHandsTheTransportBackAttachedOrSaysWhyNot) {
  Fixture f;
  f.open_window();
  const std::vector<ce::HandleBlob> handles(4);
  f.serving.begin_attach(handles, {}, std::chrono::milliseconds(0));
  std::string error;
  EXPECT_EQ(settled(f.serving, error), Serving::SetUp::Done);
  EXPECT_EQ(f.ledger->attached_blobs, 4u);
  EXPECT_NE(f.ledger->attached_on, std::this_thread::get_id());
  EXPECT_EQ(f.serve(), ncclSuccess);

  f.ledger->attach_throws = true;
  f.serving.begin_attach(handles, {}, std::chrono::milliseconds(0));
  EXPECT_EQ(settled(f.serving, error), Serving::SetUp::Failed);
  EXPECT_EQ(error, "a peer's window cannot be opened");
  EXPECT_EQ(f.serving.window_bytes(), 1024u) << "the transport is back, unattached, for drop()";
  f.serving.drop();
  EXPECT_EQ(f.ledger->released, (std::vector<int>{0}));
}

TEST(Serving, AttachingWithoutAWindowIsAnInternalError) {
  Fixture f;
  try {
    f.serving.begin_attach(std::vector<ce::HandleBlob>(4), {}, std::chrono::milliseconds(0));
    ADD_FAILURE() << "an attach started without a window";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Internal);
  }
}

TEST(Serving, AttachNowAttachesOnTheCallingThread) {
  Fixture f;
  f.open_window();
  f.serving.attach_now(std::vector<ce::HandleBlob>(4), {});
  EXPECT_EQ(f.ledger->attached_blobs, 4u);
  EXPECT_EQ(f.ledger->attached_on, std::this_thread::get_id());
}

TEST(Serving, PollingWithNoSetUpSaysWhetherAWindowIsThere) {
  Fixture f;
  std::string error;
  EXPECT_EQ(f.serving.poll_set_up(error), Serving::SetUp::Failed);
  f.open_window();
  EXPECT_EQ(f.serving.poll_set_up(error), Serving::SetUp::Done);
}

// A step of four all-gathers of 1000 floats from buffers of their own; positions 1 and 3 move.
struct Plan {
  explicit Plan(bool bound) {
    seen.reset(4);
    seen.begin_step();
    for (uint32_t p = 0; p < 4; ++p) {
      CallFacts f;
      f.op = trace::Op::AllGather;
      f.dtype = static_cast<uint8_t>(ncclFloat);
      f.count = 1000;
      f.callsite = 1 + p;
      f.sendbuf = 0x10000 * (p + 1);
      seen.observe(p, f, ce::Backend::Host);
    }
    decision.bound = bound;
    decision.graph_slots = true;
    for (uint32_t p = 0; p < 4; ++p)
      decision.gathers.push_back({p, static_cast<uint16_t>(p), p % 2 == 1,
                                  p % 2 == 1 ? Reason::None : Reason::NotStable, -1});
    layout = lay_out_slots(seen, decision.gathers, bound);
  }
  StepObservation seen;
  Decision decision;
  SlotLayout layout;
};

TEST(WindowPlan, AStagedPlanBindsNothingAndHasGraphSlotsWhereAgreed) {
  const Plan p(false);
  const Options options =
      test::options_from({{"MAGI_BACKEND", "host"}, {"MAGI_VERIFY_EVERY", "16"}});
  const ce::WindowPlan plan = window_plan(p.decision, p.seen, p.layout, options);
  EXPECT_FALSE(plan.bound);
  EXPECT_FALSE(plan.zero_copy);
  EXPECT_TRUE(plan.graph_slots);
  EXPECT_TRUE(plan.bind.empty());
  EXPECT_EQ(plan.slot_bytes, p.layout.slot_bytes);
  EXPECT_EQ(plan.table_room, kPublishTableRoom);
  EXPECT_EQ(plan.verify_every, 16u);
}

TEST(WindowPlan, ABoundPlanBindsEachMovingGatherFromItsLastSendBufferAndReadsItInPlace) {
  const Plan p(true);
  const ce::WindowPlan plan =
      window_plan(p.decision, p.seen, p.layout, test::options_from({{"MAGI_BACKEND", "host"}}));
  EXPECT_TRUE(plan.bound);
  EXPECT_TRUE(plan.zero_copy);
  EXPECT_FALSE(plan.graph_slots) << "a bound window's captured reads need no slots of their own";
  ASSERT_EQ(plan.bind.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const uint32_t position = static_cast<uint32_t>(2 * i + 1);
    EXPECT_EQ(plan.bind[i].sendbuf,
              reinterpret_cast<const void*>(uintptr_t{0x10000} * (position + 1)));
    EXPECT_EQ(plan.bind[i].bytes, 4000u);
    EXPECT_EQ(plan.bind[i].slot_offset, p.layout.offset_by_position[position]);
  }
  EXPECT_NE(plan.bind[0].slot_offset, plan.bind[1].slot_offset);
  EXPECT_EQ(plan.table_room, publish_round_bytes(2) - sizeof(ContributionHeader));
}

// Rank 1 of 4 on machines (a, a, b, b): machine 0, local index 1; static weights across machines
// (network once). Its window is its machine's (2 ranks, the slot twice as large), its
// sub-communicator's first member is itself (machine 0), formed in the set-up as rank 0 of 2.
// The first moved call of position 1 crosses machines (NCCL on the sub-communicator), the next
// reads only inside the machine; a change of its own shard is a stale position; the plan's end
// destroys the sub-communicator, an abort aborts it.
struct TwoLevels {
  explicit TwoLevels(bool network_once = true) {
    const uint64_t hosts[] = {7, 7, 9, 9};
    plan.decision.machines = machines_of(hosts);
    plan.decision.network_once = network_once;
    plan.decision.graph_slots = false;
    f.serving.span_machines(plan.decision, plan.layout, plan.seen);
    ce::HandleBlob handle;
    f.serving.open_window(window_plan(plan.decision, plan.seen, plan.layout, f.options), handle);
    std::vector<std::vector<uint8_t>> ids(4);
    ids[1] = f.serving.sub_comm_id();
    std::vector<ce::HandleBlob> handles(4);
    f.serving.begin_attach(handles, {}, std::chrono::milliseconds(0), ids);
    std::string error;
    while (f.serving.poll_set_up(error) == Serving::SetUp::Running)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_TRUE(error.empty()) << error;
  }
  ncclResult_t serve_position(uint32_t position, bool& moved, bool captured = false) {
    const size_t bytes = 4000;
    const ce::GatherOp op{
        shard.data(), full.data(),        bytes, plan.layout.offset_by_position[position],
        false,        ce::GatherOp::kOwn, false, plan.layout.bucket_by_position[position]};
    const NcclGather call{shard.data(), full.data(), 1000, ncclFloat};
    return f.serving.serve({&op, 1}, {&call, 1}, nullptr, op.bucket, false, captured, f.trial,
                           plan.layout, moved);
  }
  Fixture f;
  Plan plan{false};
  std::vector<uint8_t> shard = std::vector<uint8_t>(4000);
  std::vector<uint8_t> full = std::vector<uint8_t>(16000);
};

TEST(Serving, TwoLevelsCrossMachinesOnceAGatherWithStaticWeightsAndEndWithThePlan) {
  TwoLevels t;
  EXPECT_EQ(t.f.ledger->made_for.rank, 1);  // local index 1 of its machine's 2
  EXPECT_EQ(t.f.ledger->made_for.nranks, 2);
  EXPECT_NE(t.f.ledger->made_for.identity, t.f.info.identity);
  EXPECT_EQ(t.f.ledger->prepared_slot_bytes, 2 * t.plan.layout.slot_bytes);
  EXPECT_EQ(t.f.ledger->attached_blobs, 2u);
  EXPECT_EQ(t.f.ledger->sub_calls, (Strings{"id", "init S 0/2"}));

  bool moved = false;
  EXPECT_EQ(t.serve_position(1, moved), ncclSuccess);
  EXPECT_TRUE(moved);
  EXPECT_EQ(t.f.ledger->nccl_calls, (Strings{"gather"}));  // between machines, once
  ASSERT_EQ(t.f.ledger->last_ops.size(), 1u);
  const ce::GatherOp& op = t.f.ledger->last_ops[0];
  EXPECT_EQ(op.pieces, 2u);
  EXPECT_EQ(op.bytes, 4000u);
  EXPECT_EQ(op.slot_offset, 2 * t.plan.layout.offset_by_position[1]);
  ASSERT_NE(op.places, nullptr);
  // Local index 0's pieces land at ranks 0 and 2, local index 1's (this rank's) at 1 and 3.
  EXPECT_EQ(std::vector<int32_t>(op.places, op.places + 4), (std::vector<int32_t>{0, 2, 1, 3}));
  // Its pieces are held in the window's held region (NCCL brought them there); this rank's own
  // (machine 0's) is staged from the call's buffer and checked by the transport.
  ASSERT_NE(t.f.ledger->held, nullptr);
  EXPECT_EQ(op.sendbuf, t.f.ledger->held);
  EXPECT_EQ(t.f.ledger->gathered_into, (std::vector<void*>{t.f.ledger->held}));
  EXPECT_EQ(op.own_source, t.shard.data());
  EXPECT_EQ(op.own_piece, 0u);

  EXPECT_EQ(t.serve_position(1, moved), ncclSuccess);
  EXPECT_TRUE(moved);
  EXPECT_EQ(t.f.ledger->nccl_calls, (Strings{"gather"})) << "held: no second crossing";
  EXPECT_TRUE(t.f.serving.stale_positions().empty());
  EXPECT_EQ(t.serve_position(3, moved), ncclSuccess);
  EXPECT_EQ(t.f.ledger->nccl_calls, (Strings{"gather", "gather"}));  // position 3's first
  const auto position_3_at = static_cast<size_t>(
      static_cast<const uint8_t*>(t.f.ledger->last_ops[0].sendbuf) - t.f.ledger->held);
  EXPECT_GT(position_3_at, 0u);

  // The transport finds position 3's own piece changed (the promise broken): said once, and the
  // position is stale until the step changes.
  t.f.ledger->stale = {position_3_at};
  EXPECT_EQ(t.serve_position(1, moved), ncclSuccess);
  EXPECT_EQ(t.f.serving.stale_positions(), (std::vector<uint32_t>{3}));
  t.f.ledger->stale = {position_3_at};
  EXPECT_EQ(t.serve_position(1, moved), ncclSuccess);
  EXPECT_EQ(t.f.serving.stale_positions(), (std::vector<uint32_t>{3}));
  EXPECT_EQ(t.f.ledger->nccl_calls.size(), 2u);

  t.f.serving.drop();
  EXPECT_EQ(t.f.ledger->sub_calls, (Strings{"id", "init S 0/2", "destroy"}));
}

// The default mode (and static weights on GPUs): NCCL between machines writes this rank's part
// straight into its staging slot, inside the transport's bucket (ce::PartWriter), at every call;
// nothing is held and no scratch is copied.
TEST(Serving, TwoLevelsWithoutNetworkOnceWriteTheInterMachinePartIntoTheSlotAtEveryCall) {
  TwoLevels t(false);
  bool moved = false;
  for (int call = 1; call <= 2; ++call) {
    EXPECT_EQ(t.serve_position(1, moved), ncclSuccess);
    EXPECT_TRUE(moved);
    ASSERT_EQ(t.f.ledger->last_ops.size(), 1u);
    const ce::GatherOp& op = t.f.ledger->last_ops[0];
    EXPECT_EQ(op.sendbuf, nullptr) << "written by the bucket's PartWriter";
    EXPECT_EQ(op.pieces, 2u);
    ASSERT_EQ(t.f.ledger->gathered_into.size(), static_cast<size_t>(call));
    ASSERT_NE(t.f.ledger->written_into_slot, nullptr);
    EXPECT_EQ(t.f.ledger->gathered_into.back(), t.f.ledger->written_into_slot + op.slot_offset);
  }
  EXPECT_EQ(t.f.ledger->nccl_calls, (Strings{"gather", "gather"}));
  t.shard[7] ^= 1;  // no promise: nothing is stale
  EXPECT_EQ(t.serve_position(1, moved), ncclSuccess);
  EXPECT_TRUE(t.f.serving.stale_positions().empty());

  // NCCL's part failing: the bucket is this machine's fallback, an error on this rank.
  t.f.ledger->nccl_results.assign(3, ncclSuccess);  // the three gathers above
  t.f.ledger->nccl_results.push_back(ncclSystemError);
  EXPECT_EQ(t.serve_position(1, moved), ncclSystemError);
  EXPECT_FALSE(moved);
  EXPECT_TRUE(t.f.serving.failed());
  t.f.serving.drop();
  EXPECT_EQ(t.f.ledger->sub_calls.back(), "destroy");
}

// A captured bucket records NCCL's part on the sub-communicator into the graph, which may be
// replayed after the plan ends: the plan's end leaves it formed (the parent's end destroys it),
// and the parent's abort aborts it too.
TEST(Serving, ASubCommunicatorThatAGraphRecordedOutlivesThePlan) {
  TwoLevels t(false);
  bool moved = false;
  EXPECT_EQ(t.serve_position(1, moved, true), ncclSuccess);
  EXPECT_TRUE(moved);
  EXPECT_EQ(t.f.ledger->timings.back(), ce::Transport::Timing::Captured);
  t.f.serving.drop();
  EXPECT_EQ(t.f.ledger->sub_calls, (Strings{"id", "init S 0/2"})) << "kept for the graph";
  t.f.serving.abandon();
  EXPECT_EQ(t.f.ledger->sub_calls, (Strings{"id", "init S 0/2", "abort"}));
}

TEST(Serving, TwoLevelsAbortTheSubCommunicatorWithTheParent) {
  TwoLevels t;
  t.f.serving.abandon();
  EXPECT_EQ(t.f.ledger->sub_calls, (Strings{"id", "init S 0/2", "abort"}));
  t.f.serving.drop();
  EXPECT_EQ(t.f.ledger->sub_calls.size(), 3u) << "an aborted sub-communicator is not destroyed";
}

TEST(BoundSources, ACheckOwedByACallNcclServedIsDueAtThePositionsNextMovedCall) {
  const Plan p(true);
  BoundSources sources;
  sources.reset(p.decision, p.seen, p.layout);
  const size_t at1 = p.layout.offset_by_position[1];
  EXPECT_EQ(sources.slot_of(1), at1);
  EXPECT_EQ(sources.slot_of(0), SIZE_MAX);
  sources.observe(1, 0x20000, 4000, at1);  // its own buffer: nothing owed
  EXPECT_FALSE(sources.changed());
  EXPECT_FALSE(sources.find(1, 0x20000, 4000, at1).verify_now);
  // Served by NCCL from a new buffer (re-homed): the check waits for the next moved call, even
  // one from that same buffer, and is made once.
  sources.observe(1, 0x90000, 4000, at1);
  EXPECT_TRUE(sources.changed());
  const BoundSources::Found next = sources.find(1, 0x90000, 4000, at1);
  EXPECT_TRUE(next.verify_now);
  EXPECT_EQ(next.slot_offset, at1);
  EXPECT_FALSE(sources.find(1, 0x90000, 4000, at1).verify_now);
  sources.clear();
  EXPECT_FALSE(sources.changed());
  EXPECT_TRUE(sources.empty());
}

}  // namespace
}  // namespace magi::rewrite
