// Python call sites: the innermost Python frames outside torch of the thread making an NCCL
// call (MAGI_PY_CALLSITES=1). In a Python program every native call site is the same few frames
// in libtorch and the interpreter; the Python line is the one a person needs.
//
// Through CPython's C API, resolved with dlsym at the first call that asks (never at load time):
// nothing when the process has no interpreter, none of at least 3.9, or when the calling thread
// does not hold the GIL (PyGILState_Check): PyTorch's ProcessGroupNCCL issues most collectives
// from C++ with the GIL released, and then no Python frame can be read safely. Such calls carry
// no Python call site; their native call site is still recorded.
#pragma once

#include <cstdint>

#include "capture/trace_writer.h"

namespace magi::capture {

// IfHeld (MAGI_PY_CALLSITES=1): read frames only when the caller holds the GIL.
// Take (MAGI_PY_CALLSITES=2): a Python thread that released the GIL (PyTorch's bindings do,
// before ProcessGroupNCCL calls NCCL) takes it back for the walk (PyGILState_Ensure). That waits
// for whichever thread holds the GIL, up to the interpreter's switch interval, and would hang if
// that thread waited on a lock the caller holds: for debugging runs, never the default.
// Threads Python never ran on (ProcessGroupNCCL's own) have no frames and cost one TLS read.
enum class PythonGil { IfHeld, Take };

// The calling thread's Python call site as a fingerprint (0: none, see above). A fingerprint
// seen for the first time is described in a PyCallsite record to `writer` (the trace, if not
// null) and, when `recorder`, to the flight recorder's file: each keeps its own set of the
// fingerprints it has described.
uint64_t python_callsite(TraceWriter* writer, bool recorder, PythonGil gil = PythonGil::IfHeld);

// In a child after fork(): no fingerprint is described yet in the files the child writes.
void python_callsites_forget_in_child();

}  // namespace magi::capture
