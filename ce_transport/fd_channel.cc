// Descriptors to peer processes over an abstract Unix socket (fd_channel.h).
//
// One request per connection: the peer sends {magic, index, nonce}; the server answers a header
// {magic, status, count, payload bytes}, the payload (or, refused, the reason as text), then the
// descriptors in messages of one byte each carrying at most kChunk of them (one SCM_RIGHTS
// message takes at most SCM_MAX_FD, 253; the byte says how many, so a short one is caught).
#include "ce_transport/fd_channel.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "base/base.h"
#include "ce_transport/process.h"

namespace magi::ce::fd_channel {
namespace {

constexpr uint32_t kRequestMagic = 0x4d46'4452;  // "MFDR"
constexpr uint32_t kReplyMagic = 0x4d46'4441;    // "MFDA"
constexpr size_t kChunk = 64;
constexpr size_t kMaxPayload = size_t{1} << 20;
// How long the server gives one peer to send its request and take its answer.
constexpr int kPeerTimeoutMs = 5000;

struct Request {
  uint32_t magic;
  uint32_t index;
  uint64_t nonce;
};
struct Reply {
  uint32_t magic;
  uint32_t status;  // 0: the offer follows; 1: refused, the payload says why
  uint32_t count;   // descriptors after the payload
  uint32_t payload_bytes;
};

[[noreturn]] void fail(const std::string& what) {
  throw Error(ErrorKind::System, what + ": " + std::strerror(errno));
}

sockaddr_un socket_address(const Address& address, socklen_t& length) {
  const std::string name = socket_name(address);
  sockaddr_un sun{};
  sun.sun_family = AF_UNIX;
  std::memcpy(sun.sun_path, name.data(), name.size());
  length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
  return sun;
}

void set_timeouts(int fd, int ms) {
  timeval tv{ms / 1000, (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// Whole reads and writes; false on EOF, a timeout or an error (errno says which).
bool read_all(int fd, void* data, size_t bytes) {
  auto* at = static_cast<uint8_t*>(data);
  while (bytes != 0) {
    const ssize_t got = ::recv(fd, at, bytes, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      if (got == 0) errno = ECONNRESET;
      return false;
    }
    at += got;
    bytes -= static_cast<size_t>(got);
  }
  return true;
}
bool write_all(int fd, const void* data, size_t bytes) {
  const auto* at = static_cast<const uint8_t*>(data);
  while (bytes != 0) {
    const ssize_t put = ::send(fd, at, bytes, MSG_NOSIGNAL);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    at += put;
    bytes -= static_cast<size_t>(put);
  }
  return true;
}

// One message of the channel: a byte that counts the descriptors, and room for kChunk of them.
struct FdMessage {
  uint8_t count = 0;
  iovec iov{&count, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(kChunk * sizeof(int))] = {};
  msghdr msg{};
  FdMessage() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
};

// One message of one byte carrying `fds`.
bool send_fds(int conn, std::span<const int> fds) {
  FdMessage message;
  message.count = static_cast<uint8_t>(fds.size());
  msghdr& msg = message.msg;
  msg.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), fds.data(), fds.size() * sizeof(int));
  for (;;) {
    const ssize_t put = ::sendmsg(conn, &msg, MSG_NOSIGNAL);
    if (put < 0 && errno == EINTR) continue;
    return put == 1;
  }
}

std::string hex(uint64_t v) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(v));
  return text;
}

class SocketServer final : public Server {
 public:
  SocketServer(uint64_t identity, int rank) {
    address_.identity = identity;
    address_.rank = rank;
    address_.pid = static_cast<int32_t>(::getpid());
    std::random_device random;  // forked siblings and later plans draw other names
    address_.nonce = uint64_t{random()} << 32 | random();
    owner_pid_ = ::getpid();
    listener_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listener_ < 0) fail("socket (descriptor channel)");
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_ < 0) {
      ::close(listener_);
      fail("eventfd (descriptor channel)");
    }
    socklen_t length = 0;
    const sockaddr_un sun = socket_address(address_, length);
    if (::bind(listener_, reinterpret_cast<const sockaddr*>(&sun), length) != 0 ||
        ::listen(listener_, 128) != 0) {
      const int err = errno;
      ::close(listener_);
      ::close(wake_);
      errno = err;
      fail("binding the descriptor channel's socket");
    }
    thread_ = std::thread([this] { serve(); });
  }
  ~SocketServer() override { stop(); }

  const Address& address() const override { return address_; }
  uint32_t offer(Offer offer) override {
    std::lock_guard<std::mutex> lock(mutex_);
    offers_.push_back(std::move(offer));
    return static_cast<uint32_t>(offers_.size() - 1);
  }
  void allow(std::span<const pid_t> pids) override {
    std::lock_guard<std::mutex> lock(mutex_);
    allowed_.assign(pids.begin(), pids.end());
    allowed_known_ = true;
    changed_.notify_all();
  }
  void stop() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) return;
      stopped_ = true;
      // Refuses connects from now on, also through a forked child's copy of the socket.
      ::shutdown(listener_, SHUT_RDWR);
      if (serving_ >= 0) ::shutdown(serving_, SHUT_RDWR);  // a request in progress ends
      changed_.notify_all();
    }
    const uint64_t one = 1;
    (void)!::write(wake_, &one, sizeof(one));
    if (::getpid() == owner_pid_) {
      thread_.join();
    } else {
      // A forked child has the object, not the thread: nothing to join, never destroyed.
      new std::thread(std::move(thread_));
    }
    ::close(listener_);
    ::close(wake_);
  }
  size_t served() const override { return served_.load(); }
  size_t refused() const override { return refused_.load(); }

 private:
  void serve() {
    for (;;) {
      pollfd fds[2] = {{listener_, POLLIN, 0}, {wake_, POLLIN, 0}};
      if (::poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        break;
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopped_) break;
      }
      if ((fds[0].revents & POLLIN) == 0) continue;
      const int conn = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        serving_ = conn;
        if (stopped_) ::shutdown(conn, SHUT_RDWR);
      }
      try {
        answer(conn);
      } catch (const std::exception& e) {
        MAGI_WARN(Transport, "descriptor channel: a request failed: %s", e.what());
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        serving_ = -1;
      }
      ::close(conn);
    }
  }

  void refuse(int conn, const std::string& why) {
    ++refused_;
    const Reply reply{kReplyMagic, 1, 0, static_cast<uint32_t>(why.size())};
    if (write_all(conn, &reply, sizeof(reply))) write_all(conn, why.data(), why.size());
  }

  void answer(int conn) {
    set_timeouts(conn, kPeerTimeoutMs);
    Request request{};
    if (!read_all(conn, &request, sizeof(request)) || request.magic != kRequestMagic) return;
    ucred peer{};
    socklen_t length = sizeof(peer);
    if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0)
      return refuse(conn, "its credentials could not be read");
    if (peer.uid != ::geteuid())
      return refuse(conn, "process " + std::to_string(peer.pid) + " runs as another user");
    Offer offer;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait_for(lock, kAllowWait, [&] { return allowed_known_ || stopped_; });
      if (stopped_) return;
      if (!allowed_known_)
        return refuse(conn, "the owner did not learn its peers' processes within " +
                                std::to_string(kAllowWait.count()) + " s");
      if (std::find(allowed_.begin(), allowed_.end(), peer.pid) == allowed_.end())
        return refuse(conn, "process " + std::to_string(peer.pid) +
                                " is not a peer rank of this communicator");
      if (request.nonce != address_.nonce || request.index >= offers_.size())
        return refuse(conn, "it offers nothing under index " + std::to_string(request.index));
      offer = offers_[request.index];  // made outside the lock
    }
    const Reply reply{kReplyMagic, 0, static_cast<uint32_t>(offer.count),
                      static_cast<uint32_t>(offer.payload.size())};
    if (!write_all(conn, &reply, sizeof(reply)) ||
        !write_all(conn, offer.payload.data(), offer.payload.size()))
      return;
    std::vector<int> chunk;
    for (size_t first = 0; first < offer.count; first += kChunk) {
      chunk.clear();
      try {
        for (size_t i = first; i < std::min(offer.count, first + kChunk); ++i)
          chunk.push_back(offer.make(i));
      } catch (...) {
        for (int fd : chunk) ::close(fd);
        throw;  // the peer sees the connection closed short of its descriptors
      }
      const bool sent = send_fds(conn, chunk);
      for (int fd : chunk) ::close(fd);
      if (!sent) return;
    }
    ++served_;
  }

  Address address_;
  pid_t owner_pid_ = 0;
  int listener_ = -1;
  int wake_ = -1;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Offer> offers_;
  std::vector<pid_t> allowed_;
  bool allowed_known_ = false;
  bool stopped_ = false;
  int serving_ = -1;
  std::atomic<size_t> served_{0};
  std::atomic<size_t> refused_{0};
};

}  // namespace

