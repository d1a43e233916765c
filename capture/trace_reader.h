// Reads trace files (capture/trace_format.h). Malformed or truncated input raises
// TraceFormatError naming the file and the byte offset; it never crashes or reads past the end.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "capture/trace_format.h"

namespace magi::trace {

class TraceFormatError : public std::runtime_error {
 public:
  TraceFormatError(const std::string& file, uint64_t offset, const std::string& what);
  const std::string& file() const { return file_; }
  uint64_t offset() const { return offset_; }

 private:
  std::string file_;
  uint64_t offset_;
};

struct CallsiteFrames {
  std::vector<Frame> frames;
};

struct PyFrameText {
  std::string file;
  std::string function;
  int32_t line = 0;
};

// Everything one trace file holds, decoded.
struct Trace {
  std::string path;
  FileHeader header{};
  std::vector<CommRecord> comms;
  std::vector<CommEndRecord> comm_ends;
  std::vector<CallRecord> calls;  // in file order; sort by (comm_id, seq) if needed
  std::vector<StepRecord> steps;
  std::vector<AgreementRecord> agreements;  // in file order
  std::vector<DecisionRecord> decisions;    // in file order
  std::vector<WindowRecord> windows;        // in file order
  // Why shards were bound, one per reason per plan window, in file order.
  struct WindowRefusal {
    WindowRefusalRecord record;
    std::string why;
  };
  std::vector<WindowRefusal> window_refusals;
  std::unordered_map<uint64_t, CallsiteFrames> callsites;
  std::unordered_map<uint64_t, std::string> modules;  // the path (older traces: the file name)
  std::unordered_map<uint64_t, std::string> module_build_ids;  // raw bytes, where recorded
  // Python call sites (MAGI_PY_CALLSITES=1): frames by fingerprint, innermost first, and the
  // fingerprint of each call that had one, by (comm_id, seq, rank).
  std::unordered_map<uint64_t, std::vector<PyFrameText>> py_callsites;
  std::map<std::tuple<uint64_t, uint64_t, int32_t>, uint64_t> py_calls;
  uint64_t dropped = 0;
  uint64_t unknown_records = 0;  // types this reader does not know, skipped
};

Trace read_trace(const std::string& path);
Trace parse_trace(const std::string& name, const std::string& bytes);
// Records alone, with no file header (a flight recorder's kSites segment), added to `into`.
void parse_records(const std::string& name, const std::string& bytes, Trace& into);

}  // namespace magi::trace
