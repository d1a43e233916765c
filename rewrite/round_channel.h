// The channel of one communicator's agreement rounds: a contribution's header, the round's
// all-gather issued through the real NCCL outside the program's open group (GroupFlush) with
// reused buffers (RoundBuffers), the round in flight, its result read, and its trace records.
// What a round says and when it comes are the coordinator's (CommAgreement); how it travels is
// this channel's.
#pragma once

#include <nccl.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rewrite/agreement_log.h"
#include "rewrite/contribution.h"
#include "rewrite/exploration.h"
#include "rewrite/group_flush.h"
#include "rewrite/round_buffers.h"
#include "rewrite/round_log.h"
#include "rewrite/world.h"

namespace magi::rewrite {

// One round issued and not yet read.
struct Round {
  RoundKind kind = RoundKind::Propose;
  uint32_t number = 0;
  std::unique_ptr<ce::Exchange> exchange;
  size_t bytes = kContributionBytes;  // per contribution (a static plan's publish: more)
  bool voted_no = false;              // issued inside an open group: this rank said no
  uint64_t decision_hash = 0;         // publish/confirm
  // The collective index it is read at (ExplorationPolicy::read_distance after its issue): the
  // same call on every rank.
  uint64_t read_at = 0;
};

class RoundChannel {
 public:
  // `policy` counts the rounds issued and the host's waits for them.
  RoundChannel(ncclComm_t comm, const capture::CommInfo& info, const AgreementWorld& world,
               ExplorationPolicy& policy, AgreementLog& log);
  ~RoundChannel();
  RoundChannel(const RoundChannel&) = delete;
  RoundChannel& operator=(const RoundChannel&) = delete;

  ncclComm_t comm() const { return comm_; }
  ce::Backend backend() const { return backend_; }

  // A gather of the communicator was captured into a CUDA graph: under MAGI_GRAPH_SLOTS=auto,
  // every header from here asks for graph slots.
  void saw_capture() { saw_capture_ = true; }
  // A contribution of `kind` with this rank's header facts, for the step of `stamp` (its digest
  // and period).
  Contribution header(RoundKind kind, const RoundStamp& stamp) const;

  // Issues `c` as round number policy.rounds() (`bytes_each`: the contribution size, equal on
  // every rank) at collective `seq`, to be read at the policy's distance for the step of
  // `stamp`, and records it with `stamp`. A round that cannot launch now (it sits in a group
  // holding Send/Recv until that group ends) is never waited for: this rank votes no in it
  // (voted_no). Null when it could not be issued (said): the communicator must take no part from
  // here.
  std::unique_ptr<Round> issue(RoundKind kind, Contribution& c, uint64_t seq,
                               const RoundStamp& stamp, size_t bytes_each = kContributionBytes);
  // Every rank's contribution, waiting for them if the round is still in flight (counted).
  std::span<const uint8_t> read(Round& round);

  // A round at a CUDA graph capture: `c` (round number policy.rounds(), `bytes_each` equal on
  // every rank) exchanged through the board rather than NCCL, issued and read at once (so both
  // records carry `seq`). Every rank's contributions into `all`; false (said, and recorded
  // Abandoned) when the round was abandoned, with the same outcome on every rank that took part:
  // the communicator takes no more rounds at capture. Opens the board at the first round.
  bool exchange_at_capture(RoundKind kind, Contribution& c, uint64_t seq, const RoundStamp& stamp,
                           size_t bytes_each, std::vector<uint8_t>& all);
  // Why the board was refused or abandoned ("": it was not).
  const std::string& board_gone() const { return board_gone_; }

  // The round waiting to be read (one at most; the hello is kept apart).
  bool pending() const { return pending_ != nullptr; }
  // The round waiting is to be read at collective `seq`, or was due before (a call skipped, as a
  // captured one is, on every rank alike).
  bool due(uint64_t seq) const { return pending_ != nullptr && seq >= pending_->read_at; }
  void pend(std::unique_ptr<Round> round) { pending_ = std::move(round); }
  std::unique_ptr<Round> take_pending() { return std::move(pending_); }

  // A round nobody reads (abandoned, voted no): its buffers are freed once it completes.
  void retire(Round& round) { buffers_.retire(std::move(round.exchange), round.bytes); }
  // A round read: its buffers serve the next one.
  void keep(Round& round) { buffers_.keep_spare(round.exchange, round.bytes); }
  // Frees the retired rounds that completed (never at a captured call: the event queries would
  // be refused there, and could end the program's capture).
  bool any_retired() const { return buffers_.any_retired(); }
  void free_ready() { buffers_.free_ready(); }
  // For a reading that may issue the next round before it ends (RoundBuffers::KeepWhenRead).
  RoundBuffers& buffers() { return buffers_; }

  // An Agreement record of this communicator.
  void record(const RoundStamp& stamp, RoundKind kind, trace::RoundEvent event, uint64_t seq,
              AgreementMode mode, Reason reason, uint32_t moved) const;

 private:
  const ncclComm_t comm_;
  const capture::CommInfo& info_;
  const AgreementWorld& world_;
  const ce::Backend backend_;
  ExplorationPolicy& policy_;
  AgreementLog& log_;
  GroupFlush flush_;
  RoundBuffers buffers_;  // the rounds' buffers, reused
  std::unique_ptr<Round> pending_;
  std::unique_ptr<ce::RoundBoard> board_;  // rounds at a graph capture
  std::string board_gone_;
  bool saw_capture_ = false;
};

}  // namespace magi::rewrite
