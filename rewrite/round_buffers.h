// The buffers of one communicator's agreement rounds, reused from round to round.
//
// Making a round's buffers, and freeing them (which waits for the whole device), at every round
// would stall the program's streams each time: a read round's buffers become the spare, which
// the next round takes. A round's all-gather belongs to NCCL until it completes, so the buffers
// of a round whose result nobody needs (abandoned, voted no, left at the communicator's end) are
// retired, and freed (or kept as the spare) only once ready. One still in flight when the pool is
// destroyed is left allocated, never waited for: it may never launch (a group left open).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ce_transport/ce_transport.h"

namespace magi::rewrite {

class RoundBuffers {
 public:
  // `comm_identity`: the communicator's, for the warning about a round left in flight.
  explicit RoundBuffers(uint64_t comm_identity) : comm_identity_(comm_identity) {}
  ~RoundBuffers();
  RoundBuffers(const RoundBuffers&) = delete;
  RoundBuffers& operator=(const RoundBuffers&) = delete;

  // Buffers for a round about to be issued: the spare, else `make()`'s (which may throw).
  template <typename Make>
  std::unique_ptr<ce::Exchange> take(Make&& make) {
    return spare_ ? std::move(spare_) : make();
  }
  // Buffers of a round whose result nobody needs (none: nothing to do).
  void retire(std::unique_ptr<ce::Exchange> exchange);
  bool any_retired() const { return !retired_.empty(); }
  // Frees the retired rounds that completed, the first kept as the spare if there is none.
  void free_ready();
  // A round read: its buffers become the spare if there is none, else stay `used`'s.
  void keep_spare(std::unique_ptr<ce::Exchange>& used) {
    if (!spare_) spare_ = std::move(used);
  }
  // keep_spare(used) once the round's result has been used, whatever path its reading takes (a
  // reading that issues the next round takes the spare first).
  class KeepWhenRead {
   public:
    KeepWhenRead(RoundBuffers& buffers, std::unique_ptr<ce::Exchange>& used)
        : buffers_(buffers), used_(used) {}
    ~KeepWhenRead() { buffers_.keep_spare(used_); }
    KeepWhenRead(const KeepWhenRead&) = delete;
    KeepWhenRead& operator=(const KeepWhenRead&) = delete;

   private:
    RoundBuffers& buffers_;
    std::unique_ptr<ce::Exchange>& used_;
  };

 private:
  const uint64_t comm_identity_;
  std::vector<std::unique_ptr<ce::Exchange>> retired_;  // rounds whose result nobody needs
  std::unique_ptr<ce::Exchange> spare_;                 // a read round's buffers, for the next
};

}  // namespace magi::rewrite
