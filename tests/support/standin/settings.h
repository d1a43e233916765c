// The stand-in's knobs, read once from the environment:
//   STANDIN_MISMATCH   block (default): ranks that disagree on a collective hang, as in NCCL;
//                      error: the call fails with ncclInvalidUsage on every rank instead
//   STANDIN_TIMEOUT_S  give up (ncclSystemError) after this many seconds without progress;
//                      0 (default): wait forever
//   STANDIN_SLOT_KIB   per-rank staging slot (default 4096); larger buffers move in chunks
//   STANDIN_SHM_TAG    put this in segment names, so a launcher can find what a killed run left
//   STANDIN_DELAY_US   every group of operations (a lone call is one) takes this much longer:
//                      a slow NCCL, for the shim's cost trial (default 0)
//   STANDIN_GROUP_ORDER issue (default): a group's operations take their places in call order;
//                      size: its collectives largest first, as NCCL's planner runs them (ranks
//                      that group the same collectives differently then meet them in another
//                      order, and hang as they would on NCCL)
//   STANDIN_PINNED_STAGING 1: device buffers are staged in pinned host blocks (cudaMallocHost)
//                      kept from call to call, not in fresh pageable memory each call: several
//                      times faster for gathers of many MiB (a run of GiBs a step); 0 (default)
#pragma once

#include <cstddef>
#include <string>

namespace standin {

enum class MismatchPolicy { Block, Error };

struct Settings {
  MismatchPolicy mismatch = MismatchPolicy::Block;
  double timeout_s = 0;  // 0: wait forever
  size_t slot_bytes = size_t{4096} * 1024;
  std::string shm_tag;
  long delay_us = 0;
  bool group_order_by_size = false;
  bool pinned_staging = false;

  static const Settings& get();
};

}  // namespace standin
