#include "tests/support/standin/rounds.h"

#include "tests/support/standin/elements.h"
#include "tests/support/standin/report.h"
#include "tests/support/standin/settings.h"

namespace standin {

void RoundOperation::launch() {
  ticket_ = comm_->collective_tickets++;
  // Splits take rounds but are not collectives in the user's numbering.
  shape_.seq = comm_->next_seq;
  if (static_cast<OpKind>(shape_.kind) != OpKind::Split) ++comm_->next_seq;
}

std::string RoundOperation::describe_shape(const OpDescriptor& d) const {
  const OpKind kind = static_cast<OpKind>(d.kind);
  std::string text = op_kind_name(kind);
  if (kind == OpKind::Split) return text;
  text +=
      format("(%s, count %llu", datatype_name(d.dtype), static_cast<unsigned long long>(d.count));
  if (d.root >= 0) text += format(", root %d", d.root);
  if (d.redop >= 0) text += format(", %s", redop_name(d.redop));
  return text + ")";
}

bool RoundOperation::progress() {
  Segment& segment = *comm_->segment;
  const int me = comm_->rank;
  bool moved = false;
  for (;;) {
    switch (stage_) {
      case Stage::AwaitTurn: {
        if (!comm_->broken.empty()) {
          stage_ = Stage::Finished;
          finish(ncclSystemError, comm_->broken);
          return true;
        }
        if (comm_->collective_turn != ticket_) return moved;
        base_ = comm_->rounds_done;
        round_ = 0;
        total_rounds_ = rounds();
        stage_ = Stage::Publish;
        moved = true;
        break;
      }
      case Stage::Publish: {
        const uint64_t round = base_ + round_;
        for (int r = 0; r < comm_->nranks; ++r) {
          if (segment.control(r).consumed.load(std::memory_order_acquire) < round) {
            waiting_for_ = r;
            return moved;
          }
        }
        RankControl& mine = segment.control(me);
        if (round_ == 0) mine.descriptor = shape_;
        publish(round_, slot_of(me));
        mine.posted.store(round + 1, std::memory_order_release);
        segment.ring();
        stage_ = Stage::Read;
        moved = true;
        break;
      }
      case Stage::Read: {
        const uint64_t round = base_ + round_;
        for (int r = 0; r < comm_->nranks; ++r) {
          if (segment.control(r).posted.load(std::memory_order_acquire) < round + 1) {
            waiting_for_ = r;
            return moved;
          }
        }
        if (round_ == 0 && !check_shapes()) return true;
        consume(round_);
        segment.control(me).consumed.store(round + 1, std::memory_order_release);
        comm_->rounds_done = round + 1;
        segment.ring();
        moved = true;
        if (++round_ == total_rounds_) {
          ++comm_->collective_turn;
          stage_ = Stage::Finished;
          rounds_complete();
          return true;
        }
        stage_ = Stage::Publish;
        break;
      }
      case Stage::Blocked:
      case Stage::Finished: return moved;
    }
  }
}

bool RoundOperation::check_shapes() {
  Segment& segment = *comm_->segment;
  const int me = comm_->rank;
  for (int r = 0; r < comm_->nranks; ++r) {
    const OpDescriptor& theirs = segment.control(r).descriptor;
    if (theirs.same_shape(shape_)) continue;
    const std::string message =
        format("rank %d: collective #%llu mismatch: rank %d calls %s, rank %d calls %s", me,
               static_cast<unsigned long long>(shape_.seq), me, describe_shape(shape_).c_str(), r,
               describe_shape(theirs).c_str());
    report("%s", message.c_str());
    if (Settings::get().mismatch == MismatchPolicy::Block) {
      // Like NCCL: the ranks wait for each other forever (or until STANDIN_TIMEOUT_S).
      stage_ = Stage::Blocked;
      return false;
    }
    // Every rank saw the same descriptors and gives up after this one round: still in step.
    const uint64_t round = base_ + round_;
    segment.control(me).consumed.store(round + 1, std::memory_order_release);
    comm_->rounds_done = round + 1;
    ++comm_->collective_turn;
    segment.ring();
    stage_ = Stage::Finished;
    finish(ncclInvalidUsage, message);
    return false;
  }
  return true;
}

std::string RoundOperation::describe() const {
  return format("%s (collective #%llu)", describe_shape(shape_).c_str(),
                static_cast<unsigned long long>(shape_.seq));
}

std::string RoundOperation::why_waiting() const {
  switch (stage_) {
    case Stage::AwaitTurn: return "behind an earlier operation";
    case Stage::Blocked: return "after a mismatch";
    default: return format("waiting for rank %d", waiting_for_);
  }
}

int RoundOperation::awaited_rank() const {
  return stage_ == Stage::Publish || stage_ == Stage::Read ? waiting_for_ : -1;
}

void RoundOperation::give_up(ncclResult_t code, const std::string& message) {
  comm_->broken = "communicator broken earlier: " + message;
  stage_ = Stage::Finished;
  finish(code, message);
}

}  // namespace standin
