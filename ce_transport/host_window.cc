#include "ce_transport/host_window.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>

#include "base/base.h"

namespace magi::ce {
namespace {

[[noreturn]] void fail(const std::string& what, int err) {
  throw Error(ErrorKind::System, what + ": " + std::strerror(err));
}

std::string fresh_name() {
  std::random_device random;  // the OS's entropy: forked siblings draw different names
  const uint64_t bits = (uint64_t{random()} << 32) | random();
  char name[64];
  std::snprintf(name, sizeof(name), "/%s%016llx.%ld", kWindowNamePrefix,
                static_cast<unsigned long long>(bits), static_cast<long>(getpid()));
  return name;
}

void* map_shared(int fd, size_t bytes, const std::string& name) {
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    fail("mapping window " + name, err);
  }
  ::close(fd);  // the mapping keeps the object
  return base;
}

}  // namespace

HostWindow HostWindow::create(size_t bytes, size_t flag_bytes, int peers) {
  if (bytes < sizeof(WindowHead) + flag_bytes || flag_bytes % sizeof(uint64_t) != 0)
    throw Error(ErrorKind::Internal, "window smaller than its flags");
  const std::string name = fresh_name();
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) fail("creating window " + name, errno);
  // Reserve the pages now: a tmpfs too small for the window (a container's 64 MiB /dev/shm) is an
  // error here, not a SIGBUS at the first bucket.
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    ::close(fd);
    shm_unlink(name.c_str());
    fail("reserving " + std::to_string(bytes) + " bytes of /dev/shm for window " + name, err);
  }
  void* base = nullptr;
  try {
    base = map_shared(fd, bytes, name);
  } catch (...) {
    shm_unlink(name.c_str());
    throw;
  }
  HostWindow window;
  window.base_ = base;
  window.bytes_ = bytes;
  window.name_ = name;
  window.peers_ = peers;
  window.owner_ = true;
  ::new (base) WindowHead{};
  for (size_t at = 0; at < flag_bytes; at += sizeof(uint64_t))
    ::new (window.data() + sizeof(WindowHead) + at) std::atomic<uint64_t>{0};
  window.head().pid.value.store(static_cast<uint64_t>(getpid()), std::memory_order_release);
  if (peers == 0) shm_unlink(name.c_str());  // nobody will ever open it
  return window;
}

HostWindow HostWindow::open(const std::string& name, size_t bytes, int peers) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) fail("opening peer window " + name, errno);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("inspecting peer window " + name, err);
  }
  if (st.st_size < 0 || static_cast<size_t>(st.st_size) < bytes) {
    ::close(fd);
    throw Error(ErrorKind::System, "peer window " + name + " holds " + std::to_string(st.st_size) +
                                       " bytes, " + std::to_string(bytes) + " expected");
  }
  HostWindow window;
  window.base_ = map_shared(fd, bytes, name);
  window.bytes_ = bytes;
  window.name_ = name;
  window.peers_ = peers;
  const uint64_t attached =
      window.head().attached.value.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (attached == static_cast<uint64_t>(peers)) shm_unlink(name.c_str());
  return window;
}

HostWindow::HostWindow(HostWindow&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      name_(std::move(other.name_)),
      peers_(other.peers_),
      owner_(std::exchange(other.owner_, false)) {}

HostWindow& HostWindow::operator=(HostWindow&& other) noexcept {
  if (this != &other) {
    close();
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    name_ = std::move(other.name_);
    peers_ = other.peers_;
    owner_ = std::exchange(other.owner_, false);
  }
  return *this;
}

void HostWindow::close() noexcept {
  if (base_ == nullptr) return;
  // A peer that never came leaves the name behind: remove it. A late peer then fails to open it,
  // which it reports; one counting itself at this moment may remove it too (ENOENT, harmless).
  if (owner_ &&
      head().attached.value.load(std::memory_order_acquire) < static_cast<uint64_t>(peers_))
    shm_unlink(name_.c_str());
  munmap(base_, bytes_);
  base_ = nullptr;
  bytes_ = 0;
  owner_ = false;
  name_.clear();
}

}  // namespace magi::ce
