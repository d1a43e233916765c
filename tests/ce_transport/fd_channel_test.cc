// The descriptor channel (ce_transport/fd_channel.h) across real processes: a forked child asks
// the parent's server (or the parent asks a child's) for descriptors; every child is bounded in
// time, so a hang fails the test instead of stalling it.
#include "ce_transport/fd_channel.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "base/base.h"

namespace magi::ce::fd_channel {
namespace {

constexpr auto kChildLimit = std::chrono::seconds(20);

// A memfd holding `text`.
int memfd_with(const std::string& text) {
  const int fd = ::memfd_create("fd-channel-test", MFD_CLOEXEC);
  if (fd < 0 || ::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size()))
    throw std::runtime_error("memfd");
  return fd;
}
std::string contents(int fd) {
  char buffer[64] = {};
  const ssize_t got = ::pread(fd, buffer, sizeof(buffer) - 1, 0);
  return got > 0 ? std::string(buffer, static_cast<size_t>(got)) : std::string();
}

// Runs `body` in a forked child (its return is the exit status); `parent` runs meanwhile with
// the child's pid. Returns the child's exit status, or -1 when it did not end in time.
int in_child(const std::function<int()>& body, const std::function<void(pid_t)>& parent = {}) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(static_cast<unsigned>(kChildLimit.count()));
    int status = 1;
    try {
      status = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
    }
    ::_exit(status);
  }
  if (parent) parent(pid);
  const auto deadline = std::chrono::steady_clock::now() + kChildLimit;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// An offer of `count` memfds, the i-th holding "piece i".
Offer pieces(size_t count, std::string payload = "") {
  Offer offer;
  offer.payload.assign(payload.begin(), payload.end());
  offer.count = count;
  offer.make = [](size_t i) { return memfd_with("piece " + std::to_string(i)); };
  return offer;
}

// 0 when `what` throws an Error whose text holds `needle`; 1 otherwise (said on stderr).
int throws_with(const std::function<void()>& what, const std::string& needle) {
  try {
    what();
  } catch (const Error& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) return 0;
    std::fprintf(stderr, "child: unexpected error: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "child: no error\n");
  return 1;
}

TEST(FdChannel, APeerRankTakesTheDescriptorsOfAnOfferWithItsPayload) {
  auto server = Server::start(0x1234, 0);
  server->offer(pieces(1));
  const uint32_t index = server->offer(pieces(3, "sizes"));
  const Address at = server->address();
  const int status = in_child(
      [&] {
        std::vector<std::string> got;
        const std::vector<uint8_t> payload = fetch(at, index, [&](size_t i, int fd) {
          if (i != got.size()) throw std::runtime_error("out of order");
          got.push_back(contents(fd));
          ::close(fd);
        });
        const bool right = std::string(payload.begin(), payload.end()) == "sizes" &&
                           got == std::vector<std::string>{"piece 0", "piece 1", "piece 2"};
        return right ? 0 : 1;
      },
      [&](pid_t child) {
        // The request may come before the owner knows its peers: it waits for them.
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        const pid_t peers[] = {child};
        server->allow(peers);
      });
  EXPECT_EQ(status, 0);
  EXPECT_EQ(server->served(), 1u);
  EXPECT_EQ(server->refused(), 0u);
}

TEST(FdChannel, AProcessThatIsNoPeerRankIsRefused) {
  auto server = Server::start(0x1234, 1);
  server->offer(pieces(2));
  const pid_t peers[] = {::getpid()};  // not the child
  server->allow(peers);
  const Address at = server->address();
  EXPECT_EQ(in_child([&] {
              return throws_with([&] { fetch(at, 0, [](size_t, int fd) { ::close(fd); }); },
                                 "is not a peer rank of this communicator");
            }),
            0);
  EXPECT_EQ(server->served(), 0u);
  EXPECT_EQ(server->refused(), 1u);
}

TEST(FdChannel, AnIndexWithNoOfferIsRefused) {
  auto server = Server::start(0x1234, 1);
  server->offer(pieces(1));
  const Address at = server->address();
  EXPECT_EQ(in_child(
                [&] {
                  return throws_with([&] { fetch(at, 7, [](size_t, int fd) { ::close(fd); }); },
                                     "offers nothing under index 7");
                },
                [&](pid_t child) {
                  const pid_t peers[] = {child};
                  server->allow(peers);
                }),
            0);
}

// The child inherits the listening socket (as a program's fork would) but not the thread: once
// the owner stops, a connect is refused at once, not queued for a server that is gone.
TEST(FdChannel, AStoppedServerIsAClearErrorEvenThroughAForkedCopyOfItsSocket) {
  auto server = Server::start(0x1234, 2);
  server->offer(pieces(1));
  const Address at = server->address();
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  const int status = in_child(
      [&] {
        char byte = 0;
        if (::read(go[0], &byte, 1) != 1) return 1;
        const auto start = std::chrono::steady_clock::now();
        const int refused = throws_with(
            [&] {
              fetch(
                  at, 0, [](size_t, int fd) { ::close(fd); }, std::chrono::seconds(10));
            },
            "it no longer serves");
        return refused == 0 && std::chrono::steady_clock::now() - start < std::chrono::seconds(2)
                   ? 0
                   : 1;
      },
      [&](pid_t child) {
        const pid_t peers[] = {child};
        server->allow(peers);
        server->stop();
        (void)!::write(go[1], "x", 1);
      });
  EXPECT_EQ(status, 0);
  ::close(go[0]);
  ::close(go[1]);
}

// The owner listened at its channel's name, then exited. (It listens without a server's thread:
// a child forked from this many-threaded test process may not start threads under TSan, and
// what is tested is fetch()'s answer once the socket and its process are gone.)
TEST(FdChannel, AnOwnerThatIsGoneIsAClearError) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  Address at{};
  const int status = in_child([&] {
    Address mine{0x99, 3, static_cast<int32_t>(::getpid()), 0x5eed};
    const std::string name = socket_name(mine);
    sockaddr_un sun{};
    sun.sun_family = AF_UNIX;
    std::memcpy(sun.sun_path, name.data(), name.size());
    const int listener = ::socket(AF_UNIX, SOCK_STREAM, 0);
    const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
    if (listener < 0 || ::bind(listener, reinterpret_cast<const sockaddr*>(&sun), length) != 0 ||
        ::listen(listener, 1) != 0)
      return 1;
    return ::write(pipe_fds[1], &mine, sizeof(mine)) == sizeof(mine) ? 0 : 1;
  });
  ASSERT_EQ(status, 0);
  ASSERT_EQ(::read(pipe_fds[0], &at, sizeof(at)), static_cast<ssize_t>(sizeof(at)));
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  try {
    fetch(at, 0, [](size_t, int fd) { ::close(fd); });
    FAIL() << "a fetch from a server that is gone returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the process is gone"), std::string::npos) << e.what();
  }
}

