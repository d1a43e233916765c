// The agreement-round buffers of the host backend: the NCCL it talks to (the stand-in) reads and
// writes host memory and has completed the all-gather when the call returns.
#include <cstring>
#include <string>
#include <vector>

#include "base/base.h"
#include "ce_transport/backends.h"

namespace magi::ce {
namespace {

class HostExchange final : public Exchange {
 public:
  HostExchange(size_t contribution_bytes, int nranks)
      : send_(contribution_bytes), recv_(contribution_bytes * static_cast<size_t>(nranks)) {
    if (nranks < 1)
      throw Error(ErrorKind::Usage, "an exchange of " + std::to_string(nranks) + " ranks");
  }

  void* send_buffer() override { return send_.data(); }
  void* recv_buffer() override { return recv_.data(); }
  void* stream() override { return nullptr; }

  void stage(std::span<const uint8_t> contribution) override {
    if (contribution.size() != send_.size())
      throw Error(ErrorKind::Internal, "a contribution of " + std::to_string(contribution.size()) +
                                           " bytes for an exchange of " +
                                           std::to_string(send_.size()));
    if (!contribution.empty()) std::memcpy(send_.data(), contribution.data(), contribution.size());
    issued_ = false;
  }
  void issued() override { issued_ = true; }
  bool ready() override { return issued_; }
  std::span<const uint8_t> result() override {
    if (!issued_)
      throw Error(ErrorKind::Internal, "exchange result asked before the all-gather was issued");
    return recv_;
  }

 private:
  std::vector<uint8_t> send_, recv_;
  bool issued_ = false;
};

}  // namespace

std::unique_ptr<Exchange> make_host_exchange(size_t contribution_bytes, int nranks) {
  return std::make_unique<HostExchange>(contribution_bytes, nranks);
}

}  // namespace magi::ce
