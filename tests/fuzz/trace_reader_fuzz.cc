// libFuzzer target: the trace reader takes any bytes. A malformed file must end in one
// TraceFormatError that names the file and an offset inside it; nothing else may escape, and
// nothing may crash or read out of bounds (ASan, UBSan). What it does accept must be what the
// file holds: written out again with the tests' trace builder, it reads back the same.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "capture/trace_reader.h"
#include "tests/support/trace_builder.h"

namespace {

using namespace magi::trace;

constexpr const char* kName = "fuzz-input.trace";

[[noreturn]] void broken(const char* what, uint64_t value = 0) {
  std::fprintf(stderr, "trace reader broke its promise: %s (%llu)\n", what,
               static_cast<unsigned long long>(value));
  std::abort();
}

template <class Record>
bool same(const std::vector<Record>& a, const std::vector<Record>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(Record)) == 0);
}

bool same_frames(const std::vector<Frame>& a, const std::vector<Frame>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(Frame)) == 0);
}

// Writes what was decoded as a fresh file: records grouped by type, the drops summed in one
// record, the unknown ones as records of an unknown type.
std::string rewritten(const Trace& t) {
  FileHeader header = t.header;
  header.header_bytes = sizeof(FileHeader);
  testing::TraceBuilder b(header);
  for (const CommRecord& r : t.comms) b.comm(r);
  for (const CallRecord& r : t.calls) b.call(r);
  for (const CommEndRecord& r : t.comm_ends) b.comm_end(r);
  for (const StepRecord& r : t.steps) b.step(r);
  for (const AgreementRecord& r : t.agreements) b.agreement(r);
  for (const DecisionRecord& r : t.decisions) b.decision(r);
  for (const auto& [key, entry] : t.callsites) b.callsite(key, entry.frames);
  for (const auto& [key, name] : t.modules) b.module(key, name);
  if (t.dropped != 0) b.dropped(t.dropped);
  for (uint64_t i = 0; i < t.unknown_records; ++i) b.record(0xffff, nullptr, 0);
  return b.bytes();
}

void check_decoded(const Trace& t, size_t size) {
  if (t.path != kName) broken("trace not named after its input");
  if (size < sizeof(FileHeader)) broken("parsed without a whole header", size);
  const uint64_t records = t.comms.size() + t.comm_ends.size() + t.calls.size() + t.steps.size() +
                           t.agreements.size() + t.decisions.size() + t.callsites.size() +
                           t.modules.size() + t.unknown_records;
  if (records * sizeof(RecordHeader) > size) broken("more records than bytes allow", records);

  const Trace again = parse_trace(kName, rewritten(t));
  FileHeader expected = t.header;
  expected.header_bytes = sizeof(FileHeader);
  if (std::memcmp(&expected, &again.header, sizeof(FileHeader)) != 0) broken("header changed");
  if (!same(t.comms, again.comms)) broken("Comm records changed");
  if (!same(t.calls, again.calls)) broken("Call records changed");
  if (!same(t.comm_ends, again.comm_ends)) broken("CommEnd records changed");
  if (!same(t.steps, again.steps)) broken("Step records changed");
  if (!same(t.agreements, again.agreements)) broken("Agreement records changed");
  if (!same(t.decisions, again.decisions)) broken("Decision records changed");
  if (t.dropped != again.dropped) broken("dropped count changed", t.dropped);
  if (t.unknown_records != again.unknown_records) broken("unknown count changed");
  if (t.modules != again.modules) broken("module names changed");
  if (t.callsites.size() != again.callsites.size()) broken("callsites changed");
  for (const auto& [key, entry] : t.callsites) {
    const auto it = again.callsites.find(key);
    if (it == again.callsites.end() || !same_frames(entry.frames, it->second.frames))
      broken("callsite frames changed", key);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  Trace decoded;
  try {
    decoded = parse_trace(kName, bytes);
  } catch (const TraceFormatError& e) {
    if (e.file() != kName) broken("error names another file");
    if (e.offset() > size) broken("error offset past the end", e.offset());
    return 0;
  }
  check_decoded(decoded, size);  // a rewritten trace that fails to parse escapes: a finding
  return 0;
}
