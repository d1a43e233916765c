// Builds trace files byte for byte as capture/trace_format.h lays them out, so tests of the
// reader and of magice-trace control every field, including broken ones.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "capture/trace_format.h"

namespace magi::trace::testing {

inline FileHeader make_file_header(uint64_t pid = 4242, std::string_view host = "node0",
                                   std::string_view program = "workload",
                                   uint64_t start_monotonic_ns = 5'000'000'000ull,
                                   uint64_t start_realtime_ns = 1'700'000'000'000'000'000ull) {
  FileHeader header{};
  std::memcpy(header.magic, kMagic, sizeof(header.magic));
  header.version = kVersion;
  header.header_bytes = sizeof(FileHeader);
  header.pid = pid;
  header.start_monotonic_ns = start_monotonic_ns;
  header.start_realtime_ns = start_realtime_ns;
  std::memcpy(header.host, host.data(), std::min(host.size(), sizeof(header.host) - 1));
  std::memcpy(header.program, program.data(), std::min(program.size(), sizeof(header.program) - 1));
  return header;
}

// A stand-in for the library's shape key: any hash of the same fields serves, since only
// equality between ranks matters to the reader and the tool.
inline uint64_t shape_of(Op op, uint8_t dtype, uint64_t count, int32_t root_or_peer,
                         int32_t redop) {
  const struct {
    uint64_t count;
    int32_t root_or_peer, redop;
    uint8_t op, dtype, pad[6];
  } fields{count, root_or_peer, redop, static_cast<uint8_t>(op), dtype, {}};
  return XXH3_64bits(&fields, sizeof(fields));
}

struct CallSpec {
  Op op = Op::AllReduce;
  uint8_t dtype = 7;  // ncclFloat32
  uint64_t count = 1024;
  int32_t root_or_peer = -1;
  int32_t redop = -1;
  uint64_t callsite = 0;
};

inline CallRecord make_call(uint64_t comm_id, int32_t rank, uint64_t seq, const CallSpec& spec,
                            uint64_t time_ns = 0, uint32_t duration_ns = 1000) {
  CallRecord call{};
  call.comm_id = comm_id;
  call.seq = seq;
  call.time_ns = time_ns;
  call.shape = shape_of(spec.op, spec.dtype, spec.count, spec.root_or_peer, spec.redop);
  call.callsite = spec.callsite;
  call.fingerprint = XXH3_64bits_withSeed(&call.shape, sizeof(call.shape), spec.callsite);
  call.count = spec.count;
  call.duration_ns = duration_ns;
  call.thread = 77;
  call.root_or_peer = spec.root_or_peer;
  call.redop = spec.redop;
  call.op = static_cast<uint8_t>(spec.op);
  call.dtype = spec.dtype;
  call.rank = rank;
  return call;
}

inline CommRecord make_comm(uint64_t comm_id, int32_t rank, int32_t nranks,
                            CommOrigin origin = CommOrigin::InitRank, uint64_t parent_id = 0,
                            uint64_t time_ns = 0) {
  CommRecord comm{};
  comm.comm_id = comm_id;
  comm.parent_id = parent_id;
  comm.handle = 0x5500 + static_cast<uint64_t>(rank);
  comm.time_ns = time_ns;
  comm.rank = rank;
  comm.nranks = nranks;
  comm.cuda_device = rank;
  comm.origin = static_cast<uint8_t>(origin);
  return comm;
}

// One event of an agreement round, as rewrite/ records it.
struct AgreementSpec {
  uint32_t round = 1;
  RoundKind kind = RoundKind::Propose;
  RoundEvent event = RoundEvent::Read;
  uint64_t seq = 0;  // collective index of the event
  AgreementMode mode = AgreementMode::None;
  uint32_t gathers = 0;
  uint32_t moved = 0;
  Reason reason = Reason::None;
  uint32_t period = 3;
  uint64_t step_digest = 0xd16e57;
};

inline AgreementRecord make_agreement(uint64_t comm_id, int32_t rank, const AgreementSpec& spec) {
  AgreementRecord r{};
  r.comm_id = comm_id;
  r.seq = spec.seq;
  r.step_digest = spec.step_digest;
  r.round = spec.round;
  r.period = spec.period;
  r.gathers = spec.gathers;
  r.moved = spec.moved;
  r.rank = rank;
  r.kind = static_cast<uint8_t>(spec.kind);
  r.event = static_cast<uint8_t>(spec.event);
  r.mode = static_cast<uint8_t>(spec.mode);
  r.reason = static_cast<uint8_t>(spec.reason);
  return r;
}

// What one propose round decided for one gather of the step.
struct DecisionSpec {
  uint32_t position = 0;  // in the step
  Verdict verdict = Verdict::Moved;
  Reason reason = Reason::None;
  int32_t refused_by = -1;
  uint16_t bucket = 0;
  uint8_t dtype = 7;  // ncclFloat32
  uint64_t count = 1024;
  uint64_t callsite = 0;
};

inline DecisionRecord make_decision(uint64_t comm_id, int32_t rank, uint32_t round,
                                    AgreementMode mode, const DecisionSpec& spec) {
  DecisionRecord r{};
  r.comm_id = comm_id;
  r.callsite = spec.callsite;
  r.count = spec.count;
  r.round = round;
  r.position = spec.position;
  r.rank = rank;
  r.refused_by = spec.refused_by;
  r.bucket = spec.bucket;
  r.dtype = spec.dtype;
  r.verdict = static_cast<uint8_t>(spec.verdict);
  r.reason = static_cast<uint8_t>(spec.reason);
  r.mode = static_cast<uint8_t>(mode);
  return r;
}

class TraceBuilder {
 public:
  explicit TraceBuilder(const FileHeader& header = make_file_header()) {
    bytes_.append(reinterpret_cast<const char*>(&header), sizeof(header));
  }

