// A plan's set-up off the program's calls (rewrite/set_up.h), in one process: the transport is
// the job's while it runs, comes back attached or with the reason it failed, and a job dropped
// while it runs releases its transport on its own thread and is joined later.
#include "rewrite/set_up.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace magi::rewrite {
namespace {

// What became of a fake transport, shared with the test (the transport may outlive its owner).
struct Ledger {
  std::mutex mutex;
  std::condition_variable changed;
  bool go = false;  // attach() returns once the test says so
  int attached = 0, released = 0, destroyed = 0;
  size_t blobs = 0;
  std::thread::id attached_on;
};

class GatedTransport : public ce::Transport {
 public:
  GatedTransport(std::shared_ptr<Ledger> ledger, bool fails) : ledger_(ledger), fails_(fails) {}
  ~GatedTransport() override {
    std::lock_guard<std::mutex> lock(ledger_->mutex);
    ++ledger_->destroyed;
  }
  void prepare(const ce::WindowPlan&, ce::HandleBlob&) override {}
  const ce::SourceTable& sources() const override { return sources_; }
  void attach(std::span<const ce::HandleBlob> blobs, std::span<const ce::SourceTable>) override {
    std::unique_lock<std::mutex> lock(ledger_->mutex);
    ledger_->changed.wait(lock, [&] { return ledger_->go; });
    ledger_->attached_on = std::this_thread::get_id();
    ledger_->blobs = blobs.size();
    if (fails_) throw std::runtime_error("a peer's window cannot be opened");
    ++ledger_->attached;
  }
  Served gather(std::span<const ce::GatherOp>, void*, Timing, ce::PartWriter*) override {
    return Served::Moved;
  }
  void release() override {
    std::lock_guard<std::mutex> lock(ledger_->mutex);
    ++ledger_->released;
  }
  void abandon() override {}
  size_t window_bytes() const override { return 0; }
  ce::WindowMemory memory() const override { return {}; }

 private:
  std::shared_ptr<Ledger> ledger_;
  bool fails_;
  ce::SourceTable sources_;
};

void open_gate(Ledger& ledger) {
  std::lock_guard<std::mutex> lock(ledger.mutex);
  ledger.go = true;
  ledger.changed.notify_all();
}

template <typename Done>
void wait_until(Done done) {
  for (int i = 0; i < 5000 && !done(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(done());
}

TEST(SetUpJob, AttachesOnAThreadOfItsOwnAndHandsTheTransportBack) {
  auto ledger = std::make_shared<Ledger>();
  std::unique_ptr<SetUpJob> job =
      SetUpJob::attach(std::make_unique<GatedTransport>(ledger, false),
                       std::vector<ce::HandleBlob>(3), std::vector<ce::SourceTable>(3), {});
  // Until the attach returns, the job runs and the caller never waits for it.
  EXPECT_EQ(job->state(), SetUpJob::State::Running);
  open_gate(*ledger);
  wait_until([&] { return job->state() != SetUpJob::State::Running; });
  EXPECT_EQ(job->state(), SetUpJob::State::Done);
  std::unique_ptr<ce::Transport> back = job->take();
  ASSERT_NE(back, nullptr);
  EXPECT_EQ(ledger->attached, 1);
  EXPECT_EQ(ledger->blobs, 3u);
  EXPECT_NE(ledger->attached_on, std::this_thread::get_id());
  EXPECT_EQ(ledger->released, 0);  // the caller's now
}

TEST(SetUpJob, AFailedAttachSaysWhyAndStillHandsTheTransportBack) {
  auto ledger = std::make_shared<Ledger>();
  open_gate(*ledger);
  std::unique_ptr<SetUpJob> job =
      SetUpJob::attach(std::make_unique<GatedTransport>(ledger, true),
                       std::vector<ce::HandleBlob>(2), std::vector<ce::SourceTable>(2), {});
  wait_until([&] { return job->state() != SetUpJob::State::Running; });
  EXPECT_EQ(job->state(), SetUpJob::State::Failed);
  EXPECT_EQ(job->error(), "a peer's window cannot be opened");
  EXPECT_NE(job->take(), nullptr);  // for the caller to release, as any unattached window
}

// The plan was dropped while its set-up ran: the caller goes on at once; the job finishes,
// releases and destroys its transport on its own thread, and is joined later.
TEST(SetUpJob, AnOrphanReleasesItsTransportOnItsOwnThreadAndIsJoinedLater) {
  auto ledger = std::make_shared<Ledger>();
  std::unique_ptr<SetUpJob> job =
      SetUpJob::attach(std::make_unique<GatedTransport>(ledger, false),
                       std::vector<ce::HandleBlob>(2), std::vector<ce::SourceTable>(2), {});
  orphan(std::move(job));
  reap_orphans();  // still running: not waited for
  EXPECT_EQ(ledger->released, 0);
  open_gate(*ledger);
  wait_until([&] {
    std::lock_guard<std::mutex> lock(ledger->mutex);
    return ledger->destroyed == 1;
  });
  EXPECT_EQ(ledger->attached, 1);
  EXPECT_EQ(ledger->released, 1);
  join_orphans();
}

TEST(SetUpJob, AnOrphanThatHadFinishedIsReleasedAtOnce) {
  auto ledger = std::make_shared<Ledger>();
  open_gate(*ledger);
  std::unique_ptr<SetUpJob> job =
      SetUpJob::attach(std::make_unique<GatedTransport>(ledger, false),
                       std::vector<ce::HandleBlob>(2), std::vector<ce::SourceTable>(2), {});
  wait_until([&] { return job->state() != SetUpJob::State::Running; });
  orphan(std::move(job));
  EXPECT_EQ(ledger->released, 1);
  EXPECT_EQ(ledger->destroyed, 1);
}

}  // namespace
}  // namespace magi::rewrite
