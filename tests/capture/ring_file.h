// A flight recorder file's bytes with one communicator's ring, laid out as the library lays it
// out, written through the library's own ring writer: what the recorder's tests read back, or
// write to disk for magice-trace hang.
#pragma once

#include <nccl.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "capture/flight_recorder.h"
#include "capture/trace_format.h"

namespace magi::capture {

class TestRingFile {
 public:
  TestRingFile(uint32_t capacity, uint64_t comm, int rank, int nranks, uint64_t pid,
               flight::CompletionSource completion)
      : capacity_(capacity), bytes_(flight::kPage + flight::segment_bytes(capacity), 0) {
    flight::FileHeader header{};
    std::memcpy(header.magic, flight::kMagic, sizeof(header.magic));
    header.version = flight::kVersion;
    header.header_bytes = flight::kPage;
    header.pid = pid;
    std::snprintf(header.host, sizeof(header.host), "testhost");
    header.capacity = capacity;
    header.record_bytes = sizeof(flight::Record);
    std::memcpy(bytes_.data(), &header, sizeof(header));
    ring_ = flight_ring_in(bytes_.data() + flight::kPage, capacity, comm, rank, nranks, completion);
  }
  ~TestRingFile() { flight_ring_release(ring_); }
  TestRingFile(const TestRingFile&) = delete;
  TestRingFile& operator=(const TestRingFile&) = delete;

  // Collective `seq` (every call a collective here): an all-gather of `count` floats.
  FlightSlot issue(uint64_t seq, uint64_t count = 256) {
    FlightCall call{};
    call.seq = seq;
    call.collective = seq + 1;
    call.count = count;
    call.root_or_peer = -1;
    call.redop = -1;
    call.op = static_cast<uint8_t>(trace::Op::AllGather);
    call.dtype = static_cast<uint8_t>(ncclFloat32);
    return flight_issue(ring_, call);
  }
  flight::Record& slot(uint64_t seq) {
    auto* records = reinterpret_cast<flight::Record*>(bytes_.data() + flight::kPage +
                                                      sizeof(flight::RingHeader));
    return records[seq % capacity_];
  }
  flight::FileView read() const {
    return flight::parse_file("ring", std::span<const char>(bytes_.data(), bytes_.size()));
  }
  void write(const std::string& path) const {
    std::ofstream out(path, std::ios::binary);
    out.write(bytes_.data(), static_cast<std::streamsize>(bytes_.size()));
  }
  FlightRing* ring() { return ring_; }

 private:
  uint32_t capacity_;
  std::vector<char> bytes_;
  FlightRing* ring_;
};

}  // namespace magi::capture
