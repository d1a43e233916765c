// What happens to every communicator when the process exits or forks, in one place, in order.
// (Destroy, abort, finalize and revoke of one communicator are in shim/exports.cc, in the same
// order: end it in the trace, flush the trace, then release its windows — after NCCL's abort,
// for an abort, whose kernels may still read them.)
//
// At exit:
//   0. the flight recorder's completion poller makes its last pass and stops (it may be inside
//      the driver: it must be done before CUDA's exit handlers, which run after this one);
// then, for the communicators the program never destroyed:
//   1. end them: each gets its CommEnd record (ProcessExit);
//   2. flush the trace, so the records are on disk before anything below can be slow;
//   3. release their windows (shared-memory names unlinked, device memory freed; a window a peer
//      may still read is left allocated, with one warning, rather than waited for), and wait for
//      the set-ups of dropped plans still mapping peers' memory on threads of their own;
//   4. close the trace.
// In a child after fork(): nothing of the parent's is usable (NCCL and CUDA do not survive fork),
// and nothing of it may be released from the child either (that would unlink the parent's
// shared-memory names): the records, the calling thread's queued gathers and the trace writer are
// set aside, reachable, never used; the child starts with no communicator and opens a trace of
// its own at its first record.
//
// One atexit and one pthread_atfork handler, armed when the first communicator is recorded
// (nothing of ours runs at load time).
#include <pthread.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "base/base.h"
#include "capture/capture.h"
#include "rewrite/rewrite.h"
#include "shim/communicators.h"

namespace magi::shim {
namespace {

void at_exit() {
  guarded("process exit", [] {
    capture::stop_completion();
    std::vector<CommRef> live = registry::take_all();
    for (const CommRef& record : live)
      capture::comm_ended(record->capture, capture::CommEndKind::ProcessExit);
    capture::flush_trace();
    live.clear();  // releases the windows; a record a call in flight holds goes with that call
    rewrite::finish_set_ups();
    capture::close_trace();
  });
}

void in_child() {
  registry::forget_in_child();
  rewrite::forget_in_child();
  capture::forget_trace_in_child();
}

}  // namespace

void arm_lifecycle() {
  static std::once_flag armed;
  std::call_once(armed, [] {
    std::atexit(at_exit);
    pthread_atfork(nullptr, nullptr, in_child);
  });
}

}  // namespace magi::shim
