#include "rewrite/set_up.h"

#include <exception>
#include <mutex>
#include <new>
#include <utility>

#include "base/base.h"
#include "base/free_later.h"

namespace magi::rewrite {
namespace {

std::mutex g_orphans_mutex;
FreeLater<std::unique_ptr<SetUpJob>>* g_orphans = nullptr;  // under g_orphans_mutex

// An orphan that has finished: joined, and its transport released if its thread did not (it
// finished before it saw that it was orphaned).
void finish_orphan(std::unique_ptr<SetUpJob> job) {
  std::unique_ptr<ce::Transport> transport = job->take();
  if (!transport) return;
  try {
    transport->release();
  } catch (const std::exception&) {  // leaves what it could not free; nothing to tell
  }
}

}  // namespace

std::unique_ptr<SetUpJob> SetUpJob::start(std::unique_ptr<ce::Transport> transport, Work work,
                                          std::chrono::milliseconds delay) {
  std::unique_ptr<SetUpJob> job(new SetUpJob());
  job->transport_ = std::move(transport);
  job->thread_ = std::thread(&SetUpJob::run, job.get(), std::move(work), delay);
  return job;
}

std::unique_ptr<SetUpJob> SetUpJob::prepare(std::unique_ptr<ce::Transport> transport,
                                            ce::WindowPlan plan, std::chrono::milliseconds delay) {
  std::unique_ptr<SetUpJob> job = start(
      std::move(transport),
      [plan = std::move(plan)](ce::Transport& t, ce::HandleBlob& handle) {
        t.prepare(plan, handle);
      },
      delay);
  job->prepares_ = true;  // read only by whoever takes the job, after it is done
  return job;
}

std::unique_ptr<SetUpJob> SetUpJob::attach(std::unique_ptr<ce::Transport> transport,
                                           std::vector<ce::HandleBlob> handles,
                                           std::vector<ce::SourceTable> tables,
                                           std::chrono::milliseconds delay,
                                           std::function<void()> first) {
  return start(
      std::move(transport),
      [handles = std::move(handles), tables = std::move(tables), first = std::move(first)](
          ce::Transport& t, ce::HandleBlob&) {
        std::exception_ptr failed;
        if (first) {
          try {
            first();
          } catch (...) {
            failed = std::current_exception();
          }
        }
        t.attach(handles, tables);
        if (failed) std::rethrow_exception(failed);
      },
      delay);
}

void SetUpJob::run(Work work, std::chrono::milliseconds delay) noexcept {
  State done = State::Done;
  const auto began = std::chrono::steady_clock::now();
  try {
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    ce::pace_mappings_on_this_thread(true);
    work(*transport_, handle_);
  } catch (const std::exception& e) {
    error_ = e.what();
    done = State::Failed;
  } catch (...) {
    error_ = "an unknown exception";
    done = State::Failed;
  }
  took_ns_ = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - began)
          .count());
  if (orphaned_.load(std::memory_order_acquire)) {
    // Nobody takes it: released here, off every program call.
    try {
      transport_->release();
    } catch (const std::exception&) {  // leaves what it could not free; nothing to tell
    }
    transport_.reset();
  }
  state_.store(done, std::memory_order_release);
}

SetUpJob::~SetUpJob() {
  if (thread_.joinable()) thread_.join();
}

std::unique_ptr<ce::Transport> SetUpJob::take() {
  if (thread_.joinable()) thread_.join();
  return std::move(transport_);
}

void orphan(std::unique_ptr<SetUpJob> job) {
  if (!job) return;
  job->orphaned_.store(true, std::memory_order_release);
  // Finished: released here (its thread is done with it). Otherwise its thread releases it
  // once it finishes, or, if it finished before it saw the flag, whoever joins it.
  if (job->state() != SetUpJob::State::Running) {
    finish_orphan(std::move(job));
    return;
  }
  std::lock_guard<std::mutex> lock(g_orphans_mutex);
  if (g_orphans == nullptr) g_orphans = new FreeLater<std::unique_ptr<SetUpJob>>();
  g_orphans->add(std::move(job));
}

void reap_orphans() {
  std::vector<std::unique_ptr<SetUpJob>> done;
  {
    std::lock_guard<std::mutex> lock(g_orphans_mutex);
    if (g_orphans == nullptr) return;
    g_orphans->free_ready(
        [](const std::unique_ptr<SetUpJob>& job) {
          return job->state() != SetUpJob::State::Running;
        },
        [&](std::unique_ptr<SetUpJob> job) { done.push_back(std::move(job)); });
  }
  // Outside the lock; each thread has finished already.
  for (auto& job : done) finish_orphan(std::move(job));
}

void join_orphans() {
  std::vector<std::unique_ptr<SetUpJob>> all;
  {
    std::lock_guard<std::mutex> lock(g_orphans_mutex);
    if (g_orphans == nullptr) return;
    all = g_orphans->take_all();
  }
  for (auto& job : all) finish_orphan(std::move(job));  // joins each thread
}

void forget_orphans_in_child() {
  // Their threads are the parent's: joining here would fail. Set aside, reachable, never freed.
  // Another thread of the parent may have held the lock at fork(): the child, alone now, starts
  // with a lock of its own.
  static FreeLater<std::unique_ptr<SetUpJob>>* parents = nullptr;  // kept reachable
  if (g_orphans != nullptr && parents == nullptr) parents = g_orphans;
  g_orphans = nullptr;
  new (&g_orphans_mutex) std::mutex();
}

}  // namespace magi::rewrite