  // Any record: header, payload, then zero padding to a multiple of 8.
  TraceBuilder& record(uint16_t type, const void* payload, size_t payload_bytes,
                       const void* tail = nullptr, size_t tail_bytes = 0) {
    const auto bytes =
        padded(static_cast<uint32_t>(sizeof(RecordHeader) + payload_bytes + tail_bytes));
    const RecordHeader header{type, 0, bytes};
    const size_t at = bytes_.size();
    bytes_.append(reinterpret_cast<const char*>(&header), sizeof(header));
    bytes_.append(static_cast<const char*>(payload), payload_bytes);
    if (tail_bytes != 0) bytes_.append(static_cast<const char*>(tail), tail_bytes);
    bytes_.resize(at + bytes, '\0');
    return *this;
  }

  TraceBuilder& comm(const CommRecord& r) { return typed(RecordType::Comm, r); }
  TraceBuilder& call(const CallRecord& r) { return typed(RecordType::Call, r); }
  TraceBuilder& comm_end(const CommEndRecord& r) { return typed(RecordType::CommEnd, r); }
  TraceBuilder& step(const StepRecord& r) { return typed(RecordType::Step, r); }
  TraceBuilder& agreement(const AgreementRecord& r) { return typed(RecordType::Agreement, r); }
  TraceBuilder& decision(const DecisionRecord& r) { return typed(RecordType::Decision, r); }
  TraceBuilder& window(const WindowRecord& r) { return typed(RecordType::Window, r); }
  TraceBuilder& window_refusal(WindowRefusalRecord r, std::string_view why) {
    r.text_bytes = static_cast<uint32_t>(why.size());
    return record(static_cast<uint16_t>(RecordType::WindowRefusal), &r, sizeof(r), why.data(),
                  why.size());
  }
  TraceBuilder& dropped(uint64_t records) {
    return typed(RecordType::Dropped, DroppedRecord{records});
  }
  TraceBuilder& callsite(uint64_t key, std::span<const Frame> frames) {
    const CallsiteRecord r{key, static_cast<uint32_t>(frames.size()), 0};
    return record(static_cast<uint16_t>(RecordType::Callsite), &r, sizeof(r), frames.data(),
                  frames.size_bytes());
  }
  TraceBuilder& module(uint64_t key, std::string_view name, std::string_view build_id = {}) {
    const ModuleRecord r{key, static_cast<uint32_t>(name.size()),
                         static_cast<uint32_t>(build_id.size())};
    const std::string tail = std::string(name) + std::string(build_id);
    return record(static_cast<uint16_t>(RecordType::Module), &r, sizeof(r), tail.data(),
                  tail.size());
  }
  struct PyFrameSpec {
    std::string file;
    std::string function;
    int32_t line;
  };
  TraceBuilder& py_callsite(uint64_t key, const std::vector<PyFrameSpec>& frames) {
    std::string tail(frames.size() * sizeof(PyFrameEntry), '\0');
    for (size_t i = 0; i < frames.size(); ++i) {
      const PyFrameEntry entry{frames[i].line, static_cast<uint16_t>(frames[i].file.size()),
                               static_cast<uint16_t>(frames[i].function.size())};
      std::memcpy(tail.data() + i * sizeof(entry), &entry, sizeof(entry));
    }
    for (const PyFrameSpec& f : frames) tail += f.file + f.function;
    const PyCallsiteRecord r{
        key, static_cast<uint32_t>(frames.size()),
        static_cast<uint32_t>(tail.size() - frames.size() * sizeof(PyFrameEntry))};
    return record(static_cast<uint16_t>(RecordType::PyCallsite), &r, sizeof(r), tail.data(),
                  tail.size());
  }
  TraceBuilder& py_call(const PyCallRecord& r) { return typed(RecordType::PyCall, r); }
  TraceBuilder& group_served(const GroupServedRecord& r) {
    return typed(RecordType::GroupServed, r);
  }
  // Bytes appended as they are: for damaged files.
  TraceBuilder& raw(std::string_view bytes) {
    bytes_.append(bytes);
    return *this;
  }

  const std::string& bytes() const { return bytes_; }
  std::string& mutable_bytes() { return bytes_; }

  void write(const std::string& path) const {
    FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) throw std::runtime_error("cannot create " + path);
    const bool ok = std::fwrite(bytes_.data(), 1, bytes_.size(), f) == bytes_.size();
    if (std::fclose(f) != 0 || !ok) throw std::runtime_error("cannot write " + path);
  }

 private:
  template <class T>
  TraceBuilder& typed(RecordType type, const T& r) {
    return record(static_cast<uint16_t>(type), &r, sizeof(r));
  }

  std::string bytes_;
};

}  // namespace magi::trace::testing
