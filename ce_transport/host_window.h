// A window of the host backend: one POSIX shared-memory object per rank, mapped by its owner and
// by every peer.
//
// Names are `/magice-ce-<64 random bits>.<owner pid>`, created O_EXCL with mode 0600, so a name is
// never reused and never opened before its owner made it. No name outlives its use: the last peer
// to open a window removes the name (the count is in the window's flags), and the owner removes
// it at close if some peer never came. From then on the memory lives only as long as a mapping.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>

namespace magi::ce {

// How the names appear in /dev/shm (without the leading '/'), followed by hex, '.', the pid.
inline constexpr char kWindowNamePrefix[] = "magice-ce-";
inline constexpr size_t kCacheLine = 64;

// The head of every window, each word on its own cache line. The handshake's flag words follow
// it (where each lies is the protocol's: ce_transport/protocol.h), then the slots.
struct alignas(kCacheLine) FlagWord {
  std::atomic<uint64_t> value{0};
};
struct WindowHead {
  FlagWord pid;       // the owner's pid, so a waiting peer can tell whether it is alive
  FlagWord attached;  // peers that have opened the window
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "flags are shared between processes");
static_assert(sizeof(WindowHead) == 2 * kCacheLine);

class HostWindow {
 public:
  // Makes this process's window of `bytes` (at least its head and `flag_bytes` of flag words),
  // zeroed, with its pid in the head. `peers` is how many processes will open it.
  static HostWindow create(size_t bytes, size_t flag_bytes, int peers);
  // Opens a peer's window by name and counts this process as attached; the peer that completes
  // the count removes the name. Throws if the object is smaller than `bytes`.
  static HostWindow open(const std::string& name, size_t bytes, int peers);

  HostWindow() = default;
  HostWindow(HostWindow&& other) noexcept;
  HostWindow& operator=(HostWindow&& other) noexcept;
  HostWindow(const HostWindow&) = delete;
  HostWindow& operator=(const HostWindow&) = delete;
  ~HostWindow() { close(); }

  // Unmaps; the owner also removes the name if not every peer opened it. Safe to repeat.
  void close() noexcept;

  bool is_open() const { return base_ != nullptr; }
  uint8_t* data() const { return static_cast<uint8_t*>(base_); }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }
  // The bytes began life as the owner's WindowHead and flag words (create); peers reach them
  // through launder.
  WindowHead& head() const { return *std::launder(static_cast<WindowHead*>(base_)); }
  // The flag word `offset` bytes into the flags (a multiple of 8).
  std::atomic<uint64_t>& flag(size_t offset) const {
    return *std::launder(
        reinterpret_cast<std::atomic<uint64_t>*>(data() + sizeof(WindowHead) + offset));
  }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  int peers_ = 0;
  bool owner_ = false;
};

}  // namespace magi::ce
