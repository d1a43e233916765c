// A window's exports by descriptor (fd_channel.h), offered once per range on a channel of the
// window's own, started at the first: the same for every kind of memory, which only makes what
// an offer hands (MemoryOps::descriptor_offer). Private to ce_transport/.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <utility>

#include "ce_transport/exports.h"
#include "ce_transport/fd_channel.h"
#include "ce_transport/memory_ops.h"

namespace magi::ce {

class DescriptorOffers {
 public:
  DescriptorOffers(uint64_t identity, int rank) : identity_(identity), rank_(rank) {}

  // `e`, as find_export gave it: an export by descriptor is offered (once per range: a plan's
  // shards may share one), and its record says where to ask; one that cannot be offered is
  // refused, with the reason (the shard is then bound). Anything else as it is.
  exports::Exportable offered(exports::Exportable e, MemoryOps& memory);
  // The peers' processes, known at attach before any import: the only ones the descriptors are
  // handed to (a request that comes first waits for them).
  void allow(std::span<const pid_t> pids);
  // The channel stops, before what its offers were made from goes (MemoryOps::end_offers()):
  // no descriptor is made from a closed file or a released handle.
  void stop();

 private:
  const uint64_t identity_;
  const int rank_;
  std::unique_ptr<fd_channel::Server> server_;
  std::map<std::pair<uintptr_t, uint64_t>, uint32_t> offered_;  // by range: the offer
};

}  // namespace magi::ce
