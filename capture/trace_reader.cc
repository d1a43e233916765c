#include "capture/trace_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

namespace magi::trace {

TraceFormatError::TraceFormatError(const std::string& file, uint64_t offset,
                                   const std::string& what)
    : std::runtime_error(file + ": offset " + std::to_string(offset) + ": " + what),
      file_(file),
      offset_(offset) {}

namespace {

// Decodes in place, copying each record out with memcpy: the buffer carries no alignment
// promise, and every bound is checked against what remains before anything is read.
class TraceParser {
 public:
  TraceParser(const std::string& name, const std::string& bytes)
      : name_(name), data_(bytes.data()), size_(bytes.size()) {}

  Trace parse() {
    Trace trace;
    trace.path = name_;
    const uint64_t first_record = read_header(trace.header);
    reserve(trace, first_record);
    for (uint64_t offset = first_record; offset < size_;) {
      offset += read_record(trace, offset);
    }
    return trace;
  }

  void parse_records(Trace& into) {
    for (uint64_t offset = 0; offset < size_;) offset += read_record(into, offset);
  }

 private:
  [[noreturn]] void fail(uint64_t offset, const std::string& what) const {
    throw TraceFormatError(name_, offset, what);
  }

  template <class T>
  T load(uint64_t offset) const {
    T value;
    std::memcpy(&value, data_ + offset, sizeof(T));
    return value;
  }

  [[noreturn]] void truncated_header(uint64_t header_bytes) const {
    fail(0, "truncated file header (" + std::to_string(size_) + " of " +
                std::to_string(header_bytes) + " bytes)");
  }

  uint64_t read_header(FileHeader& header) const {
    if (size_ < sizeof(kMagic) || std::memcmp(data_, kMagic, sizeof(kMagic)) != 0) {
      fail(0, "not a magice trace (bad magic)");
    }
    constexpr uint64_t kVersionOffset = offsetof(FileHeader, version);
    constexpr uint64_t kHeaderBytesOffset = offsetof(FileHeader, header_bytes);
    if (size_ < kVersionOffset + sizeof(uint32_t)) truncated_header(sizeof(FileHeader));
    const auto version = load<uint32_t>(kVersionOffset);
    if (version > kVersion) {
      fail(kVersionOffset, "trace format version " + std::to_string(version) +
                               " is newer than this reader's (" + std::to_string(kVersion) +
                               "); use a newer magice-trace");
    }
    if (version == 0) fail(kVersionOffset, "bad trace format version 0");
    if (size_ < kHeaderBytesOffset + sizeof(uint32_t)) truncated_header(sizeof(FileHeader));
    const auto header_bytes = load<uint32_t>(kHeaderBytesOffset);
    // A later writer may append fields to the header; records still start 8-aligned after it.
    if (header_bytes < sizeof(FileHeader) || header_bytes % 8 != 0) {
      fail(kHeaderBytesOffset, "bad header_bytes " + std::to_string(header_bytes) +
                                   " (expected a multiple of 8, at least " +
                                   std::to_string(sizeof(FileHeader)) + ")");
    }
    if (header_bytes > size_) truncated_header(header_bytes);
    header = load<FileHeader>(0);
    // The strings are printed later; a writer's missing terminator must not run past them.
    header.host[sizeof(header.host) - 1] = '\0';
    header.program[sizeof(header.program) - 1] = '\0';
    return header_bytes;
  }

  // One cheap pass over the record headers sizes the vectors, so a trace of millions of calls
  // is decoded without regrowing them. It stops quietly at the first bad header: the real pass
  // reports it, in file order with every other problem.
  void reserve(Trace& trace, uint64_t offset) const {
    size_t comms = 0, ends = 0, calls = 0, steps = 0, agreements = 0, decisions = 0;
    while (size_ - offset >= sizeof(RecordHeader)) {
      const auto header = load<RecordHeader>(offset);
      if (header.bytes < sizeof(RecordHeader) || header.bytes % 8 != 0 ||
          header.bytes > size_ - offset) {
        break;
      }
      switch (static_cast<RecordType>(header.type)) {
        case RecordType::Comm: ++comms; break;
        case RecordType::CommEnd: ++ends; break;
        case RecordType::Call: ++calls; break;
        case RecordType::Step: ++steps; break;
        case RecordType::Agreement: ++agreements; break;
        case RecordType::Decision: ++decisions; break;
        default: break;
      }
      offset += header.bytes;
    }
    trace.comms.reserve(comms);
    trace.comm_ends.reserve(ends);
    trace.calls.reserve(calls);
    trace.steps.reserve(steps);
    trace.agreements.reserve(agreements);
    trace.decisions.reserve(decisions);
  }

