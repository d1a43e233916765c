// Send and Recv. Each ordered pair (sender, receiver) has one chunk-sized slot and two counters
// (segment.h): the sender writes chunk g once the receiver has taken g - 1, the receiver takes g
// once it is written. Operations on one pair and direction run in call order (per-peer tickets),
// which is NCCL's matching rule for point-to-point.
//
// A message is at least one chunk, so a zero-byte Send still meets its Recv; every chunk carries
// the message size, so a receiver sees a count mismatch on the first chunk and can skip exactly
// the sender's chunks (STANDIN_MISMATCH=error) to stay in step.
#include <algorithm>
#include <cstring>

#include "tests/support/standin/comm.h"
#include "tests/support/standin/elements.h"
#include "tests/support/standin/operation.h"
#include "tests/support/standin/report.h"
#include "tests/support/standin/settings.h"

namespace standin {
namespace {

class Transfer final : public Operation {
 public:
  Transfer(ncclComm* comm, bool sending, const void* buffer, size_t count, ncclDataType_t dtype,
           int peer)
      : comm_(comm),
        sending_(sending),
        buffer_(static_cast<std::byte*>(const_cast<void*>(buffer))),
        bytes_(count * datatype_bytes(dtype)),
        count_(count),
        dtype_(dtype),
        peer_(peer) {}

  void launch() override {
    auto& tickets = sending_ ? comm_->send_tickets : comm_->recv_tickets;
    ticket_ = tickets[peer_]++;
  }

  Segment* awaited() const override { return comm_->segment.get(); }

  bool progress() override {
    bool moved = false;
    if (stage_ == Stage::AwaitTurn) {
      if (!comm_->broken.empty()) {
        stage_ = Stage::Finished;
        finish(ncclSystemError, comm_->broken);
        return true;
      }
      auto& turn = sending_ ? comm_->send_turn : comm_->recv_turn;
      if (turn[peer_] != ticket_) return false;
      chunks_ = chunks_for(bytes_);
      message_bytes_ = bytes_;
      stage_ = Stage::Moving;
      moved = true;
    }
    while (stage_ == Stage::Moving) {
      if (!(sending_ ? send_chunk() : receive_chunk())) return moved;
      moved = true;
      if (stage_ == Stage::Moving && ++chunk_ == chunks_) complete();
    }
    return moved;
  }

  int rank() const override { return comm_->rank; }

  std::string describe() const override {
    return format("%s(%s, count %zu, peer %d)", sending_ ? "Send" : "Recv", datatype_name(dtype_),
                  count_, peer_);
  }

  std::string why_waiting() const override {
    switch (stage_) {
      case Stage::AwaitTurn: return "behind an earlier transfer with that peer";
      case Stage::Blocked: return "after a mismatch";
      default: return format("waiting for rank %d", peer_);
    }
  }

  int awaited_rank() const override { return stage_ == Stage::Moving ? peer_ : -1; }

  void give_up(ncclResult_t code, const std::string& message) override {
    comm_->broken = "communicator broken earlier: " + message;
    stage_ = Stage::Finished;
    finish(code, message);
  }

 private:
  enum class Stage { AwaitTurn, Moving, Blocked, Finished };

  size_t payload() const { return comm_->segment->pair_payload_bytes(); }
  uint64_t chunks_for(size_t bytes) const {
    return std::max<uint64_t>(1, (bytes + payload() - 1) / payload());
  }

  bool send_chunk() {
    Segment& segment = *comm_->segment;
    PairChannel& channel = segment.pair(comm_->rank, peer_);
    const uint64_t g = comm_->chunks_sent[peer_];
    if (channel.received.load(std::memory_order_acquire) < g) return false;
    std::byte* slot = segment.pair_slot(comm_->rank, peer_);
    ChunkHeader header{};
    header.message_bytes = bytes_;
    std::memcpy(slot, &header, sizeof header);
    const size_t offset = static_cast<size_t>(chunk_) * payload();
    const size_t length = std::min(payload(), bytes_ - std::min(bytes_, offset));
    if (length != 0) std::memcpy(slot + sizeof header, buffer_ + offset, length);
    channel.sent.store(g + 1, std::memory_order_release);
    comm_->chunks_sent[peer_] = g + 1;
    segment.ring();
    return true;
  }

  bool receive_chunk() {
    Segment& segment = *comm_->segment;
    PairChannel& channel = segment.pair(peer_, comm_->rank);
    const uint64_t g = comm_->chunks_received[peer_];
    if (channel.sent.load(std::memory_order_acquire) < g + 1) return false;
    const std::byte* slot = segment.pair_slot(peer_, comm_->rank);
    ChunkHeader header;
    std::memcpy(&header, slot, sizeof header);
    if (chunk_ == 0 && header.message_bytes != bytes_ && !note_mismatch(header.message_bytes)) {
      return false;
    }
    // Copies what fits in this Recv's buffer; a longer mismatched message is skipped past.
    const size_t offset = static_cast<size_t>(chunk_) * payload();
    const size_t length = std::min(payload(), message_bytes_ - std::min(message_bytes_, offset));
    const size_t kept = std::min(length, bytes_ - std::min(bytes_, offset));
    if (kept != 0) std::memcpy(buffer_ + offset, slot + sizeof header, kept);
    channel.received.store(g + 1, std::memory_order_release);
    comm_->chunks_received[peer_] = g + 1;
    segment.ring();
    return true;
  }

  // False: blocked (the default policy). True: go on, skipping the sender's whole message.
  bool note_mismatch(uint64_t sender_bytes) {
    mismatch_ =
        format("rank %d: Recv from rank %d mismatch: expecting %zu bytes, rank %d sends %llu",
               comm_->rank, peer_, bytes_, peer_, static_cast<unsigned long long>(sender_bytes));
    report("%s", mismatch_.c_str());
    if (Settings::get().mismatch == MismatchPolicy::Block) {
      stage_ = Stage::Blocked;
      return false;
    }
    message_bytes_ = sender_bytes;
    chunks_ = chunks_for(sender_bytes);
    return true;
  }

  void complete() {
    auto& turn = sending_ ? comm_->send_turn : comm_->recv_turn;
    ++turn[peer_];
    stage_ = Stage::Finished;
    if (mismatch_.empty()) {
      finish(ncclSuccess);
    } else {
      finish(ncclInvalidUsage, mismatch_);
    }
  }

  ncclComm* comm_;
  bool sending_;
  std::byte* buffer_;
  size_t bytes_;
  size_t count_;
  ncclDataType_t dtype_;
  int peer_;
  Stage stage_ = Stage::AwaitTurn;
  uint64_t ticket_ = 0;
  uint64_t chunk_ = 0;  // within this message
  uint64_t chunks_ = 0;
  size_t message_bytes_ = 0;  // the sender's size (differs from bytes_ only on a mismatch)
  std::string mismatch_;
};

}  // namespace

std::unique_ptr<Operation> make_send(ncclComm* comm, const void* buffer, size_t count,
                                     ncclDataType_t dtype, int peer) {
  return std::make_unique<Transfer>(comm, true, buffer, count, dtype, peer);
}

std::unique_ptr<Operation> make_recv(ncclComm* comm, void* buffer, size_t count,
                                     ncclDataType_t dtype, int peer) {
  return std::make_unique<Transfer>(comm, false, buffer, count, dtype, peer);
}

}  // namespace standin
