// NCCL group semantics, per thread: between ncclGroupStart and the outermost ncclGroupEnd
// operations are only queued; GroupEnd launches them in call order and drives them all
// round-robin until each is done. A call outside a group is a group of one.
#pragma once

#include <nccl.h>

#include <memory>
#include <vector>

#include "tests/support/standin/operation.h"

namespace standin {

void group_start();
bool group_open();  // the calling thread is inside ncclGroupStart/End
ncclResult_t group_end();
// Ends the group like group_end but runs nothing: the queued operations are dropped.
ncclResult_t group_simulate_end();

// Queues `op` inside a group; otherwise runs it to completion now.
ncclResult_t submit(std::unique_ptr<Operation> op);

// Launches `ops` in order and drives them until each is done, on the calling thread, outside any
// group (a CUDA graph's replay runs its operations so). The first failure's code; its message
// is the thread's last error.
ncclResult_t run_operations(std::vector<std::unique_ptr<Operation>>& ops);

}  // namespace standin
