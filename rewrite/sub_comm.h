// The inter-machine sub-communicator of a plan spanning machines (rewrite/machines.h): the ranks
// (m, l) of every machine m for this rank's local index l, in machine order, on the real NCCL.
//
// Why not ncclCommSplit of the program's communicator: a split is collective over the parent and
// blocks every rank until the child exists, so it could only be issued where every rank issues it
// at the same call, outside the program's open group (as rounds are), with its whole cost on that
// call. Instead the plan's rounds carry it: the first member (machine 0) makes a unique id at the
// publish, the publish takes it to every rank, and every member forms the communicator
// (ncclCommInitRankConfig) in the plan's set-up, on the set-up's thread, off the program's calls
// (rewrite/set_up.h). Its refusal travels in the confirm like any other set-up's: a
// sub-communicator that fails to form on one rank leaves every rank on NCCL.
//
// Never a hang: a rank that fails still joins (only then gives up), so its members' formation
// completes; the formation is non-blocking and polled, and gives up once the plan is dropped or
// the communicator aborted (cancel()), aborting what it began. The communicator ends with the
// plan: destroyed when the plan is dropped or the parent destroyed, aborted when the parent is.
#pragma once

#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "rewrite/rewrite.h"

namespace magi::rewrite {

class SubComm {
 public:
  explicit SubComm(const RealNcclCalls& nccl) : nccl_(nccl) {}
  ~SubComm();
  SubComm(const SubComm&) = delete;
  SubComm& operator=(const SubComm&) = delete;

  // The first member, at the publish: a unique id for the others (ncclUniqueId's bytes). Throws
  // Error.
  std::vector<uint8_t> make_id() const;
  // On the set-up's thread: joins as `rank` of `nranks`. `fail`: MAGI_INJECT_FAULT=subcomm on
  // this rank: it joins, then gives up as a failing NCCL would. Throws Error (failed, cancelled).
  void form(std::span<const uint8_t> id, int nranks, int rank, bool fail);
  // Formed: the communicator; nullptr before. The thread that serves reads it once the set-up
  // is taken back.
  ncclComm_t comm() const { return formed_.load(std::memory_order_acquire) ? comm_ : nullptr; }
  // The plan is dropped (`abort`: the parent is aborted): a formation in progress gives up, and a
  // formed communicator is aborted now (else destroyed when the last holder lets go). Any thread.
  void cancel(bool abort) noexcept;

 private:
  const RealNcclCalls nccl_;
  std::mutex mutex_;
  ncclComm_t comm_ = nullptr;  // under mutex_ until formed
  std::atomic<bool> formed_{false};
  std::atomic<bool> cancelled_{false};
  bool aborted_ = false;  // under mutex_
};

}  // namespace magi::rewrite
