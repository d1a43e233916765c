#include "rewrite/group_flush.h"

namespace magi::rewrite {

EarlyLaunches& early_launches() {
  thread_local EarlyLaunches early;
  return early;
}

bool GroupFlush::before(const GroupView& group) {
  const bool flush = group.depth > 0 && launches_now(group);
  if (group.depth > 0 && !flush && !told_point_to_point_group_) {
    // Said once, so that a hang there can be traced to this.
    told_point_to_point_group_ = true;
    MAGI_WARN(Rewrite,
              "comm %012llx: an agreement round was issued inside a group holding "
              "Send/Recv, which cannot be launched in two parts; if other ranks do not group these "
              "calls alike, NCCL may order the round differently there (MAGI_TRANSPORT=nccl turns "
              "rounds off)",
              short_id(comm_identity_));
  }
  if (!flush) return false;
  EarlyLaunches& early = early_launches();
  early.calls = group.calls - 1;  // all but the anchor's call, which goes after the round
  for (int i = 0; i < group.depth; ++i) {
    // A failure, or ncclInProgress from a non-blocking communicator in the group, is the
    // program's: it gets it from its own ncclGroupEnd.
    const ncclResult_t ended = nccl_.group_end();
    if (ended != ncclSuccess && early.error == ncclSuccess) early.error = ended;
  }
  return true;
}

void GroupFlush::after(const GroupView& group) {
  for (int i = 0; i < group.depth; ++i) nccl_.group_start();
}

}  // namespace magi::rewrite
