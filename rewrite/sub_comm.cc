#include "rewrite/sub_comm.h"

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "base/base.h"

namespace magi::rewrite {
namespace {

std::string failed(const char* what, ncclResult_t r) {
  return std::string(what) + " failed (ncclResult_t " + std::to_string(static_cast<int>(r)) + ")";
}

}  // namespace

SubComm::~SubComm() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (comm_ == nullptr || aborted_) return;
  if (formed_.load() && nccl_.comm_destroy != nullptr)
    (void)nccl_.comm_destroy(comm_);
  else if (nccl_.comm_abort != nullptr)
    (void)nccl_.comm_abort(comm_);
}

std::vector<uint8_t> SubComm::make_id() const {
  if (nccl_.get_unique_id == nullptr)
    throw Error(ErrorKind::System, "the real NCCL has no ncclGetUniqueId");
  ncclUniqueId id{};
  if (const ncclResult_t r = nccl_.get_unique_id(&id); r != ncclSuccess)
    throw Error(ErrorKind::System, failed("ncclGetUniqueId", r));
  const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
  return std::vector<uint8_t>(bytes, bytes + sizeof(id));
}

void SubComm::form(std::span<const uint8_t> id, int nranks, int rank, bool fail) {
  if (nccl_.comm_init_rank_config == nullptr || nccl_.comm_get_async_error == nullptr)
    throw Error(ErrorKind::System, "the real NCCL has no non-blocking ncclCommInitRankConfig");
  ncclUniqueId uid{};
  if (id.size() != sizeof(uid))
    throw Error(ErrorKind::Internal, "the publish carried no sub-communicator id");
  std::memcpy(&uid, id.data(), sizeof(uid));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // polled below, so that a dropped plan stops waiting for its peers
  ncclComm_t made = nullptr;
  ncclResult_t r = nccl_.comm_init_rank_config(&made, nranks, uid, rank, &config);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    comm_ = made;
  }
  while (r == ncclInProgress && !cancelled_.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (const ncclResult_t asked = nccl_.comm_get_async_error(made, &r); asked != ncclSuccess)
      r = asked;
  }
  if (r == ncclSuccess && !fail && !cancelled_.load()) {
    formed_.store(true, std::memory_order_release);
    return;
  }
  {  // what began is ended here: aborted, as NCCL ends a communicator that did not form
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm_ != nullptr && !aborted_ && nccl_.comm_abort != nullptr) (void)nccl_.comm_abort(comm_);
    aborted_ = true;
  }
  if (fail) throw Error(ErrorKind::System, "sub-communicator: injected by MAGI_INJECT_FAULT");
  if (r == ncclSuccess || r == ncclInProgress)
    throw Error(ErrorKind::Usage, "the sub-communicator's plan was dropped while it formed");
  throw Error(ErrorKind::System, failed("ncclCommInitRankConfig of the sub-communicator", r));
}

void SubComm::cancel(bool abort) noexcept {
  cancelled_.store(true);
  if (!abort) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!formed_.load() || comm_ == nullptr || aborted_ || nccl_.comm_abort == nullptr) return;
  (void)nccl_.comm_abort(comm_);
  aborted_ = true;
}

}  // namespace magi::rewrite
