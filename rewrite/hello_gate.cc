#include "rewrite/hello_gate.h"

#include <utility>

#include "rewrite/exploration.h"

namespace magi::rewrite {
namespace {

// Why a communicator can never take part in agreement, by facts of the program that every rank
// shares (so every rank stays out alike, hello included); Reason::None if it can.
Reason unagreeable(const capture::CommInfo& info) {
  // ncclCommInitAll puts every rank in this process, driven from one thread in groups: a round
  // would need every rank's contribution from that thread at once. Unknown communicators were
  // created before the shim saw them and have no identity shared with their peers.
  if (info.origin == capture::CommOrigin::InitAll || info.origin == capture::CommOrigin::Unknown)
    return Reason::CommNotAgreeable;
  if (info.rank < 0 || info.nranks < 1 || info.rank >= info.nranks) return Reason::CommNotAgreeable;
  // A non-blocking communicator may not even have enqueued a round's all-gather when the call
  // returns (ncclInProgress): a round could not be waited for safely. Every rank created it
  // with the same config, so every rank stays out alike.
  if (info.nonblocking) return Reason::CommNotAgreeable;
  return Reason::None;
}

}  // namespace

HelloGate::HelloGate(const capture::CommInfo& info, const Options& options, bool can_issue,
                     const AgreementLog& log)
    : settings_(schedule_settings(options, ce::backend_available(options.backend))),
      nranks_(info.nranks),
      log_(log) {
  never_ = unagreeable(info) == Reason::None
               ? ExplorationPolicy::never_explores(options, info.nranks)
               : Reason::CommNotAgreeable;
  if (never_ == Reason::None && can_issue) state_ = State::Owed;
  takes_part_ = owed() && rewrite::takes_part(settings_);
  if (never_ == Reason::SingleRank) quiet_ = never_;
}

// Before any other round (no propose is issued before the first collective not captured), so
// the issued round's number and the decision's are both 0: one stamp serves both records.
bool HelloGate::issue(RoundChannel& channel, const RoundStamp& stamp, uint64_t seq, uint64_t host) {
  state_ = State::Issued;
  Contribution c = channel.header(RoundKind::Hello, stamp);
  ScheduleSettings settings = settings_;
  settings.host = host;
  c.table = hello_payload(settings);
  c.header.table_bytes = static_cast<uint32_t>(c.table.size());
  round_ = channel.issue(RoundKind::Hello, c, seq, stamp);
  if (!round_) return false;
  if (!round_->voted_no) return true;
  channel.retire(*round_);
  round_.reset();
  return take({false,
               Reason::AnchorInGroup,
               "this rank made the settings check inside a group holding Send/Recv: this "
               "communicator stays on NCCL on every rank",
               false,
               false,
               {}},
              channel, stamp, seq);
}

bool HelloGate::read(RoundChannel& channel, const RoundStamp& stamp, uint64_t seq) {
  if (!round_) return true;
  const std::unique_ptr<Round> round = std::move(round_);
  const HelloOutcome hello = read_hello(channel.read(*round), nranks_);
  channel.keep(*round);
  agreed_ = take(hello, channel, stamp, seq);
  one_host_ = hello.one_host;
  capture_why_ = hello.capture_why;
  return agreed_;
}

void HelloGate::look(RoundChannel& channel, const RoundStamp& stamp) {
  if (!round_ || !round_->exchange->ready()) return;
  const std::unique_ptr<Round> round = std::move(round_);
  const HelloOutcome hello = read_hello(round->exchange->result(), nranks_);
  channel.keep(*round);
  if (hello.reason == Reason::SettingsDiffer) take(hello, channel, stamp, last_seq_);
}

void HelloGate::end(RoundChannel& channel) {
  if (round_) channel.retire(*round_);
  round_.reset();
}

bool HelloGate::take(const HelloOutcome& hello, const RoundChannel& channel,
                     const RoundStamp& stamp, uint64_t seq) {
  channel.record(stamp, RoundKind::Hello, trace::RoundEvent::Read, seq, AgreementMode::None,
                 hello.reason, 0);
  if (hello.agreed) return true;
  log_.hello_refused(hello.why, hello.reason == Reason::SettingsDiffer && first_settings_warning());
  return false;
}

}  // namespace magi::rewrite
