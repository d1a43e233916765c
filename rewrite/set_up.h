// A plan's set-up off the program's call path, in two parts, each on a thread of its own while
// the program's calls go on through NCCL:
//  - prepare (the owner's side): find and export the allocations holding this rank's shards (a
//    CUDA IPC handle each), make the window, copy the shards that cannot be shared. Hundreds of
//    exports and a device-wide synchronize took 45-65 ms at the publish call on an H200;
//  - attach (the reader's side): open the peers' windows and the allocations they export, a CUDA
//    IPC mapping each (0.06-0.12 ms on an H200, BENCHMARKS.md): a model's 400 allocations on 8
//    ranks, 2,800 mappings, take a third of a second.
// The agreement asks at each step whether every rank is done (CommAgreement's publish and
// confirm, kSettingUp) and goes on at the read where all are.
//
// The transport belongs to the job while it runs: no call of the program touches it. A job whose
// plan is dropped while it runs (the step changed, the communicator ended) is orphaned: it
// finishes on its own thread, releases its transport there, and is joined by a later drop or at
// process exit, so dropping a plan never waits for its set-up.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ce_transport/ce_transport.h"

namespace magi::rewrite {

// A set-up part expected to take longer than this runs off the program's calls; a shorter one (a
// few shared-memory mappings, one window) at the call, which saves the program a step of waiting.
inline constexpr uint64_t kSetUpAtTheCallNs = 1'000'000;

class SetUpJob {
 public:
  enum class State : uint8_t { Running, Done, Failed };

  // Both start on a thread of their own, `delay` first (MAGI_INJECT_FAULT=slow-attach and
  // slow-prepare, for tests), and may throw std::system_error (no thread to be had).
  // Prepares `transport`'s window for `plan` (Transport::prepare); handle() once Done.
  static std::unique_ptr<SetUpJob> prepare(std::unique_ptr<ce::Transport> transport,
                                           ce::WindowPlan plan, std::chrono::milliseconds delay);
  // Attaches `transport` to the peers (`handles`, `tables` by rank). `first`, if any, runs
  // before (a plan spanning machines forms its sub-communicator); the attach runs even when it
  // fails, and its failure is the job's.
  static std::unique_ptr<SetUpJob> attach(std::unique_ptr<ce::Transport> transport,
                                          std::vector<ce::HandleBlob> handles,
                                          std::vector<ce::SourceTable> tables,
                                          std::chrono::milliseconds delay,
                                          std::function<void()> first = {});
  ~SetUpJob();  // joins the thread: only once it is done (or from orphan handling)
  SetUpJob(const SetUpJob&) = delete;
  SetUpJob& operator=(const SetUpJob&) = delete;

  // Never waits.
  State state() const { return state_.load(std::memory_order_acquire); }
  // Once not Running: the transport, attached (Done) or not (Failed), and joins the thread.
  std::unique_ptr<ce::Transport> take();
  // Failed: why.
  const std::string& error() const { return error_; }
  // A prepare job (else nullptr), once Done: the window's handle for the peers.
  const ce::HandleBlob* handle() const { return prepares_ ? &handle_ : nullptr; }
  // Once not Running: how long the set-up took on its thread (not how long until it was asked).
  uint64_t took_ns() const { return took_ns_; }

 private:
  using Work = std::function<void(ce::Transport&, ce::HandleBlob&)>;
  static std::unique_ptr<SetUpJob> start(std::unique_ptr<ce::Transport> transport, Work work,
                                         std::chrono::milliseconds delay);
  SetUpJob() = default;
  void run(Work work, std::chrono::milliseconds delay) noexcept;

  std::unique_ptr<ce::Transport> transport_;
  ce::HandleBlob handle_{};
  bool prepares_ = false;
  std::string error_;
  uint64_t took_ns_ = 0;
  std::atomic<State> state_{State::Running};
  std::atomic<bool> orphaned_{false};
  std::thread thread_;

  friend void orphan(std::unique_ptr<SetUpJob> job);
};

// A job whose plan was dropped: it finishes and releases its transport on its own thread.
void orphan(std::unique_ptr<SetUpJob> job);
// Joins the orphaned jobs that are done (never waits for one that is not).
void reap_orphans();
// Joins every orphaned job (process exit: their threads must not outlive the CUDA runtime).
void join_orphans();
// In a child after fork(): the parent's jobs have no thread here; set aside, never joined.
void forget_orphans_in_child();

}  // namespace magi::rewrite
