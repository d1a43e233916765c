// NCCL group semantics, per thread: between ncclGroupStart and the outermost ncclGroupEnd
// operations are only queued; GroupEnd launches them in call order and drives them all
// round-robin until each is done. A call outside a group is a group of one.
#pragma once

#include <nccl.h>

#include <memory>

#include "tests/support/standin/operation.h"

namespace standin {

void group_start();
ncclResult_t group_end();
// Ends the group like group_end but runs nothing: the queued operations are dropped.
ncclResult_t group_simulate_end();

// Queues `op` inside a group; otherwise runs it to completion now.
ncclResult_t submit(std::unique_ptr<Operation> op);

}  // namespace standin
