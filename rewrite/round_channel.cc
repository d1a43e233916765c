#include "rewrite/round_channel.h"

#include <chrono>
#include <utility>
#include <vector>

#include "base/clock.h"

namespace magi::rewrite {

RoundChannel::RoundChannel(ncclComm_t comm, const capture::CommInfo& info,
                           const AgreementWorld& world, ExplorationPolicy& policy,
                           AgreementLog& log)
    : comm_(comm),
      info_(info),
      world_(world),
      backend_(world.options.backend),
      policy_(policy),
      log_(log),
      flush_(world.nccl, info.identity),
      buffers_(info.identity) {}

RoundChannel::~RoundChannel() {
  // A round still in flight belongs to NCCL until it completes: the pool frees only those that
  // did, and leaves the others (RoundBuffers).
  if (pending_) retire(*pending_);
}

Contribution RoundChannel::header(RoundKind kind, const RoundStamp& stamp) const {
  const Options& options = world_.options;
  Contribution c;
  ContributionHeader& h = c.header;
  h.magic = kContributionMagic;
  h.version = kContributionVersion;
  h.kind = static_cast<uint8_t>(kind);
  h.backend = static_cast<uint8_t>(backend_);
  h.rank = info_.rank;
  h.nranks = info_.nranks;
  h.step_digest = stamp.step_digest;
  h.period = stamp.period;
  if (options.dry_run) h.flags |= kDryRun;
  if (options.static_weights) h.flags |= kStaticWeights;
  switch (options.graph_slots) {
    case Options::GraphSlots::Always: h.flags |= kWantsGraphSlots; break;
    case Options::GraphSlots::Never: h.flags |= kRefusesGraphSlots; break;
    case Options::GraphSlots::Auto:
      if (saw_capture_) h.flags |= kWantsGraphSlots;
      break;
  }
  return c;
}

std::unique_ptr<Round> RoundChannel::issue(RoundKind kind, Contribution& c, uint64_t seq,
                                           const RoundStamp& stamp, size_t bytes_each) {
  const GroupView group = world_.group();
  const bool in_group = !GroupFlush::launches_now(group);
  if (in_group) {
    c.header.flags |= kIssuedInGroup;
    c.header.flags &= ~kCanServe;
  }
  c.header.round = policy_.rounds();
  auto round = std::make_unique<Round>();
  round->kind = kind;
  round->number = policy_.rounds();
  round->voted_no = in_group;
  round->decision_hash = c.header.decision_hash;
  round->bytes = bytes_each;
  round->read_at = seq + policy_.read_distance(kind, stamp.period);
  try {
    // Reused (RoundBuffers): made anew at every round, they would stall the program's streams.
    round->exchange =
        buffers_.take([&] { return world_.make.exchange(info_, bytes_each); }, bytes_each);
    std::vector<uint8_t> bytes(bytes_each);
    c.serialize(bytes);
    round->exchange->stage(bytes);
  } catch (const Error& e) {
    log_.cannot_prepare_round(e.what());
    return nullptr;
  }
  ce::Exchange& exchange = *round->exchange;
  const ncclResult_t result = flush_.issue_alone(group, [&] {
    return world_.nccl.all_gather(exchange.send_buffer(), exchange.recv_buffer(), bytes_each,
                                  ncclUint8, comm_, static_cast<cudaStream_t>(exchange.stream()));
  });
  if (result != ncclSuccess && result != ncclInProgress) {
    log_.nccl_refused_round(static_cast<int>(result));
    return nullptr;
  }
  exchange.issued();
  policy_.count_round_issued();
  record(stamp, kind, trace::RoundEvent::Issued, seq, AgreementMode::None, Reason::None, 0);
  return round;
}

std::span<const uint8_t> RoundChannel::read(Round& round) {
  const uint64_t asked = clock_ns();
  const std::span<const uint8_t> all = round.exchange->result();
  policy_.count_round_wait(clock_ns() - asked);
  return all;
}

bool RoundChannel::exchange_at_capture(RoundKind kind, Contribution& c, uint64_t seq,
                                       const RoundStamp& stamp, size_t bytes_each,
                                       std::vector<uint8_t>& all) {
  if (!board_gone_.empty()) return false;
  c.header.round = policy_.rounds();
  std::vector<uint8_t> bytes(bytes_each);
  ce::BoardRound round;
  try {
    if (!board_) {
      if (!world_.make.board) throw Error(ErrorKind::Internal, "no board in this process");
      board_ = world_.make.board(info_);
    }
    c.serialize(bytes);
    policy_.count_round_issued();
    record(stamp, kind, trace::RoundEvent::Issued, seq, AgreementMode::None, Reason::None, 0);
    const uint64_t asked = clock_ns();
    round = board_->exchange(bytes, std::chrono::milliseconds(world_.options.capture_wait_ms));
    policy_.count_round_wait(clock_ns() - asked);
  } catch (const Error& e) {
    round.outcome = ce::BoardRound::Outcome::Abandoned;
    round.why = e.what();
  }
  if (round.outcome == ce::BoardRound::Outcome::Agreed &&
      round.all.size() == bytes_each * static_cast<size_t>(info_.nranks)) {
    all = std::move(round.all);
    return true;
  }
  board_gone_ = round.why.empty() ? "the board's answer has the wrong size" : round.why;
  record(stamp, kind, trace::RoundEvent::Abandoned, seq, AgreementMode::None,
         Reason::CaptureAbandoned, 0);
  return false;
}

void RoundChannel::record(const RoundStamp& stamp, RoundKind kind, trace::RoundEvent event,
                          uint64_t seq, AgreementMode mode, Reason reason, uint32_t moved) const {
  record_round(world_.trace, stamp, kind, event, seq, mode, reason, moved);
}

}  // namespace magi::rewrite
