// Every NCCL operation is a small state machine that never blocks: progress() advances it as
// far as the peers allow and returns whether anything changed. A group (group.h) drives all of
// its operations round-robin until each is done, which is what lets one thread run a Send/Recv
// ring, or several communicators of ncclCommInitAll, inside one group.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <memory>
#include <string>

#include "tests/support/standin/segment.h"

struct ncclComm;

namespace standin {

// Numbered like the trace format's Op, so names line up; Split is ours.
enum class OpKind : int32_t {
  AllGather = 1,
  AllReduce,
  ReduceScatter,
  Broadcast,
  Reduce,
  AlltoAll,
  Gather,
  Scatter,
  Send,
  Recv,
  Split
};
const char* op_kind_name(OpKind kind);

class Operation {
 public:
  virtual ~Operation() = default;

  // Called once, in call order, when the group runs: takes this operation's place in its
  // communicator's order (collective tickets, per-peer tickets).
  virtual void launch() = 0;
  virtual bool progress() = 0;
  // The segment whose doorbell rings when this operation may be able to advance.
  virtual Segment* awaited() const = 0;
  // For the group's messages when it gives up on an operation.
  virtual int rank() const = 0;
  virtual std::string describe() const = 0;     // "AllGather(float32, count 256) (collective #3)"
  virtual std::string why_waiting() const = 0;  // "waiting for rank 2", "after a mismatch"
  // The rank it waits for right now, when that is one known rank; else -1.
  virtual int awaited_rank() const { return -1; }
  // Bytes NCCL's planner weighs a collective by (elements x size x traffic per byte): it runs the
  // collectives of one group largest first. 0 for what it does not sort (point-to-point, splits).
  virtual uint64_t traffic_bytes() const { return 0; }
  // Ends the operation with `code` (a timeout, a peer that exited) and breaks its communicator:
  // its later operations fail at once instead of waiting again.
  virtual void give_up(ncclResult_t code, const std::string& message) = 0;

  bool done() const { return done_; }
  ncclResult_t result() const { return result_; }
  const std::string& error() const { return error_; }

 protected:
  void finish(ncclResult_t result, std::string error = {}) {
    done_ = true;
    result_ = result;
    error_ = std::move(error);
  }

 private:
  bool done_ = false;
  ncclResult_t result_ = ncclSuccess;
  std::string error_;
};

struct CollectiveArgs {
  OpKind kind;
  const void* sendbuf;
  void* recvbuf;
  size_t count;  // NCCL's count argument: sendcount for AllGather, recvcount for ReduceScatter
  ncclDataType_t dtype;
  int root;   // rooted collectives; else -1
  int redop;  // reductions; else -1
};

std::unique_ptr<Operation> make_collective(ncclComm* comm, const CollectiveArgs& args);
std::unique_ptr<Operation> make_send(ncclComm* comm, const void* buffer, size_t count,
                                     ncclDataType_t dtype, int peer);
std::unique_ptr<Operation> make_recv(ncclComm* comm, void* buffer, size_t count,
                                     ncclDataType_t dtype, int peer);
// Completes when every rank of `comm` has joined its segment.
std::unique_ptr<Operation> make_join_wait(ncclComm* comm);
// ncclCommSplit: an exchange of (color, key) over `parent`, then the child's join.
std::unique_ptr<Operation> make_split(ncclComm* parent, int color, int key, ncclComm** newcomm);

}  // namespace standin
