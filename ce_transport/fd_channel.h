// Handing file descriptors to peer processes: the one way memory that only a descriptor can
// share (cuMemCreate allocations exported as POSIX file descriptors, memfd memory) reaches a
// peer. Private to ce_transport/; knows nothing of CUDA.
//
// The owner runs a Server: a Unix stream socket in the abstract namespace (nothing on disk to
// clean up after a crash; the name goes with the last descriptor of the socket), served on a
// thread of its own, never on a program call. What it offers sits under small indices, made
// into descriptors only when a peer asks. A peer asks with fetch(): the Address (what the
// owner published) and an index. The server hands descriptors (SCM_RIGHTS) only to a process
// whose SO_PEERCRED says it runs as our uid and is one of the pids allow() named (the
// communicator's peer ranks, from their handle blobs); an abstract socket has no file
// permissions, so the credentials are the whole access check. A request that comes before
// allow() waits for it (the peers' pids arrive in the same round as the request's address),
// a bounded time.
//
// Never hangs a caller: fetch() gives up after its timeout with a clear Error(System), and a
// stopped server refuses at once. stop() shuts the listening socket down before closing it, so
// a child forked meanwhile (which inherits the socket but not the thread) keeps nothing
// reachable: connects are refused, not queued for nobody.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace magi::ce::fd_channel {

// What a peer needs to reach a server: its socket's name is made of these (socket_name()).
struct Address {
  uint64_t identity = 0;  // the communicator's
  int32_t rank = 0;       // the owner's
  int32_t pid = 0;        // the owner's
  uint64_t nonce = 0;     // tells this server from another of the same owner (a later plan)
};
// The abstract socket name (its leading NUL included) of `address`.
std::string socket_name(const Address& address);

// What an owner offers under one index: `payload` (small, sent first) and `count` descriptors,
// made when a peer asks: `make(i)` returns a new descriptor, which the channel closes once sent
// (so an owner holds none between requests), or throws.
struct Offer {
  std::vector<uint8_t> payload;
  size_t count = 0;
  std::function<int(size_t)> make;
};

class Server {
 public:
  // Listens at once (throws Error(System) if it cannot) and serves on a thread of its own.
  static std::unique_ptr<Server> start(uint64_t identity, int rank);
  virtual ~Server() = default;  // stops it
  virtual const Address& address() const = 0;
  // Adds an offer; returns its index.
  virtual uint32_t offer(Offer offer) = 0;
  // The processes that may take descriptors (with our uid); until called, requests wait.
  virtual void allow(std::span<const pid_t> pids) = 0;
  // Stops serving: requests in progress end (the peer sees the connection closed), new connects
  // are refused. Safe to call more than once; the destructor calls it.
  virtual void stop() = 0;
  // Requests answered with descriptors so far, and refused (not allowed, unknown index).
  virtual size_t served() const = 0;
  virtual size_t refused() const = 0;
};

// Takes offer `index` from the server at `address`: returns its payload, after handing each
// descriptor to `take(i, fd)` in order (take owns it; what take throws ends the fetch, the
// descriptors not yet taken closed). Throws Error(System) saying why on anything else: no such
// server (gone, or never started), refused (not allowed, no such offer), no answer within
// `timeout`.
std::vector<uint8_t> fetch(const Address& address, uint32_t index,
                           const std::function<void(size_t, int)>& take,
                           std::chrono::milliseconds timeout = std::chrono::seconds(30));

// How long a server waits for allow() before it refuses a request.
inline constexpr std::chrono::seconds kAllowWait{20};

}  // namespace magi::ce::fd_channel
