// Streams records to this process's trace file without ever blocking the call path.
//
// Two buffers of MAGI_TRACE_BUFFER_KIB: callers copy records into the active one under a
// spinlock held for one memcpy; a full buffer is swapped with the spare and handed to a writer
// thread. If the writer still holds the spare (the disk is slower than the calls), the record
// is dropped and counted (a Dropped record says how many), never waited for. A write error (a
// full disk, say) gives one WARN and turns tracing off; the program goes on.
#pragma once

#include <cstdint>

#include "capture/trace_format.h"

namespace magi::capture {

class TraceWriter;

// The process's writer, or nullptr when MAGI_TRACE_DIR is unset or the file could not be made.
// Opens the file on first use; after fork() the child opens a file of its own.
TraceWriter* trace_writer();

void trace_append(TraceWriter* writer, trace::RecordType type, const void* payload,
                  uint32_t payload_bytes, const void* tail = nullptr, uint32_t tail_bytes = 0);

// Hands the active buffer to the writer thread and waits until it is on disk.
void trace_flush(TraceWriter* writer);

// Flushes the process's writer if one is open; never opens one.
void trace_flush_if_open();
// At exit: writes out what is buffered and closes the file; later records are dropped.
void trace_close();
// In a child after fork(): the parent's writer (its thread, its file) is set aside, never used;
// the child opens a file of its own at its first record.
void trace_forget_in_child();

}  // namespace magi::capture
