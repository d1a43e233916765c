// MAGI_DUMP_SIGNAL=USR1|USR2: on that signal the trace is written out and the flight recorder
// synced, while the program runs on — so a user can ask a live, hung job what it did.
//
// The handler only writes one byte to a pipe (async-signal-safe); a thread of ours blocked on the
// pipe does the flush, which takes locks a handler must never take. Armed at the first
// communicator, never at load time; the program's own handler for the signal, if it had one, is
// called after ours.
#pragma once

namespace magi::capture {

void arm_dump_signal();

}  // namespace magi::capture
