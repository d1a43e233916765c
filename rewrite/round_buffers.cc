#include "rewrite/round_buffers.h"

#include "base/base.h"

namespace magi::rewrite {

RoundBuffers::~RoundBuffers() {
  // A finished round is freed with the pool; one still in flight belongs to NCCL.
  for (auto& [exchange, bytes] : retired_.take_all()) {
    if (exchange && !exchange->ready()) {
      MAGI_WARN(Rewrite,
                "comm %012llx: an agreement round was still in flight at destroy; its "
                "buffers are left allocated",
                short_id(comm_identity_));
      exchange.release();
    }
  }
}

void RoundBuffers::retire(std::unique_ptr<ce::Exchange> exchange, size_t bytes) {
  if (exchange) retired_.add({std::move(exchange), bytes});
}

void RoundBuffers::free_ready() {
  retired_.free_ready([](Retired& round) { return round.exchange->ready(); },
                      [&](Retired round) {
                        std::unique_ptr<ce::Exchange>& spare = spare_for(round.bytes);
                        if (spare) return;  // freed here
                        spare = std::move(round.exchange);
                        if (round.bytes != kContributionBytes) large_spare_bytes_ = round.bytes;
                      });
}

void RoundBuffers::keep_spare(std::unique_ptr<ce::Exchange>& used, size_t bytes) {
  if (!used) return;
  if (bytes == kContributionBytes) {
    if (!spare_) spare_ = std::move(used);
    return;
  }
  if (large_spare_ && large_spare_bytes_ == bytes) return;
  large_spare_ = std::move(used);  // a plan of another size: the older buffers go
  large_spare_bytes_ = bytes;
}

}  // namespace magi::rewrite
