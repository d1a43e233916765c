#include "tools/magice-trace/describe.h"

#include <cinttypes>
#include <cstdio>
#include <ctime>

#include "tools/magice-trace/symbols.h"

namespace magi::tool {

std::string root_text(int32_t root_or_peer) {
  return root_or_peer < 0 ? "-" : std::to_string(root_or_peer);
}

std::string redop_text(int32_t redop) {
  return redop < 0 ? "-" : std::string(trace::redop_name(redop));
}

std::string callsite_label(uint64_t callsite) {
  if (callsite == 0) return "-";
  char text[8];
  const uint64_t leading = callsite >> 32;
  for (int i = 7; i >= 0; --i) text[7 - i] = "0123456789abcdef"[leading >> (4 * i) & 0xf];
  return std::string(text, sizeof(text));
}

std::string frame_text(const trace::Trace& trace, const trace::Frame& frame) {
  char offset[24];
  std::snprintf(offset, sizeof(offset), "+0x%" PRIx64, frame.offset);
  if (frame.module == 0) return "?" + std::string(offset);  // no loaded module held the address
  const auto it = trace.modules.find(frame.module);
  if (it == trace.modules.end() || it->second.empty()) {
    char key[24];
    std::snprintf(key, sizeof(key), "[%08" PRIx64 "]", frame.module >> 32);
    return key + std::string(offset);
  }
  const std::string& path = it->second;
  const size_t slash = path.rfind('/');
  return (slash == std::string::npos ? path : path.substr(slash + 1)) + offset;
}

std::string top_frame_text(const trace::Trace& trace, uint64_t callsite) {
  const auto it = trace.callsites.find(callsite);
  if (callsite == 0 || it == trace.callsites.end() || it->second.frames.empty()) return "";
  return frame_line(trace, it->second.frames.front());
}

std::string duration_text(uint64_t ns) {
  char text[32];
  if (ns < 1000) {
    std::snprintf(text, sizeof(text), "%" PRIu64 "ns", ns);
  } else if (ns < 1000000) {
    std::snprintf(text, sizeof(text), "%.1fus", static_cast<double>(ns) / 1e3);
  } else if (ns < 1000000000) {
    std::snprintf(text, sizeof(text), "%.2fms", static_cast<double>(ns) / 1e6);
  } else {
    std::snprintf(text, sizeof(text), "%.2fs", static_cast<double>(ns) / 1e9);
  }
  return text;
}

std::string wall_clock_text(uint64_t realtime_ns) {
  const auto seconds = static_cast<time_t>(realtime_ns / 1000000000u);
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  char date[40];
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M:%S", &utc);
  char text[64];
  std::snprintf(text, sizeof(text), "%s.%03u UTC", date,
                static_cast<unsigned>(realtime_ns / 1000000u % 1000u));
  return text;
}

std::string shape_text(const trace::CallRecord& call) {
  char text[128];
  std::snprintf(text, sizeof(text), "%-13s %-8s %12" PRIu64 "  root %-3s redop %-4s",
                std::string(trace::op_name(static_cast<trace::Op>(call.op))).c_str(),
                std::string(trace::dtype_name(call.dtype)).c_str(), call.count,
                root_text(call.root_or_peer).c_str(), redop_text(call.redop).c_str());
  return text;
}

}  // namespace magi::tool