  // Returns the record's size in bytes.
  uint64_t read_record(Trace& trace, uint64_t offset) const {
    const uint64_t remaining = size_ - offset;
    if (remaining < sizeof(RecordHeader)) {
      fail(offset, "truncated record at offset " + std::to_string(offset));
    }
    const auto header = load<RecordHeader>(offset);
    if (header.bytes < sizeof(RecordHeader)) {
      fail(offset,
           "record size " + std::to_string(header.bytes) + " is smaller than its 8-byte header");
    }
    if (header.bytes % 8 != 0) {
      fail(offset, "record size " + std::to_string(header.bytes) + " is not a multiple of 8");
    }
    if (header.bytes > remaining) {
      fail(offset, "truncated record at offset " + std::to_string(offset) + " (" +
                       std::to_string(header.bytes) + " bytes, " + std::to_string(remaining) +
                       " left in the file)");
    }
    const uint64_t payload = offset + sizeof(RecordHeader);
    const uint64_t payload_bytes = header.bytes - sizeof(RecordHeader);
    auto need = [&](uint64_t bytes, const char* what) {
      if (payload_bytes < bytes) {
        fail(offset, std::string(what) + " record of " + std::to_string(payload_bytes) +
                         " payload bytes, needs " + std::to_string(bytes));
      }
    };
    switch (static_cast<RecordType>(header.type)) {
      case RecordType::Comm:
        need(sizeof(CommRecord), "Comm");
        trace.comms.push_back(load<CommRecord>(payload));
        break;
      case RecordType::Call:
        need(sizeof(CallRecord), "Call");
        trace.calls.push_back(load<CallRecord>(payload));
        break;
      case RecordType::CommEnd:
        need(sizeof(CommEndRecord), "CommEnd");
        trace.comm_ends.push_back(load<CommEndRecord>(payload));
        break;
      case RecordType::Callsite: read_callsite(trace, offset, payload, payload_bytes); break;
      case RecordType::Module: read_module(trace, offset, payload, payload_bytes); break;
      case RecordType::PyCallsite: read_py_callsite(trace, offset, payload, payload_bytes); break;
      case RecordType::PyCall: {
        need(sizeof(PyCallRecord), "PyCall");
        const auto r = load<PyCallRecord>(payload);
        trace.py_calls[{r.comm_id, r.seq, r.rank}] = r.py_callsite;
        break;
      }
      case RecordType::GroupServed: {
        need(sizeof(GroupServedRecord), "GroupServed");
        apply_group_served(trace, load<GroupServedRecord>(payload));
        break;
      }
      case RecordType::Step:
        need(sizeof(StepRecord), "Step");
        trace.steps.push_back(load<StepRecord>(payload));
        break;
      case RecordType::Agreement:
        need(sizeof(AgreementRecord), "Agreement");
        trace.agreements.push_back(load<AgreementRecord>(payload));
        break;
      case RecordType::Decision:
        need(sizeof(DecisionRecord), "Decision");
        trace.decisions.push_back(load<DecisionRecord>(payload));
        break;
      case RecordType::Window:
        need(sizeof(WindowRecord), "Window");
        trace.windows.push_back(load<WindowRecord>(payload));
        break;
      case RecordType::WindowRefusal: {
        need(sizeof(WindowRefusalRecord), "WindowRefusal");
        const auto r = load<WindowRefusalRecord>(payload);
        if (r.text_bytes > payload_bytes - sizeof(WindowRefusalRecord))
          fail(offset, "WindowRefusal record claims " + std::to_string(r.text_bytes) +
                           " bytes of text but holds room for " +
                           std::to_string(payload_bytes - sizeof(WindowRefusalRecord)));
        trace.window_refusals.push_back(
            {r, std::string(data_ + payload + sizeof(WindowRefusalRecord), r.text_bytes)});
        break;
      }
      case RecordType::Dropped:
        need(sizeof(DroppedRecord), "Dropped");
        trace.dropped += load<DroppedRecord>(payload).records;
        break;
      default: ++trace.unknown_records; break;
    }
    return header.bytes;
  }

  // The call was written when its group queued it, a few records back: searched from the end.
  static void apply_group_served(Trace& trace, const GroupServedRecord& r) {
    constexpr uint8_t kServedFlags = kCallMoved | kCallFellBack;
    for (auto call = trace.calls.rbegin(); call != trace.calls.rend(); ++call) {
      if (call->comm_id != r.comm_id || call->seq != r.seq || call->rank != r.rank) continue;
      call->flags = static_cast<uint8_t>((call->flags & ~kServedFlags) | (r.flags & kServedFlags));
      return;
    }
  }

  void read_callsite(Trace& trace, uint64_t offset, uint64_t payload,
                     uint64_t payload_bytes) const {
    if (payload_bytes < sizeof(CallsiteRecord)) {
      fail(offset, "Callsite record of " + std::to_string(payload_bytes) +
                       " payload bytes, needs " + std::to_string(sizeof(CallsiteRecord)));
    }
    const auto record = load<CallsiteRecord>(payload);
    const uint64_t frame_bytes = uint64_t{record.frames} * sizeof(Frame);
    if (frame_bytes > payload_bytes - sizeof(CallsiteRecord)) {
      fail(offset, "Callsite record claims " + std::to_string(record.frames) +
                       " frames but holds room for " +
                       std::to_string((payload_bytes - sizeof(CallsiteRecord)) / sizeof(Frame)));
    }
    CallsiteFrames& entry = trace.callsites[record.callsite];
    entry.frames.resize(record.frames);
    if (record.frames != 0) {
      std::memcpy(entry.frames.data(), data_ + payload + sizeof(CallsiteRecord), frame_bytes);
    }
  }

