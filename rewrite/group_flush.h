// Issuing an agreement round's all-gather outside the program's open group.
//
// NCCL runs the collectives of one group largest first. A round issued inside the program's open
// group would run after the group's larger collectives on this rank, and before them on a rank
// that issued the same collectives ungrouped: the ranks would meet different collectives and
// hang. So the group so far is launched first, the round goes alone, and the group is opened
// again to the same depth: on every rank the round then runs between the same collectives. Not
// with a Send or Recv in the group, whose halves must launch together: the round then sits inside
// the group, which is safe where every rank groups these calls alike (NCCL orders identical
// groups identically), and said once per communicator.
#pragma once

#include <nccl.h>

#include <cstdint>

#include "rewrite/world.h"

namespace magi::rewrite {

// What the early launches of the program's open group left for that group's end: the first
// error they met, which the program gets from rewrite::group_ended, and how many of the group's
// calls they launched, which ncclGroupSimulateEnd reports. Per thread, as NCCL's groups are.
struct EarlyLaunches {
  ncclResult_t error = ncclSuccess;
  uint32_t calls = 0;
};
EarlyLaunches& early_launches();

class GroupFlush {
 public:
  GroupFlush(const RealNcclCalls& nccl, uint64_t comm_identity)
      : nccl_(nccl), comm_identity_(comm_identity) {}

  // Whether a collective issued now launches at once: outside any group, or alone out of a
  // group that can be launched in two parts.
  static bool launches_now(const GroupView& group) {
    return group.depth == 0 || !group.holds_point_to_point;
  }
  // Runs `launch` (which issues one collective through the real NCCL) outside the calling
  // thread's open group `group`, where it can; returns what `launch` returned.
  template <class Launch>
  ncclResult_t issue_alone(const GroupView& group, Launch&& launch) {
    const bool flush = before(group);
    const ncclResult_t result = launch();
    if (flush) after(group);
    return result;
  }

 private:
  bool before(const GroupView& group);  // true when the group was launched (and must reopen)
  void after(const GroupView& group);

  const RealNcclCalls& nccl_;
  const uint64_t comm_identity_;
  bool told_point_to_point_group_ = false;  // the warning, once
};

}  // namespace magi::rewrite
