// What a communicator's agreement reaches outside itself, handed in rather than read from
// globals: the options, the real NCCL, where transports, round buffers and timers come from, the
// calling thread's group, and the trace. production_world() builds the real one; unit tests build
// one of fakes and play every rank of a round in one process.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "base/base.h"
#include "capture/capture.h"
#include "ce_transport/ce_transport.h"
#include "rewrite/rewrite.h"

namespace magi::rewrite {

// The calling thread's open NCCL group (capture/ keeps it), as a round about to be issued sees it.
struct GroupView {
  int depth = 0;                      // ncclGroupStart nesting; 0: no group open
  bool holds_point_to_point = false;  // the open group holds a Send or Recv so far
  uint32_t calls = 0;                 // calls the open group holds so far, the current one included
};

// Makes what one communicator's agreement allocates: its transport (per agreed plan), its round
// buffers and the cost trial's timers; and says where this process runs (for a propose). The
// backend is the factory's. Each may throw magi::Error.
struct TransportFactory {
  std::function<std::unique_ptr<ce::Transport>(const capture::CommInfo& info)> transport;
  // Round buffers for contributions of `bytes` each.
  std::function<std::unique_ptr<ce::Exchange>(const capture::CommInfo& info, size_t bytes)>
      exchange;
  std::function<std::unique_ptr<ce::CompletionTimer>()> timer;
  std::function<ce::Locality(const capture::CommInfo& info)> locality;
  // The board of rounds at a graph capture (ce::RoundBoard), opened at the first such round;
  // empty: no rounds at capture.
  std::function<std::unique_ptr<ce::RoundBoard>(const capture::CommInfo& info)> board;
  // What opening one peer's window or exported allocation takes, for choosing whether a plan's
  // set-up runs at the call or off it (rewrite/set_up.h).
  uint64_t mapping_ns = 0;
  // What finding and exporting one allocation holding a shard takes (the owner's side).
  uint64_t export_ns = 0;
};

using TraceSink = std::function<void(trace::RecordType type, const void* payload, uint32_t bytes)>;

struct AgreementWorld {
  const Options& options;
  RealNcclCalls nccl;
  TransportFactory make;
  std::function<GroupView()> group;
  TraceSink trace;
};

// The process's world: Options::get(), ce_transport/'s factories, capture/'s group state and trace.
AgreementWorld production_world(const RealNcclCalls& nccl);

}  // namespace magi::rewrite
