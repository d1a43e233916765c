// Operations that make communicators: waiting for every rank to join one, and ncclCommSplit.
//
// Split is a collective over the parent (one round of the parent's protocol carrying each rank's
// color and key), so the ranks agree on the split's position; the child's segment name is derived
// from the parent's name, the parent's split count and the color, which every member knows alike.
#include <algorithm>
#include <cstring>
#include <vector>

#include "tests/support/standin/comm.h"
#include "tests/support/standin/report.h"
#include "tests/support/standin/rounds.h"

namespace standin {
namespace {

class JoinWait final : public Operation {
 public:
  explicit JoinWait(ncclComm* comm) : comm_(comm) {}

  void launch() override {}
  Segment* awaited() const override { return comm_->segment.get(); }

  bool progress() override {
    if (done()) return false;
    if (comm_->segment->joined() < comm_->nranks) return false;
    finish(ncclSuccess);
    return true;
  }

  int rank() const override { return comm_->rank; }

  std::string describe() const override {
    return format("joining %s as rank %d of %d", comm_->segment->name().c_str(), comm_->rank,
                  comm_->nranks);
  }

  std::string why_waiting() const override {
    return format("with %d of %d ranks there", comm_->segment->joined(), comm_->nranks);
  }

  void give_up(ncclResult_t code, const std::string& message) override {
    // Nobody else is coming: take the name away so the run leaves nothing behind.
    comm_->segment->unlink_name();
    comm_->broken = "communicator never completed: " + message;
    finish(code, message);
  }

 private:
  ncclComm* comm_;
};

struct ColorKey {
  int32_t color;
  int32_t key;
};

class Split final : public RoundOperation {
 public:
  Split(ncclComm* parent, int color, int key, ncclComm** newcomm)
      : RoundOperation(parent, split_shape()), mine_{color, key}, newcomm_(newcomm) {}

  bool progress() override {
    if (!exchanged_) {
      bool moved = RoundOperation::progress();
      if (!exchanged_ || done()) return moved;
      if (child_ == nullptr) {  // NCCL_SPLIT_NOCOLOR
        *newcomm_ = nullptr;
        finish(ncclSuccess);
        return true;
      }
    }
    if (done()) return false;
    bool moved = joined_->progress();
    if (joined_->done()) {
      if (joined_->result() == ncclSuccess) *newcomm_ = child_;
      finish(joined_->result(), joined_->error());
    }
    return moved;
  }

  Segment* awaited() const override {
    return exchanged_ && child_ != nullptr ? child_->segment.get() : RoundOperation::awaited();
  }

  std::string describe() const override {
    return exchanged_ && joined_ ? joined_->describe() : RoundOperation::describe();
  }

  std::string why_waiting() const override {
    return exchanged_ && joined_ ? joined_->why_waiting() : RoundOperation::why_waiting();
  }

  int awaited_rank() const override { return exchanged_ ? -1 : RoundOperation::awaited_rank(); }

  void give_up(ncclResult_t code, const std::string& message) override {
    if (!exchanged_ || !joined_) return RoundOperation::give_up(code, message);
    joined_->give_up(code, message);
    finish(code, message);
  }

 private:
  static OpDescriptor split_shape() {
    OpDescriptor d;
    d.kind = static_cast<int32_t>(OpKind::Split);
    return d;
  }

  uint64_t rounds() const override { return 1; }

  void publish(uint64_t, std::byte* slot) override { std::memcpy(slot, &mine_, sizeof mine_); }

  void consume(uint64_t) override {
    const uint64_t derivation = comm_->splits++;
    if (mine_.color == NCCL_SPLIT_NOCOLOR) return;
    // New ranks: members of my color ordered by (key, parent rank).
    std::vector<std::pair<ColorKey, int>> members;
    for (int r = 0; r < comm_->nranks; ++r) {
      ColorKey theirs;
      std::memcpy(&theirs, slot_of(r), sizeof theirs);
      if (theirs.color == mine_.color) members.push_back({theirs, r});
    }
    std::stable_sort(members.begin(), members.end(), [](const auto& a, const auto& b) {
      return a.first.key != b.first.key ? a.first.key < b.first.key : a.second < b.second;
    });
    int new_rank = 0;
    while (members[new_rank].second != comm_->rank) ++new_rank;
    child_name_ = child_segment_name(
        comm_->segment->name(),
        format("split %llu color %d", static_cast<unsigned long long>(derivation), mine_.color));
    child_nranks_ = static_cast<int>(members.size());
    child_rank_ = new_rank;
  }

  void rounds_complete() override {
    exchanged_ = true;
    if (mine_.color == NCCL_SPLIT_NOCOLOR) return;
    try {
      child_ = join_communicator(child_name_, child_nranks_, child_rank_, comm_->cuda_device);
    } catch (const Failure& f) {
      finish(f.code(), f.what());
      return;
    }
    joined_ = make_join_wait(child_);
  }

  ColorKey mine_;
  ncclComm** newcomm_;
  bool exchanged_ = false;
  std::string child_name_;
  int child_nranks_ = 0;
  int child_rank_ = 0;
  ncclComm* child_ = nullptr;
  std::unique_ptr<Operation> joined_;
};

}  // namespace

std::unique_ptr<Operation> make_join_wait(ncclComm* comm) {
  return std::make_unique<JoinWait>(comm);
}

std::unique_ptr<Operation> make_split(ncclComm* parent, int color, int key, ncclComm** newcomm) {
  return std::make_unique<Split>(parent, color, key, newcomm);
}

}  // namespace standin
