#include "ce_transport/descriptor_offers.h"

#include <string>

#include "base/base.h"

namespace magi::ce {

exports::Exportable DescriptorOffers::offered(exports::Exportable e, MemoryOps& memory) {
  if (!e.ok || e.record.kind != ExportRecord::Kind::ByDescriptor) return e;
  try {
    const std::pair<uintptr_t, uint64_t> range{e.base, e.record.bytes};
    auto known = offered_.find(range);
    if (known == offered_.end()) {
      fd_channel::Offer offer = memory.descriptor_offer(e);
      if (server_ == nullptr) server_ = fd_channel::Server::start(identity_, rank_);
      known = offered_.emplace(range, server_->offer(std::move(offer))).first;
    }
    exports::set_descriptor_source(e.record, server_->address(), known->second);
  } catch (const Error& error) {
    e.ok = false;
    e.refusal = std::string(memory.offer_refusal()) + error.what();
  }
  return e;
}

void DescriptorOffers::allow(std::span<const pid_t> pids) {
  if (server_ != nullptr) server_->allow(pids);
}

void DescriptorOffers::stop() {
  if (server_ != nullptr) server_->stop();
  server_.reset();
  offered_.clear();
}

}  // namespace magi::ce
