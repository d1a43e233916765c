// The window protocol both backends speak. Private to ce_transport/.
//
//  - The handle blob: one header (which protocol, which communicator, which rank, the window's
//    shape, the owner's pid), written by one writer and checked by one checker, followed by the
//    backend's medium (the shared-memory name, or the CUDA IPC handle and device).
//  - The flag words of the bucket handshake (ce_transport.h): where each peer's ready and done
//    words lie in a window, each on a line of its own.
//  - Where MAGI_INJECT_FAULT strikes: the same points of the protocol in both backends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "base/base.h"
#include "ce_transport/ce_transport.h"

namespace magi::ce::protocol {

// ---- the handle blob ----------------------------------------------------------------------------

inline constexpr uint64_t kBlobMagic = 0x42574543'4947414d;  // "MAGICEWB" in memory order
// Raised whenever the header or a medium changes its layout: ranks built apart refuse each other.
inline constexpr uint32_t kBlobVersion = 5;

struct BlobHeader {
  uint64_t magic;
  uint32_t version;
  uint8_t backend;    // Backend
  uint8_t bound;      // 0 or 1
  uint8_t zero_copy;  // 0 or 1: window and slot bytes are this rank's own (not compared)
  uint8_t reserved;
  uint64_t comm_identity;
  uint64_t window_bytes;
  uint64_t slot_bytes;
  int32_t rank;
  int32_t nranks;
  int64_t pid;
  char source_log[40];  // bound windows: the name of this rank's SourceLog, NUL-terminated
};
static_assert(std::is_trivially_copyable_v<BlobHeader> && sizeof(BlobHeader) == 96);

// What a backend may append to the header.
inline constexpr size_t kMediumBytes = HandleBlob::kBytes - sizeof(BlobHeader);

// What every rank's window must agree on, as this rank sees its own: slot offsets are symmetric
// only if every rank sized its window from the same plan.
struct WindowShape {
  Backend backend = Backend::Host;
  uint64_t comm_identity = 0;
  int nranks = 0;
  uint64_t window_bytes = 0;
  uint64_t slot_bytes = 0;  // zero-copy: this rank's bound region, which differs by rank
  bool bound = false;
  bool zero_copy = false;  // bound only: each rank's window holds only what it could not export
};

// This rank's blob: the header (its shape, its rank, this process's pid, its source log's name),
// then `medium`.
void write_header(const WindowShape& shape, int rank, const std::string& source_log,
                  HandleBlob& out);
// The source log a checked header names ("" when none).
std::string source_log_of(const BlobHeader& header);
// Peer `rank`'s header, once it matches `shape` in every field; throws Error(Usage) naming the
// first that differs (magic, version, backend, rank, nranks, communicator, window or slot bytes
// (not for zero-copy windows, whose sizes are each rank's own), bound, zero-copy, pid).
BlobHeader check_header(const HandleBlob& blob, int rank, const WindowShape& shape);

template <class Medium>
void write_blob(const WindowShape& shape, int rank, const std::string& source_log,
                const Medium& medium, HandleBlob& out) {
  static_assert(std::is_trivially_copyable_v<Medium> && sizeof(Medium) <= kMediumBytes);
  write_header(shape, rank, source_log, out);
  std::memcpy(out.bytes + sizeof(BlobHeader), &medium, sizeof(medium));
}

// Peer `rank`'s blob, checked (check_header); `header` gets its header.
template <class Medium>
Medium read_blob(const HandleBlob& blob, int rank, const WindowShape& shape, BlobHeader& header) {
  static_assert(std::is_trivially_copyable_v<Medium> && sizeof(Medium) <= kMediumBytes);
  header = check_header(blob, rank, shape);
  Medium medium;
  std::memcpy(&medium, blob.bytes + sizeof(BlobHeader), sizeof(medium));
  return medium;
}

// ---- the handshake's flag words -----------------------------------------------------------------
// Where the words of the bucket handshake (ce_transport.h) lie in a window, as offsets from the
// start of its flags, the same in both backends. A rank waits only on words in its own window:
// polling stays local, and an abort can release this rank's waits by writing them itself without
// touching what its peers wait on. So a window holds, for each rank r, words that only r writes
// (through its mapping of the window):
//   ready(r): the last bucket r has staged;
//   done(r): the last bucket r has finished reading (this window's slot among others);
//   failed(r, n): n when r could not serve bucket n, written before its ready (host backend).
//     By bucket parity: a peer still checking bucket n may already see r's ready of n + 1,
//     never of n + 2 (r waits for that peer's done of n first);
// and own(): the last bucket whose part has run on the owner (CUDA backend: what release waits
// for); left(): 1 once the owner released the window (written before it frees it, at the
// communicator's end or the process's): a peer whose process is gone without it died with the
// communicator in use (Transport::lost_peer()). Each word is on a line of its own (a cache line
// on the host, 256 bytes on a device), so no two writers share a line.
//
// Graph slots (WindowPlan::graph_slots) have latches instead of counters, since a replay writes
// what its capture wrote: a latch's low 32 bits are 0 or 1, written by 32-bit stores; its high
// 32 bits stay 0 until an abort sets them, and a wait on a latch ends when it is 1 or aborted
// (kLatchOpen). For graph slot s and each rank r:
//   staged(s, r): r has staged its slot s (r sets it, the owner puts it back to 0);
//   read(s, r): r has read the owner's slot s since the owner last staged it (starts at 1; the
//     owner puts it to 0 before staging, r sets it after reading).
struct FlagLayout {
  size_t line_bytes = 0;
  int nranks = 0;

