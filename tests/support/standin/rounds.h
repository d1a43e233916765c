// The collective protocol. An operation on a communicator takes the next rounds of it, and each
// round is: publish my part into my slot → wait until every rank has published → read the
// slots → mark my reading done. Before publishing a round a rank waits until every rank has read
// its previous one, so a slot is never overwritten while someone reads it, and a rank is never
// more than one round ahead of the slowest.
//
// Round 0 also carries each rank's OpDescriptor. Ranks compare them before reading anything:
// on a mismatch every rank sees the same descriptors, so either all block (NCCL would hang) or,
// with STANDIN_MISMATCH=error, all give up after that one round and stay in step.
#pragma once

#include <cstdint>
#include <string>

#include "tests/support/standin/comm.h"
#include "tests/support/standin/operation.h"

namespace standin {

class RoundOperation : public Operation {
 public:
  void launch() override;
  bool progress() override;
  Segment* awaited() const override { return comm_->segment.get(); }
  int rank() const override { return comm_->rank; }
  std::string describe() const override;
  std::string why_waiting() const override;
  int awaited_rank() const override;
  void give_up(ncclResult_t code, const std::string& message) override;

 protected:
  RoundOperation(ncclComm* comm, OpDescriptor shape) : comm_(comm), shape_(shape) {}

  virtual uint64_t rounds() const = 0;  // at least 1, from the shape alone
  virtual void publish(uint64_t round, std::byte* my_slot) = 0;
  virtual void consume(uint64_t round) = 0;  // every rank's slot holds this round
  // After the last round; the default finishes successfully.
  virtual void rounds_complete() { finish(ncclSuccess); }

  std::byte* slot_of(int rank) const { return comm_->segment->collective_slot(rank); }
  std::string describe_shape(const OpDescriptor& d) const;

  ncclComm* comm_;
  OpDescriptor shape_;

 private:
  enum class Stage { AwaitTurn, Publish, Read, Blocked, Finished };
  bool check_shapes();  // false: a mismatch took over

  Stage stage_ = Stage::AwaitTurn;
  uint64_t ticket_ = 0;
  uint64_t base_ = 0;   // communicator round where this operation starts
  uint64_t round_ = 0;  // within this operation
  uint64_t total_rounds_ = 0;
  int waiting_for_ = -1;  // a rank this operation last found behind, for the timeout message
};

}  // namespace standin
