// The buffers of one communicator's agreement rounds, reused from round to round.
//
// Making a round's buffers, and freeing them (which waits for the whole device), at every round
// would stall the program's streams each time: a read round's buffers become the spare, which
// the next round takes. A round's all-gather belongs to NCCL until it completes, so the buffers
// of a round whose result nobody needs (abandoned, voted no, left at the communicator's end) are
// retired, and freed (or kept as the spare) only once ready. One still in flight when the pool is
// destroyed is left allocated, never waited for: it may never launch (a group left open).
// Buffers are kept by size: the standard contribution's, and one larger size (a static plan's
// publish round, publish_round_bytes), whose buffers the next publish of the same size reuses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "base/free_later.h"
#include "ce_transport/ce_transport.h"
#include "rewrite/contribution.h"

namespace magi::rewrite {

class RoundBuffers {
 public:
  // `comm_identity`: the communicator's, for the warning about a round left in flight.
  explicit RoundBuffers(uint64_t comm_identity) : comm_identity_(comm_identity) {}
  ~RoundBuffers();
  RoundBuffers(const RoundBuffers&) = delete;
  RoundBuffers& operator=(const RoundBuffers&) = delete;

  // Buffers for a round of `bytes` per contribution about to be issued: the spare of that size,
  // else `make()`'s (which may throw).
  template <typename Make>
  std::unique_ptr<ce::Exchange> take(Make&& make, size_t bytes = kContributionBytes) {
    std::unique_ptr<ce::Exchange>& spare = spare_for(bytes);
    return spare && spare_bytes(bytes) == bytes ? std::move(spare) : make();
  }
  // Buffers of a round whose result nobody needs (none: nothing to do).
  void retire(std::unique_ptr<ce::Exchange> exchange, size_t bytes = kContributionBytes);
  bool any_retired() const { return !retired_.empty(); }
  // Frees the retired rounds that completed, the first of each size kept as its spare if there
  // is none.
  void free_ready();
  // A round read: its buffers become the spare of their size if there is none, else stay
  // `used`'s. A larger round's replace the larger spare of another size (freed here).
  void keep_spare(std::unique_ptr<ce::Exchange>& used, size_t bytes = kContributionBytes);
  // keep_spare(used) once the round's result has been used, whatever path its reading takes (a
  // reading that issues the next round takes the spare first).
  class KeepWhenRead {
   public:
    KeepWhenRead(RoundBuffers& buffers, std::unique_ptr<ce::Exchange>& used,
                 size_t bytes = kContributionBytes)
        : buffers_(buffers), used_(used), bytes_(bytes) {}
    ~KeepWhenRead() { buffers_.keep_spare(used_, bytes_); }
    KeepWhenRead(const KeepWhenRead&) = delete;
    KeepWhenRead& operator=(const KeepWhenRead&) = delete;

   private:
    RoundBuffers& buffers_;
    std::unique_ptr<ce::Exchange>& used_;
    size_t bytes_;
  };

 private:
  struct Retired {
    std::unique_ptr<ce::Exchange> exchange;
    size_t bytes;
  };
  std::unique_ptr<ce::Exchange>& spare_for(size_t bytes) {
    return bytes == kContributionBytes ? spare_ : large_spare_;
  }
  size_t spare_bytes(size_t bytes) const {
    return bytes == kContributionBytes ? kContributionBytes : large_spare_bytes_;
  }

  const uint64_t comm_identity_;
  FreeLater<Retired> retired_;                 // rounds whose result nobody needs
  std::unique_ptr<ce::Exchange> spare_;        // a read round's buffers, for the next
  std::unique_ptr<ce::Exchange> large_spare_;  // the same, of a larger round
  size_t large_spare_bytes_ = 0;
};

}  // namespace magi::rewrite