  size_t ready(int from) const { return line(static_cast<size_t>(from)); }
  size_t done(int from) const { return line(ranks() + static_cast<size_t>(from)); }
  size_t own() const { return line(2 * ranks()); }
  size_t staged(int slot, int from) const {
    return line(2 * ranks() + 1 + static_cast<size_t>(slot) * ranks() + static_cast<size_t>(from));
  }
  size_t read(int slot, int from) const {
    return line(4 * ranks() + 1 + static_cast<size_t>(slot) * ranks() + static_cast<size_t>(from));
  }
  size_t left() const { return line(6 * ranks() + 1); }
  size_t failed(int from, uint64_t bucket) const {
    return line(6 * ranks() + 2 + 2 * static_cast<size_t>(from) + bucket % 2);
  }
  // Bytes of every word but the failed ones: all the CUDA backend uses (it cannot act on failed
  // words in a bucket).
  size_t bytes_but_failed() const { return line(6 * ranks() + 2); }
  size_t bytes() const { return line(8 * ranks() + 2); }

 private:
  size_t ranks() const { return static_cast<size_t>(nranks); }
  size_t line(size_t index) const { return index * line_bytes; }
};

// A latch (graph slots): set when its low half is 1, and opened for good by an abort, which
// writes its high half (the handshake's own stores write only the low half).
inline constexpr uint64_t kLatchSet = 1;
inline constexpr uint64_t kLatchOpen = kLatchSet | ~uint64_t{0} << 32;  // a wait's mask

// What an abort raises this rank's ready and done words to, so that its waits on them pass.
// Stream waits compare cyclically ((int64_t)(word - target) >= 0): the value must be far ahead
// of any sequence number, yet not wrap past them.
inline constexpr uint64_t kReleased = uint64_t{1} << 62;

// A window's flag words as they start (layout.bytes() of them): 0, but the graph slots' read
// latches, set: no peer owes a read of a slot not yet staged.
std::vector<uint8_t> first_flags(const FlagLayout& layout);

// ---- MAGI_INJECT_FAULT ------------------------------------------------------------------------
// Lets tests make one rank's transport fail where a CUDA error could, to show that every rank
// then goes back to NCCL together; or make it slow, to show that the cost trial then keeps NCCL
// on every rank. Each backend asks at the same points:
//  - prepare: first thing in prepare(), once the previous window is released;
//  - attach: in attach(), after its usage checks, before any peer's window is opened;
//  - refuse-descriptors: in attach(), the rank's descriptor channel is told no peer may take
//    its descriptors (fd_channel.h), so every peer that reads an export of it by descriptor
//    fails its attach, as when the owner is gone;
//  - slow: at every bucket's start, before anything is queued or copied (a timed bucket counts
//    it: the host waits before queuing anything, and the stream's clock runs meanwhile);
//  - gather: in a handshake bucket (not a bound window's, which has none), once it has its
//    sequence number and before this rank stages anything. What follows differs by medium
//    (ce_transport.h says why): host: once the bucket's slot is free (every peer's done >= n - 2,
//    as for a served bucket), the rank publishes "failed" with its ready, and every rank returns
//    FallBack in that bucket; CUDA: the rank throws before queuing anything, as a real CUDA error
//    at the bucket's first step would.

class FaultPoints {
 public:
  // `fault` is MAGI_INJECT_FAULT (Options::get().inject_fault unless a test gives its own).
  FaultPoints(const Options::Fault& fault, int rank)
      : where_(fault.rank == rank ? fault.where : Options::Fault::Where::None) {}

  // Throw Error(Cuda) "<what>: injected by MAGI_INJECT_FAULT" when due.
  void at_prepare() const;
  void at_attach() const;
  // slow: the bucket's start is 20 ms late.
  void at_bucket_start() const;
  // gather: this bucket fails before this rank stages anything.
  bool fails_bucket() const { return where_ == Options::Fault::Where::Gather; }
  // refuse-descriptors: no peer may take this rank's descriptors.
  bool refuses_descriptors() const { return where_ == Options::Fault::Where::RefuseDescriptors; }

 private:
  Options::Fault::Where where_;
};

}  // namespace magi::ce::protocol
