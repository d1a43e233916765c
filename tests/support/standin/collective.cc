// The data collectives over the round protocol (rounds.h), with NCCL's definitions:
//   AllGather      rank r's sendcount elements land at recvbuf + r·sendcount on every rank
//   ReduceScatter  rank r receives block r of the element-wise reduction of all sendbufs
//   AlltoAll       block j of rank i's sendbuf lands in block i of rank j's recvbuf
//   Gather/Scatter the same, to or from the root only
// Each round moves one chunk of every block, so the in-place forms (sendbuf at the NCCL-defined
// offset inside recvbuf) work: a round writes only elements whose inputs it has already published.
#include <algorithm>
#include <cstring>
#include <vector>

#include "tests/support/standin/elements.h"
#include "tests/support/standin/rounds.h"

namespace standin {
namespace {

// Whether a rank's slot holds one chunk per destination block (else one chunk of one buffer).
bool per_block_layout(OpKind kind) {
  return kind == OpKind::ReduceScatter || kind == OpKind::AlltoAll || kind == OpKind::Scatter;
}

class Collective final : public RoundOperation {
 public:
  uint64_t traffic_bytes() const override {
    const uint64_t bytes = args_.count * element_;
    switch (args_.kind) {
      case OpKind::AllGather:
      case OpKind::ReduceScatter: return bytes * static_cast<uint64_t>(nranks_of_comm_);
      case OpKind::AllReduce: return 2 * bytes;
      default: return bytes;
    }
  }

  Collective(ncclComm* comm, const CollectiveArgs& args)
      : RoundOperation(comm, shape_of(args)),
        args_(args),
        element_(datatype_bytes(args.dtype)),
        inputs_(static_cast<size_t>(comm->nranks)),
        nranks_of_comm_(comm->nranks) {
    const size_t slot = comm->segment->slot_bytes();
    chunk_ = per_block_layout(args.kind) ? slot / (static_cast<size_t>(comm->nranks) * element_)
                                         : slot / element_;
  }

 private:
  static OpDescriptor shape_of(const CollectiveArgs& a) {
    OpDescriptor d;
    d.kind = static_cast<int32_t>(a.kind);
    d.count = a.count;
    d.dtype = a.dtype;
    d.root = a.root;
    d.redop = a.redop;
    return d;
  }

  uint64_t rounds() const override {
    const uint64_t n = (args_.count + chunk_ - 1) / chunk_;
    return n == 0 ? 1 : n;
  }

  // Element range [first, first + length) of each block that round `round` moves.
  void chunk_range(uint64_t round, size_t& first, size_t& length) const {
    first = static_cast<size_t>(round) * chunk_;
    length = first >= args_.count ? 0 : std::min(chunk_, args_.count - first);
  }

  const std::byte* send_at(size_t element) const {
    return static_cast<const std::byte*>(args_.sendbuf) + element * element_;
  }
  std::byte* recv_at(size_t element) const {
    return static_cast<std::byte*>(args_.recvbuf) + element * element_;
  }

  void publish(uint64_t round, std::byte* slot) override {
    size_t first, length;
    chunk_range(round, first, length);
    if (length == 0) return;  // count 0: buffers may be NULL
    const int me = comm_->rank;
    const size_t bytes = length * element_;
    switch (args_.kind) {
      case OpKind::AllGather:
      case OpKind::AllReduce:
      case OpKind::Reduce:
      case OpKind::Gather: std::memcpy(slot, send_at(first), bytes); break;
      case OpKind::Broadcast:
        if (me == args_.root) std::memcpy(slot, send_at(first), bytes);
        break;
      case OpKind::Scatter:
        if (me != args_.root) break;
        [[fallthrough]];
      case OpKind::ReduceScatter:
      case OpKind::AlltoAll:
        for (int j = 0; j < comm_->nranks; ++j) {
          std::memcpy(slot + j * chunk_ * element_, send_at(j * args_.count + first), bytes);
        }
        break;
      default: break;
    }
  }

  void consume(uint64_t round) override {
    size_t first, length;
    chunk_range(round, first, length);
    if (length == 0) return;
    const int me = comm_->rank;
    const int n = comm_->nranks;
    const size_t bytes = length * element_;
    const size_t my_block = static_cast<size_t>(me) * chunk_ * element_;
    switch (args_.kind) {
      case OpKind::AllGather:
        for (int j = 0; j < n; ++j)
          std::memcpy(recv_at(j * args_.count + first), slot_of(j), bytes);
        break;
      case OpKind::Gather:
        if (me != args_.root) break;
        for (int j = 0; j < n; ++j)
          std::memcpy(recv_at(j * args_.count + first), slot_of(j), bytes);
        break;
      case OpKind::Reduce:
        if (me != args_.root) break;
        [[fallthrough]];
      case OpKind::AllReduce:
        for (int j = 0; j < n; ++j) inputs_[j] = slot_of(j);
        reduce_elements(args_.dtype, static_cast<ncclRedOp_t>(args_.redop), recv_at(first),
                        inputs_.data(), n, length);
        break;
      case OpKind::ReduceScatter:
        for (int j = 0; j < n; ++j) inputs_[j] = slot_of(j) + my_block;
        reduce_elements(args_.dtype, static_cast<ncclRedOp_t>(args_.redop), recv_at(first),
                        inputs_.data(), n, length);
        break;
      case OpKind::Broadcast:
        // The root in place already holds the data; otherwise copy from the root's slot.
        if (me != args_.root || args_.sendbuf != args_.recvbuf) {
          std::memcpy(recv_at(first), slot_of(args_.root), bytes);
        }
        break;
      case OpKind::AlltoAll:
        for (int j = 0; j < n; ++j) {
          std::memcpy(recv_at(j * args_.count + first), slot_of(j) + my_block, bytes);
        }
        break;
      case OpKind::Scatter:
        std::memcpy(recv_at(first), slot_of(args_.root) + my_block, bytes);
        break;
      default: break;
    }
  }

  CollectiveArgs args_;
  size_t element_;
  size_t chunk_ = 1;  // elements per block per round
  std::vector<const void*> inputs_;
  int nranks_of_comm_;
};

}  // namespace

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::AllGather: return "AllGather";
    case OpKind::AllReduce: return "AllReduce";
    case OpKind::ReduceScatter: return "ReduceScatter";
    case OpKind::Broadcast: return "Broadcast";
    case OpKind::Reduce: return "Reduce";
    case OpKind::AlltoAll: return "AlltoAll";
    case OpKind::Gather: return "Gather";
    case OpKind::Scatter: return "Scatter";
    case OpKind::Send: return "Send";
    case OpKind::Recv: return "Recv";
    case OpKind::Split: return "CommSplit";
  }
  return "unknown";
}

std::unique_ptr<Operation> make_collective(ncclComm* comm, const CollectiveArgs& args) {
  return std::make_unique<Collective>(comm, args);
}

}  // namespace standin
