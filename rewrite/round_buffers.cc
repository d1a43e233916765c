#include "rewrite/round_buffers.h"

#include "base/base.h"

namespace magi::rewrite {

RoundBuffers::~RoundBuffers() {
  // A finished round is freed with the pool; one still in flight belongs to NCCL.
  for (auto& exchange : retired_) {
    if (exchange && !exchange->ready()) {
      MAGI_WARN(Rewrite,
                "comm %012llx: an agreement round was still in flight at destroy; its "
                "buffers are left allocated",
                short_id(comm_identity_));
      exchange.release();
    }
  }
}

void RoundBuffers::retire(std::unique_ptr<ce::Exchange> exchange) {
  if (exchange) retired_.push_back(std::move(exchange));
}

void RoundBuffers::free_ready() {
  for (auto it = retired_.begin(); it != retired_.end();) {
    if (!(*it)->ready()) {
      ++it;
      continue;
    }
    if (!spare_) spare_ = std::move(*it);
    it = retired_.erase(it);
  }
}

}  // namespace magi::rewrite
