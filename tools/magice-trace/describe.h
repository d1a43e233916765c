// Text for the things a trace holds, shared by the verbs so every table reads alike.
#pragma once

#include <cstdint>
#include <string>

#include "capture/trace_reader.h"

namespace magi::tool {

// "-" for -1 (no root, peer or reduction), else the value or name.
std::string root_text(int32_t root_or_peer);
std::string redop_text(int32_t redop);
// The leading 32 bits as 8 hex digits; "-" when call sites were off (0).
std::string callsite_label(uint64_t callsite);
// "libfoo.so+0x1a2b": the module's file name and the offset; an unnamed module shows its key.
// The raw form: frame_line (symbols.h) names the frame where it can.
std::string frame_text(const trace::Trace& trace, const trace::Frame& frame);
// The call site's first frame above the library (frame_line), or "" when the trace has none.
std::string top_frame_text(const trace::Trace& trace, uint64_t callsite);
// "850ns", "12.3us", "4.56ms", "1.20s".
std::string duration_text(uint64_t ns);
// "2024-05-01 12:34:56.789 UTC".
std::string wall_clock_text(uint64_t realtime_ns);
// "AllReduce     float32    1048576  root -   redop sum ": op, datatype, count, root, reduction.
std::string shape_text(const trace::CallRecord& call);

}  // namespace magi::tool
