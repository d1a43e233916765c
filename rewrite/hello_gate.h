// The hello gate of one communicator: its hello round (rewrite/hello.h) owed at the first
// collective not captured into a graph, in flight until read, and read where the first other
// round comes due, before that round is issued (rewrite/agreement.h says why that keeps every
// round from meeting a program's call). A rank that takes no part issues the hello too, never
// waits for it, and only looks at it once complete, to say why its peers stay on NCCL.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include "capture/capture.h"
#include "rewrite/agreement_log.h"
#include "rewrite/hello.h"
#include "rewrite/round_channel.h"

namespace magi::rewrite {

class HelloGate {
 public:
  // `can_issue`: the real NCCL's all-gather is at hand.
  HelloGate(const capture::CommInfo& info, const Options& options, bool can_issue,
            const AgreementLog& log);

  // Why this communicator never explores, by facts every rank shares (so no rank owes a hello
  // either); Reason::None if it may.
  Reason never() const { return never_; }
  // Whether the hello is owed by this rank at its first collective not captured.
  bool owed() const { return state_ == State::Owed; }
  // Whether this rank takes part by its own settings (the hello may still say no).
  bool takes_part() const { return takes_part_; }

  // At each collective of the communicator (`seq`): once, why a communicator that never explores
  // does not, for the trace (a Hello Read record); else Reason::None.
  Reason at_collective(uint64_t seq) {
    last_seq_ = seq;
    return quiet_ == Reason::None ? Reason::None : std::exchange(quiet_, Reason::None);
  }
  // Issues the hello (owed() only). False: this rank takes no part from here (it could not
  // issue it, or issued it inside a group holding Send/Recv: said, and every rank reads that).
  // `host`: where this rank runs (ce::Locality::host), carried for one_host().
  bool issue(RoundChannel& channel, const RoundStamp& stamp, uint64_t seq, uint64_t host);
  // Before this rank's first other round: waits for the hello if it is in flight (every rank
  // launched it at the first collective, so it completes). False: no round, ever.
  bool read(RoundChannel& channel, const RoundStamp& stamp, uint64_t seq);
  // A rank that takes no part: reads the hello once complete, only to say why the peers stay
  // on NCCL too; never waits. Recorded at the latest collective (at_collective's).
  void look(RoundChannel& channel, const RoundStamp& stamp);
  bool in_flight() const { return round_ != nullptr; }
  // Read and agreed: every rank's settings alike, and each took part.
  bool agreed() const { return agreed_; }
  // Read and agreed, and every rank runs on this host (rounds at a graph capture need it).
  bool one_host() const { return agreed_ && one_host_; }
  // Whether the settings that decide who takes part in a round at a graph capture are alike on
  // every rank (HelloOutcome::capture_alike); else why not.
  bool capture_alike() const { return agreed_ && capture_why_.empty(); }
  const std::string& capture_why() const { return capture_why_; }
  // The communicator ends: a hello still in flight is retired (RoundBuffers).
  void end(RoundChannel& channel);

 private:
  enum class State : uint8_t { None, Owed, Issued };
  // What every rank read: recorded, and where not agreed, said. Returns hello.agreed.
  bool take(const HelloOutcome& hello, const RoundChannel& channel, const RoundStamp& stamp,
            uint64_t seq);

  const ScheduleSettings settings_;
  const int nranks_;
  const AgreementLog& log_;
  Reason never_ = Reason::None;
  Reason quiet_ = Reason::None;  // said in the trace at the first collective (None: said)
  State state_ = State::None;
  bool takes_part_ = false;
  bool agreed_ = false;
  bool one_host_ = false;
  std::string capture_why_;
  uint64_t last_seq_ = 0;  // the latest collective's index
  std::unique_ptr<Round> round_;
};

}  // namespace magi::rewrite