  void read_py_callsite(Trace& trace, uint64_t offset, uint64_t payload,
                        uint64_t payload_bytes) const {
    if (payload_bytes < sizeof(PyCallsiteRecord)) {
      fail(offset, "PyCallsite record of " + std::to_string(payload_bytes) +
                       " payload bytes, needs " + std::to_string(sizeof(PyCallsiteRecord)));
    }
    const auto record = load<PyCallsiteRecord>(payload);
    const uint64_t entries = uint64_t{record.frames} * sizeof(PyFrameEntry);
    if (entries + record.text_bytes > payload_bytes - sizeof(PyCallsiteRecord)) {
      fail(offset, "PyCallsite record claims " + std::to_string(record.frames) + " frames and " +
                       std::to_string(record.text_bytes) + " bytes of text but holds room for " +
                       std::to_string(payload_bytes - sizeof(PyCallsiteRecord)) + " bytes");
    }
    std::vector<PyFrameText> frames;
    uint64_t text = payload + sizeof(PyCallsiteRecord) + entries;
    const uint64_t text_end = text + record.text_bytes;
    for (uint32_t i = 0; i < record.frames; ++i) {
      const auto entry =
          load<PyFrameEntry>(payload + sizeof(PyCallsiteRecord) + i * sizeof(PyFrameEntry));
      if (text + entry.file_bytes + entry.function_bytes > text_end)
        fail(offset, "PyCallsite record's frame " + std::to_string(i) + " runs past its text");
      frames.push_back({std::string(data_ + text, entry.file_bytes),
                        std::string(data_ + text + entry.file_bytes, entry.function_bytes),
                        entry.line});
      text += entry.file_bytes + entry.function_bytes;
    }
    trace.py_callsites[record.py_callsite] = std::move(frames);
  }

  void read_module(Trace& trace, uint64_t offset, uint64_t payload, uint64_t payload_bytes) const {
    if (payload_bytes < sizeof(ModuleRecord)) {
      fail(offset, "Module record of " + std::to_string(payload_bytes) + " payload bytes, needs " +
                       std::to_string(sizeof(ModuleRecord)));
    }
    const auto record = load<ModuleRecord>(payload);
    if (record.name_bytes > payload_bytes - sizeof(ModuleRecord)) {
      fail(offset, "Module record claims a " + std::to_string(record.name_bytes) +
                       "-byte name but holds room for " +
                       std::to_string(payload_bytes - sizeof(ModuleRecord)));
    }
    const uint64_t room = payload_bytes - sizeof(ModuleRecord) - record.name_bytes;
    if (record.build_id_bytes > room) {
      fail(offset, "Module record claims a " + std::to_string(record.build_id_bytes) +
                       "-byte build-id but holds room for " + std::to_string(room));
    }
    const char* name = data_ + payload + sizeof(ModuleRecord);
    trace.modules[record.module].assign(name, record.name_bytes);
    if (record.build_id_bytes != 0)
      trace.module_build_ids[record.module].assign(name + record.name_bytes, record.build_id_bytes);
  }

  const std::string& name_;
  const char* data_;
  uint64_t size_;
};

}  // namespace

Trace parse_trace(const std::string& name, const std::string& bytes) {
  return TraceParser(name, bytes).parse();
}

void parse_records(const std::string& name, const std::string& bytes, Trace& into) {
  TraceParser(name, bytes).parse_records(into);
}

Trace read_trace(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw TraceFormatError(path, 0, std::string("cannot open: ") + std::strerror(errno));
  // Read to end of file into one buffer sized from fstat, growing only if the file grows
  // meanwhile (a trace still being written): one copy from the kernel, none after.
  struct stat st {};
  const size_t expected =
      ::fstat(fd, &st) == 0 && st.st_size > 0 ? static_cast<size_t>(st.st_size) : 0;
  std::string bytes(expected + 4096, '\0');
  size_t used = 0;
  for (;;) {
    if (used == bytes.size()) bytes.resize(bytes.size() * 2);
    const ssize_t got = ::read(fd, bytes.data() + used, bytes.size() - used);
    if (got > 0) {
      used += static_cast<size_t>(got);
    } else if (got == 0) {
      break;
    } else if (errno != EINTR) {
      const int error = errno;
      ::close(fd);
      throw TraceFormatError(path, used, std::string("cannot read: ") + std::strerror(error));
    }
  }
  bytes.resize(used);
  ::close(fd);
  return parse_trace(path, bytes);
}

}  // namespace magi::trace