std::string socket_name(const Address& address) {
  return std::string(1, '\0') + "magice-fd." + hex(address.identity) + "." +
         std::to_string(address.rank) + "." + std::to_string(address.pid) + "." +
         hex(address.nonce);
}

std::unique_ptr<Server> Server::start(uint64_t identity, int rank) {
  return std::make_unique<SocketServer>(identity, rank);
}

std::vector<uint8_t> fetch(const Address& address, uint32_t index,
                           const std::function<void(size_t, int)>& take,
                           std::chrono::milliseconds timeout) {
  const std::string owner =
      "rank " + std::to_string(address.rank) + " (pid " + std::to_string(address.pid) + ")";
  const int conn = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (conn < 0) fail("socket (descriptor channel)");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{conn};
  set_timeouts(conn, static_cast<int>(std::max<int64_t>(timeout.count(), 1)));
  socklen_t length = 0;
  const sockaddr_un sun = socket_address(address, length);
  if (::connect(conn, reinterpret_cast<const sockaddr*>(&sun), length) != 0) {
    const int refused = errno;
    throw Error(ErrorKind::System,
                "cannot reach " + owner + "'s descriptor channel: " +
                    (process_alive(address.pid)
                         ? "it no longer serves (" + std::string(std::strerror(refused)) + ")"
                         : std::string("the process is gone")));
  }
  auto failed = [&](const std::string& what) -> Error {
    const bool timed_out = errno == EAGAIN || errno == EWOULDBLOCK;
    return Error(ErrorKind::System,
                 owner + "'s descriptor channel: " + what +
                     (timed_out ? ": no answer within " + std::to_string(timeout.count()) + " ms"
                                : ": " + std::string(std::strerror(errno)) +
                                      " (the owner closed the connection)"));
  };
  const Request request{kRequestMagic, index, address.nonce};
  if (!write_all(conn, &request, sizeof(request))) throw failed("sending the request");
  Reply reply{};
  if (!read_all(conn, &reply, sizeof(reply))) throw failed("reading its answer");
  if (reply.magic != kReplyMagic || reply.payload_bytes > kMaxPayload)
    throw Error(ErrorKind::System, owner + "'s descriptor channel answered garbage");
  std::vector<uint8_t> payload(reply.payload_bytes);
  if (!read_all(conn, payload.data(), payload.size())) throw failed("reading its answer");
  if (reply.status != 0)
    throw Error(ErrorKind::System,
                owner + " refused descriptors: " + std::string(payload.begin(), payload.end()));
  size_t received = 0;
  std::vector<int> fds;
  while (received < reply.count) {
    FdMessage message;
    msghdr& msg = message.msg;
    const uint8_t& count = message.count;
    ssize_t got = 0;
    do {
      got = ::recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
    } while (got < 0 && errno == EINTR);
    fds.clear();
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); got > 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      const size_t before = fds.size();
      fds.resize(before + n);
      std::memcpy(fds.data() + before, CMSG_DATA(c), n * sizeof(int));
    }
    if (got <= 0) {
      if (got == 0) errno = ECONNRESET;
      throw failed("after " + std::to_string(received) + " of " + std::to_string(reply.count) +
                   " descriptors");
    }
    if ((msg.msg_flags & MSG_CTRUNC) != 0 || fds.size() != count ||
        received + fds.size() > reply.count) {
      for (int fd : fds) ::close(fd);
      throw Error(ErrorKind::System, owner + "'s descriptor channel: a message lost descriptors (" +
                                         std::to_string(fds.size()) + " of " +
                                         std::to_string(count) +
                                         "; is this process short of file descriptors?)");
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      try {
        take(received + i, fds[i]);
      } catch (...) {
        for (size_t j = i + 1; j < fds.size(); ++j) ::close(fds[j]);
        throw;
      }
    }
    received += fds.size();
  }
  return payload;
}

}  // namespace magi::ce::fd_channel
