// When a static binding is checked against the shard it was copied from (both backends).
// Private to ce_transport/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>

#include "ce_transport/ce_transport.h"

namespace magi::ce {

// A check is due on each of a binding's first `first` calls and then every `every` calls (0:
// never after the first). It never runs on a call the cost trial times: its copies and its
// comparison would count as the transport's cost, and the trial would send a static gather back
// to NCCL for the checking, not the gathering. A check due then is owed to the binding's next
// untimed call (each one owed runs, one a call), as is one the backend cannot start yet (owe()).
// At most max(first, 1) are owed at once: a check looks at the shard as it is now, so a backlog
// of them would only repeat the same look.
class VerifySchedule {
 public:
  void reset(uint64_t first, uint64_t every) {
    first_ = first;
    every_ = every;
    bindings_.clear();
  }

  // Counts one call of the binding at `slot_offset`; true when its check should run now.
  bool on_call(size_t slot_offset, Transport::Timing timing) {
    Binding& b = bindings_[slot_offset];
    ++b.calls;
    if (b.calls <= first_ || (every_ != 0 && b.calls % every_ == 0)) owe(b);
    if (b.owed == 0 || timing == Transport::Timing::Timed) return false;
    --b.owed;
    return true;
  }
  // A check owed now, before on_call: the one on_call asked for could not start, or the caller
  // knows the binding's source changed (GatherOp::verify_now). It runs at the binding's next
  // untimed call, this one if untimed.
  void owe(size_t slot_offset) { owe(bindings_[slot_offset]); }
  // A check of the binding starts now: its ordinal among the binding's checks, from 0 (which
  // sweep set it compares: sample_plan.h).
  uint64_t begin_check(size_t slot_offset) { return bindings_[slot_offset].checks++; }

 private:
  struct Binding {
    uint64_t calls = 0;
    uint64_t owed = 0;
    uint64_t checks = 0;
  };
  void owe(Binding& b) const {
    if (b.owed < (first_ > 1 ? first_ : 1)) ++b.owed;
  }
  uint64_t first_ = 0;
  uint64_t every_ = 0;
  std::map<size_t, Binding> bindings_;
};

}  // namespace magi::ce