// An owner killed and not yet reaped is a zombie: kill(pid, 0) still answers for it, the liveness
// rule (ce_transport/process.h) does not. Its socket closed with it: the fetch says it is gone.
TEST(FdChannel, AnOwnerKilledButNotYetReapedIsGone) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(static_cast<unsigned>(kChildLimit.count()));
    Address mine{0x9a, 4, static_cast<int32_t>(::getpid()), 0x5eef};
    const std::string name = socket_name(mine);
    sockaddr_un sun{};
    sun.sun_family = AF_UNIX;
    std::memcpy(sun.sun_path, name.data(), name.size());
    const int listener = ::socket(AF_UNIX, SOCK_STREAM, 0);
    const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
    if (listener < 0 || ::bind(listener, reinterpret_cast<const sockaddr*>(&sun), length) != 0 ||
        ::listen(listener, 1) != 0)
      ::_exit(1);
    if (::write(pipe_fds[1], &mine, sizeof(mine)) != sizeof(mine)) ::_exit(1);
    for (;;) ::pause();  // killed by the parent
  }
  ASSERT_GT(pid, 0);
  Address at{};
  const bool told = ::read(pipe_fds[0], &at, sizeof(at)) == static_cast<ssize_t>(sizeof(at));
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  ::kill(pid, SIGKILL);
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT), 0);  // not reaped
  ASSERT_TRUE(told);
  ASSERT_EQ(::kill(pid, 0), 0) << "a zombie answers kill(pid, 0)";
  std::string what;
  try {
    fetch(at, 0, [](size_t, int fd) { ::close(fd); });
  } catch (const Error& e) {
    what = e.what();
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_NE(what.find("the process is gone"), std::string::npos) << what;
}

// More than one SCM_RIGHTS message holds (253): a shard of 600 granules comes in one request.
TEST(FdChannel, ManyDescriptorsComeInOneRequestInOrder) {
  constexpr size_t kCount = 600;
  auto server = Server::start(0x1234, 0);
  server->offer(pieces(kCount));
  const Address at = server->address();
  const int status = in_child(
      [&] {
        size_t right = 0;
        fetch(at, 0, [&](size_t i, int fd) {
          right += contents(fd) == "piece " + std::to_string(i);
          ::close(fd);
        });
        return right == kCount ? 0 : 1;
      },
      [&](pid_t child) {
        const pid_t peers[] = {child};
        server->allow(peers);
      });
  EXPECT_EQ(status, 0);
  EXPECT_EQ(server->served(), 1u);
}

// What the taker throws ends the fetch; the descriptors it did not take are closed, not leaked.
TEST(FdChannel, ATakerThatThrowsEndsTheFetchAndLeaksNothing) {
  auto server = Server::start(0x1234, 0);
  server->offer(pieces(10));
  const pid_t peers[] = {::getpid()};
  server->allow(peers);
  auto open_fds = [] {
    int n = 0;
    for (int fd = 0; fd < 4096; ++fd) n += ::fcntl(fd, F_GETFD) != -1;
    return n;
  };
  const int before = open_fds();
  EXPECT_THROW(fetch(server->address(), 0,
                     [](size_t i, int fd) {
                       ::close(fd);
                       if (i == 3) throw Error(ErrorKind::System, "enough");
                     }),
               Error);
  // The server closes what it made and the connection on its own thread, after the taker's
  // throw ended the fetch (a request cut short is never counted served): wait until they are
  // closed. A leaked descriptor never is, and fails here after 5 s.
  for (int i = 0; i < 2500 && open_fds() != before; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(open_fds(), before);
}

}  // namespace
}  // namespace magi::ce::fd_channel
