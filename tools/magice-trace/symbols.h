// Names for call-site frames, found offline in the binaries on this machine (elfutils' libdwfl).
//
// A frame is (module key, offset from the module's load base); the trace's Module records give
// the path each module was loaded from and its GNU build-id. When that file exists here, and its
// build-id matches the recorded one (where one was recorded), a frame reads
// "function (file.cc:123)" with debug info, "function (libfoo.so+0x1a2b)" with symbols alone;
// otherwise it keeps the raw "libfoo.so+0x1a2b". Nothing here runs in the library.
#pragma once

#include <string>

#include "capture/trace_reader.h"

namespace magi::tool {

// On by default; `--no-symbols` on any verb turns it off (main.cc), before any frame is named.
void set_symbols_enabled(bool enabled);
bool symbols_enabled();

// One frame as a line: named when the module's binary is here, module+0xoffset otherwise.
std::string frame_line(const trace::Trace& trace, const trace::Frame& frame);

// "train.py:42 in step": a Python frame (MAGI_PY_CALLSITES=1), its file path as recorded.
std::string python_frame_line(const trace::PyFrameText& frame);
// The call's innermost Python frame outside torch, or "" when the trace has none for it (the
// option was off, or the call was made without the GIL: see capture/py_callsite.h).
std::string python_line(const trace::Trace& trace, const trace::CallRecord& call);
// What a person reads to find the call: its Python line if it has one, else its first native
// frame (frame_line), else "".
std::string call_site_line(const trace::Trace& trace, const trace::CallRecord& call);

}  // namespace magi::tool
