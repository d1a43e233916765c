#include "tests/support/standin/comm.h"

#include "tests/support/standin/operation.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "tests/support/standin/report.h"
#include "tests/support/standin/settings.h"

namespace standin {
namespace {

std::string hex(const unsigned char* bytes, size_t n) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += digits[bytes[i] >> 4];
    out += digits[bytes[i] & 15];
  }
  return out;
}

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

ncclComm* join_communicator(const std::string& segment_name, int nranks, int rank,
                            int cuda_device) {
  const Settings& settings = Settings::get();
  auto comm = std::make_unique<ncclComm>();
  comm->segment = Segment::attach(segment_name, nranks, settings.slot_bytes, settings.timeout_s);
  if (!comm->segment->claim(rank)) {
    throw Failure(ncclInvalidUsage, format("rank %d of communicator %s was already taken", rank,
                                           segment_name.c_str()));
  }
  comm->rank = rank;
  comm->nranks = nranks;
  comm->cuda_device = cuda_device;
  const size_t n = static_cast<size_t>(nranks);
  for (auto* v : {&comm->send_tickets, &comm->send_turn, &comm->recv_tickets, &comm->recv_turn,
                  &comm->chunks_sent, &comm->chunks_received}) {
    v->assign(n, 0);
  }
  comm->segment->count_join();
  return comm.release();
}

ncclUniqueId make_unique_id() {
  unsigned char random[8];
  size_t got = 0;
  while (got < sizeof random) {
    ssize_t n = ::getrandom(random + got, sizeof random - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Failure(ncclSystemError, std::string("getrandom: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(n);
  }
  const std::string& tag = Settings::get().shm_tag;
  std::string name =
      std::string(kSegmentPrefix) + (tag.empty() ? "" : tag + "-") + hex(random, sizeof random);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  std::memcpy(id.internal, name.data(), name.size());
  return id;
}

std::string segment_name_of(const ncclUniqueId& id) {
  const size_t length = strnlen(id.internal, sizeof id.internal);
  std::string name(id.internal, length);
  if (length == sizeof id.internal || name.rfind(kSegmentPrefix, 0) != 0 ||
      name.size() <= sizeof kSegmentPrefix) {
    throw Failure(ncclInvalidArgument,
                  "the unique id was not made by this library's ncclGetUniqueId");
  }
  return name;
}

std::string child_segment_name(const std::string& parent, const std::string& derivation) {
  const uint64_t h = fnv1a(parent + "|" + derivation);
  unsigned char bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(h >> (56 - 8 * i));
  return parent.substr(0, parent.rfind('-') + 1) + hex(bytes, sizeof bytes);
}

void check_usable(const ncclComm* comm) {
  if (comm == nullptr) throw Failure(ncclInvalidArgument, "communicator is NULL");
  if (comm->joining)
    throw Failure(ncclInvalidUsage,
                  "communicator is still being initialised (non-blocking: poll "
                  "ncclCommGetAsyncError until it is no longer ncclInProgress)");
  if (comm->aborted.load()) throw Failure(ncclInvalidUsage, "communicator was aborted");
  if (!comm->broken.empty()) throw Failure(ncclSystemError, comm->broken);
  if (comm->revoked) throw Failure(ncclInvalidUsage, "communicator was revoked");
  if (comm->finalized) throw Failure(ncclInvalidUsage, "communicator was finalized");
}

ncclResult_t advance_join(ncclComm* comm) {
  if (!comm->joining) return ncclSuccess;
  Operation& join = *comm->joining;
  if (comm->aborted.load() && !join.done())
    join.give_up(ncclSystemError, "the communicator was aborted while it was being initialised");
  if (!join.done()) join.progress();
  if (!join.done()) return ncclInProgress;
  const ncclResult_t result = join.result();
  comm->joining.reset();
  return result;
}

}  // namespace standin
