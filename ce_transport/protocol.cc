#include "ce_transport/protocol.h"

#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace magi::ce::protocol {
namespace {

const char* backend_name(uint8_t backend) {
  switch (static_cast<Backend>(backend)) {
    case Backend::Cuda: return "CUDA";
    case Backend::Host: return "host";
  }
  return "unknown";
}

}  // namespace

void write_header(const WindowShape& shape, int rank, const std::string& source_log,
                  HandleBlob& out) {
  BlobHeader header{};
  if (source_log.size() >= sizeof(header.source_log))
    throw Error(ErrorKind::Internal, "a source log's name is too long: " + source_log);
  std::memcpy(header.source_log, source_log.data(), source_log.size());
  header.magic = kBlobMagic;
  header.version = kBlobVersion;
  header.backend = static_cast<uint8_t>(shape.backend);
  header.bound = shape.bound ? 1 : 0;
  header.zero_copy = shape.zero_copy ? 1 : 0;
  header.comm_identity = shape.comm_identity;
  header.window_bytes = shape.window_bytes;
  header.slot_bytes = shape.slot_bytes;
  header.rank = rank;
  header.nranks = shape.nranks;
  header.pid = getpid();
  out = HandleBlob{};
  std::memcpy(out.bytes, &header, sizeof(header));
}

BlobHeader check_header(const HandleBlob& blob, int rank, const WindowShape& shape) {
  BlobHeader h{};
  std::memcpy(&h, blob.bytes, sizeof(h));
  const std::string who = "rank " + std::to_string(rank) + "'s handle blob";
  auto refuse = [&](const std::string& why) { throw Error(ErrorKind::Usage, who + " " + why); };
  if (h.magic != kBlobMagic) refuse("is not a window's");
  if (h.version != kBlobVersion)
    refuse("speaks protocol version " + std::to_string(h.version) + ", this rank " +
           std::to_string(kBlobVersion));
  if (h.backend != static_cast<uint8_t>(shape.backend))
    refuse(std::string("is for the ") + backend_name(h.backend) + " backend, this rank's for the " +
           backend_name(static_cast<uint8_t>(shape.backend)));
  if (h.rank != rank || h.nranks != shape.nranks)
    refuse("is rank " + std::to_string(h.rank) + " of " + std::to_string(h.nranks) + ", expected " +
           std::to_string(rank) + " of " + std::to_string(shape.nranks));
  if (h.comm_identity != shape.comm_identity) refuse("belongs to another communicator");
  if (h.zero_copy > 1 || (h.zero_copy != 0) != shape.zero_copy)
    refuse(std::string(h.zero_copy != 0 ? "reads shards in place" : "binds every shard") +
           ", this rank " + (shape.zero_copy ? "reads them in place" : "binds them"));
  if (!shape.zero_copy && h.slot_bytes != shape.slot_bytes)
    refuse("has slots of " + std::to_string(h.slot_bytes) + " bytes, this rank " +
           std::to_string(shape.slot_bytes));
  if (!shape.zero_copy && h.window_bytes != shape.window_bytes)
    refuse("has a window of " + std::to_string(h.window_bytes) + " bytes, this rank " +
           std::to_string(shape.window_bytes));
  if (h.bound > 1 || (h.bound != 0) != shape.bound)
    refuse(std::string("has ") + (h.bound != 0 ? "a bound" : "a staging") + " window, this rank " +
           (shape.bound ? "a bound one" : "a staging one"));
  if (h.pid <= 0) refuse("names no process");
  if (strnlen(h.source_log, sizeof(h.source_log)) == sizeof(h.source_log))
    refuse("has an unterminated source log name");
  if ((h.source_log[0] != '\0') != shape.bound)
    refuse(std::string(shape.bound ? "names no" : "names a") + " source log");
  return h;
}

std::string source_log_of(const BlobHeader& header) {
  return std::string(header.source_log, strnlen(header.source_log, sizeof(header.source_log)));
}

std::vector<uint8_t> first_flags(const FlagLayout& layout) {
  std::vector<uint8_t> words(layout.bytes(), 0);
  for (int slot = 0; slot < 2; ++slot)
    for (int r = 0; r < layout.nranks; ++r)
      std::memcpy(words.data() + layout.read(slot, r), &kLatchSet, sizeof(kLatchSet));
  return words;
}

void FaultPoints::at_prepare() const {
  if (where_ == Options::Fault::Where::Prepare)
    throw Error(ErrorKind::Cuda, "preparing the window: injected by MAGI_INJECT_FAULT");
}

void FaultPoints::at_attach() const {
  if (where_ == Options::Fault::Where::Attach)
    throw Error(ErrorKind::Cuda, "opening the peers' windows: injected by MAGI_INJECT_FAULT");
}

void FaultPoints::at_bucket_start() const {
  if (where_ == Options::Fault::Where::Slow)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

}  // namespace magi::ce::protocol
