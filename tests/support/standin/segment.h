// One communicator's shared memory: a POSIX shm segment every rank maps.
//
//   header | RankControl × n | PairChannel × n² | collective slot × n | pair slot × n²
//
// Collectives move through each rank's collective slot in rounds; Send/Recv through the pair slot
// of (sender, receiver). All counters only grow, and a zero-filled segment is a valid fresh state,
// so nobody has to initialise anything but the layout. Every store that lets a peer advance is a
// release and is followed by ring(); waiters sleep on the doorbell (a futex) between checks.
//
// The name is unlinked as soon as every rank has mapped it (nobody else will look for it), so a
// run that is killed later leaves nothing in /dev/shm.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace standin {

// What a rank is about to do with its collective slot; equal on every rank, or it is a mismatch.
struct OpDescriptor {
  uint64_t seq = 0;  // the caller's collective number on the communicator (messages only)
  uint64_t count = 0;
  int32_t kind = 0;  // OpKind
  int32_t dtype = 0;
  int32_t root = -1;
  int32_t redop = -1;

  bool same_shape(const OpDescriptor& o) const {
    return kind == o.kind && count == o.count && dtype == o.dtype && root == o.root &&
           redop == o.redop;
  }
};

struct alignas(64) RankControl {
  std::atomic<int32_t> owner_pid;  // the process that joined as this rank; 0 until then
  std::atomic<uint64_t> posted;    // collective rounds whose slot data this rank has published
  std::atomic<uint64_t> consumed;  // collective rounds this rank has finished reading
  OpDescriptor descriptor;         // of the round posted last
};

struct alignas(64) PairChannel {   // sender → receiver
  std::atomic<uint64_t> sent;      // chunks the sender has published
  std::atomic<uint64_t> received;  // chunks the receiver has taken
};

// At the start of every pair-slot chunk.
struct alignas(64) ChunkHeader {
  uint64_t message_bytes;  // of the whole Send, so a receiver can see a count mismatch
};

class Segment {
 public:
  // Maps the named segment, creating it if this is the first rank; the creator's slot size wins.
  static std::shared_ptr<Segment> attach(const std::string& name, int nranks, size_t slot_bytes,
                                         double timeout_s);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  const std::string& name() const { return name_; }
  int nranks() const { return nranks_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t pair_payload_bytes() const { return pair_bytes_ - sizeof(ChunkHeader); }

  // Takes `rank`'s place for this process; false if someone already has it.
  bool claim(int rank);
  // False once the process that joined as `rank` has exited (a peer that will never answer).
  bool rank_alive(int rank);
  // Counts this mapping in; the last of nranks unlinks the name.
  void count_join();
  int joined() const;
  void unlink_name();

  RankControl& control(int rank);
  PairChannel& pair(int sender, int receiver);
  std::byte* collective_slot(int rank);
  std::byte* pair_slot(int sender, int receiver);

  // This process aborted the communicator on this segment (ncclCommAbort, maybe from another
  // thread): what it still waits for there gives up. Process-local, like NCCL's abort flag.
  void abort_here() { aborted_here_.store(true); }
  bool aborted_here() const { return aborted_here_.load(); }

  uint32_t doorbell() const;
  void ring();
  // Sleeps until ring() moves the doorbell past `seen`, or `limit` passes.
  void sleep_unless_rung(uint32_t seen, std::chrono::microseconds limit);

 private:
  struct Header;
  Segment() = default;
  Header& header() const;

  std::string name_;
  int nranks_ = 0;
  size_t slot_bytes_ = 0;
  size_t pair_bytes_ = 0;
  std::byte* base_ = nullptr;
  size_t mapped_bytes_ = 0;
  size_t controls_offset_ = 0, pairs_offset_ = 0, slots_offset_ = 0, pair_slots_offset_ = 0;
  std::atomic<bool> aborted_here_{false};
};

}  // namespace standin
