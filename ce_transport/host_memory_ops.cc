// Host memory for the window transport (memory_ops.h): a window is a POSIX shared-memory object
// (host_window.h) laid out [ head | flags | slot 0 | slot 1 (| graph slots 0, 1) ] (or the bound
// region), its flag words host atomics on cache lines of their own; copies are memcpy; every
// operation is done when it returns. A waiting rank notices a dead peer by its pid and throws
// instead of waiting for ever.
#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <vector>

#include "base/base.h"
#include "base/spin_lock.h"
#include "ce_transport/backends.h"
#include "ce_transport/exports.h"
#include "ce_transport/host_window.h"
#include "ce_transport/memory_ops.h"
#include "ce_transport/process.h"

namespace magi::ce {
namespace {

// What the host medium holds: the name of the window to open.
struct HostMedium {
  char name[64];
};
static_assert(sizeof(HostMedium) <= protocol::kMediumBytes);

// ---- waiting ----------------------------------------------------------------------------------

[[noreturn]] void peer_gone(int rank, pid_t pid) {
  throw Error(ErrorKind::System,
              "rank " + std::to_string(rank) + " (pid " + std::to_string(pid) + ") is gone");
}

// Spins briefly (a peer on another core is usually a few hundred cycles away), then yields the
// core (ranks may outnumber cores), then sleeps in short steps. Only a dead peer or an abort
// (`abandoned`, set from any thread) ends the wait: a slow peer is waited for, however long.
template <class Reached>
void wait_for(int peer_rank, pid_t peer_pid, const std::atomic<bool>& abandoned, Reached reached) {
  constexpr int kSpins = 128;
  constexpr int kYields = 256;
  constexpr uint64_t kLivenessPeriodNs = 10'000'000;
  constexpr timespec kNap{0, 20'000};
  uint64_t next_check = 0;
  for (int round = 0; !reached();) {
    if (round < kSpins) {
      cpu_relax();
      ++round;
      continue;
    }
    if (round < kSpins + kYields) {
      sched_yield();
      ++round;  // stops counting here: a wait may last for hours
    } else {
      nanosleep(&kNap, nullptr);
    }
    if (abandoned.load(std::memory_order_relaxed))
      throw Error(ErrorKind::System, "the communicator was aborted while waiting for rank " +
                                         std::to_string(peer_rank));
    const uint64_t now = clock_ns();
    if (next_check == 0) {
      next_check = now + kLivenessPeriodNs;
    } else if (now >= next_check) {
      if (!process_alive(peer_pid)) {
        if (reached()) return;  // it got there before it went
        peer_gone(peer_rank, peer_pid);
      }
      next_check = now + kLivenessPeriodNs;
    }
  }
}

// A binding copies from the send buffer the last step named, and the program may have freed it
// since (a new buffer this step). A plain memcpy from unmapped memory would kill the program;
// process_vm_readv on ourselves reads the same bytes, or fails with EFAULT.
void copy_checked(void* into, const void* from, size_t bytes) {
  iovec local{into, bytes};
  iovec remote{const_cast<void*>(from), bytes};
  const ssize_t n = process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
  if (n != static_cast<ssize_t>(bytes))
    throw Error(ErrorKind::System, "binding a shard: its send buffer is no longer readable (" +
                                       std::string(n < 0 ? std::strerror(errno) : "short read") +
                                       ")");
}

// The flag word at `word`: it began life as an atomic in the window's owner (HostWindow::create).
std::atomic<uint64_t>& word_at(const uint8_t* word) {
  return *std::launder(reinterpret_cast<std::atomic<uint64_t>*>(const_cast<uint8_t*>(word)));
}

// ---- the operations ---------------------------------------------------------------------------

class HostMemoryOps final : public MemoryOps {
 public:
  explicit HostMemoryOps(int nranks) : nranks_(nranks), flags_{kCacheLine, nranks} {}
  ~HostMemoryOps() override { end_offers(); }

  Backend backend() const override { return Backend::Host; }
  bool synchronous() const override { return true; }
  const protocol::FlagLayout& flags() const override { return flags_; }

  WindowView allocate(size_t slot_bytes, bool bound, bool graph_slots,
                      std::span<const uint8_t> first_flags, size_t held_bytes) override {
    // Slots start on cache lines, so packed 64-byte-aligned slot offsets stay aligned in memory.
    stride_ = round_up(slot_bytes, kCacheLine);
    region_at_ = sizeof(WindowHead) + flags_.bytes();
    const size_t slots = bound ? 1 : graph_slots ? 4 : 2;
    own_ =
        HostWindow::create(region_at_ + slots * stride_ + held_bytes, flags_.bytes(), nranks_ - 1);
    if (bound || held_bytes != 0) check_.resize(kCheckBytes);
    WindowView own = view(own_);
    own.region_bytes -= held_bytes;  // the held pieces lie past the slots
    if (held_bytes != 0) own.held = own.region + slots * stride_;
    // The words start at 0 (HostWindow::create): only the others are stored.
    for (size_t at = 0; at + sizeof(uint64_t) <= first_flags.size(); at += sizeof(uint64_t)) {
      uint64_t value = 0;
      std::memcpy(&value, first_flags.data() + at, sizeof(value));
      if (value != 0) word_at(own.flags + at).store(value);
    }
    return own;
  }
  size_t window_bytes() const override { return own_.size(); }
  void bind(std::span<const Copy> shards) override {
    for (const Copy& shard : shards) copy_checked(shard.dst, shard.src, shard.bytes);
  }
  void export_window(Medium& medium) override {
    HostMedium host{};
    std::snprintf(host.name, sizeof(host.name), "%s", own_.name().c_str());
    std::memcpy(medium.data(), &host, sizeof(host));
  }

  void begin_attach(std::span<const pid_t> pids) override {
    peers_.resize(static_cast<size_t>(nranks_));
    peer_pids_.assign(pids.begin(), pids.end());
  }
  WindowView map_peer(int rank, const protocol::BlobHeader& header, const Medium& medium) override {
    HostMedium host;
    std::memcpy(&host, medium.data(), sizeof(host));
    const size_t name_bytes = strnlen(host.name, sizeof(host.name));
    if (name_bytes == sizeof(host.name))
      throw Error(ErrorKind::Usage,
                  "rank " + std::to_string(rank) + "'s handle blob has no window name");
    HostWindow& peer = peers_[static_cast<size_t>(rank)];
    peer = HostWindow::open(std::string(host.name, name_bytes), header.window_bytes, nranks_ - 1);
    const auto pid = static_cast<pid_t>(peer.head().pid.value.load(std::memory_order_acquire));
    if (pid != header.pid)
      throw Error(ErrorKind::Usage, "rank " + std::to_string(rank) + "'s window belongs to pid " +
                                        std::to_string(pid) + ", its blob says " +
                                        std::to_string(header.pid));
    // A peer whose pid this process cannot see (another pid namespace) could never be told apart
    // from a dead one while waiting: refuse it now.
    if (!process_alive(pid)) peer_gone(rank, pid);
    return view(peer);
  }

  exports::Exportable find_export(const void* ptr, size_t bytes) override {
    return exports::find_host_export(ptr, bytes);
  }
  std::function<exports::Exportable(const void*, size_t)> export_finder() override {
    return exports::host_export_finder();
  }
  // Shared memory with no name a peer could open (exports.h): a descriptor of its file, held
  // until end_offers(), and its file offset, inode and device, which the peer checks.
  fd_channel::Offer descriptor_offer(const exports::Exportable& e) override {
    uint64_t file_offset = 0;
    const int fd = exports::host_export_descriptor(e.base, e.record.bytes, e.identity, file_offset);
    held_.push_back(fd);
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw Error(ErrorKind::System, "fstat of its file failed");
    const uint64_t said[3] = {file_offset, static_cast<uint64_t>(st.st_ino),
                              static_cast<uint64_t>(st.st_dev)};
    fd_channel::Offer offer;
    offer.payload.resize(sizeof(said));
    std::memcpy(offer.payload.data(), said, sizeof(said));
    offer.count = 1;
    offer.make = [fd](size_t) {
      const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (copy < 0) throw Error(ErrorKind::System, "dup of an exported file failed");
      return copy;
    };
    return offer;
  }
  const char* offer_refusal() const override {
    return "its shared memory has no name a peer could open, and it cannot be offered by "
           "descriptor: ";
  }
  void end_offers() override {
    for (int fd : held_) ::close(fd);
    held_.clear();
  }
  bool export_alive(uintptr_t base, size_t bytes, uint64_t identity) override {
    return exports::host_export_alive(base, bytes, identity);
  }
  exports::Span import(const ExportRecord& record) override {
    imports_.push_back(exports::HostImport::open(record));
    return {imports_.back().data(), imports_.back().size()};
  }
  size_t imports() const override { return imports_.size(); }

  void copy_batch(std::span<const Copy> copies, void* /*stream*/) override {
    for (const Copy& c : copies) std::memcpy(c.dst, c.src, c.bytes);
  }
  void rebind(const Copy& shard, void* /*stream*/) override {
    std::memcpy(shard.dst, shard.src, shard.bytes);
  }
  // A write is a release store after everything this rank wrote before it (a latch's, a release
  // read-modify-write of its low bit, which leaves the high half as it is); a wait ends with an
  // acquire load that saw the peer's release.
  void run_flags(std::span<const FlagOp> ops, void* /*stream*/) override {
    for (const FlagOp& op : ops) {
      std::atomic<uint64_t>& word = word_at(op.word);
      switch (op.kind) {
        case FlagOp::Kind::Write: word.store(op.value, std::memory_order_release); break;
        case FlagOp::Kind::Latch:
          if (op.value != 0)
            word.fetch_or(protocol::kLatchSet, std::memory_order_release);
          else
            word.fetch_and(~protocol::kLatchSet, std::memory_order_release);
          break;
        case FlagOp::Kind::Wait:
          wait_for(op.rank, peer_pids_[static_cast<size_t>(op.rank)], abandoned_,
                   [&] { return word.load(std::memory_order_acquire) >= op.value; });
          break;
        case FlagOp::Kind::WaitLatch:
          wait_for(op.rank, peer_pids_[static_cast<size_t>(op.rank)], abandoned_, [&] {
            return (word.load(std::memory_order_acquire) & protocol::kLatchOpen) != 0;
          });
          break;
        case FlagOp::Kind::Open: word.fetch_or(uint64_t{1} << 32, std::memory_order_release); break;
      }
    }
  }
  uint64_t read_flag(const uint8_t* word) const override {
    return word_at(word).load(std::memory_order_relaxed);
  }
  uint64_t read_word_now(const uint8_t* word) override {
    return word_at(word).load(std::memory_order_acquire);
  }
  void write_word_now(uint8_t* word, uint64_t value) override {
    word_at(word).store(value, std::memory_order_release);
  }

  uint8_t* check_buffer() override { return check_.data(); }
  void copy_lines(uint8_t* into, const uint8_t* from, const SampleSet& set,
                  void* /*stream*/) override {
    for (size_t i = 0; i < set.lines(); ++i) {
      std::memcpy(into, from + set.offset(i), set.line_bytes(i));
      into += set.line_bytes(i);
    }
  }
  void mark_lines(void* /*stream*/) override {}
  bool lines_copied() override { return true; }

  // Only the flag: the mappings stay until release(), which comes after any call in flight.
  void interrupt_waits() override { abandoned_.store(true, std::memory_order_relaxed); }
  // This window's words, each loaded as the atomic it is.
  const uint8_t* read_flags_now() override {
    if (own_.size() == 0) return nullptr;
    flags_now_.resize(flags_.bytes());
    const uint8_t* flags = own_.data() + sizeof(WindowHead);
    for (size_t at = 0; at + sizeof(uint64_t) <= flags_now_.size(); at += sizeof(uint64_t)) {
      const uint64_t value = word_at(flags + at).load(std::memory_order_acquire);
      std::memcpy(flags_now_.data() + at, &value, sizeof(value));
    }
    return flags_now_.data();
  }
  bool run_flags_now(std::span<const FlagOp> ops) override {
    try {
      run_flags(ops, nullptr);
    } catch (const Error&) {
      return false;
    }
    return true;
  }
  // Freed whether settled or not: a peer's mapping holds the memory it still reads.
  void release(bool /*settled*/) override {
    imports_.clear();  // unmaps the peers' exported allocations
    peers_.clear();    // unmaps; their names were removed when the last peer opened them
    peer_pids_.clear();
    own_.close();
    abandoned_.store(false, std::memory_order_relaxed);
  }

 private:
  WindowView view(const HostWindow& window) const {
    return {window.data() + region_at_, window.size() - region_at_, stride_,
            window.data() + sizeof(WindowHead)};
  }

  const int nranks_;
  const protocol::FlagLayout flags_;
  size_t region_at_ = 0;  // where the slots (or the bound region) start in a window
  size_t stride_ = 0;
  HostWindow own_;
  std::vector<HostWindow> peers_;  // by rank; this rank's entry stays closed
  std::vector<pid_t> peer_pids_;
  std::vector<exports::HostImport> imports_;  // the peers' exported allocations, mapped
  std::vector<uint8_t> check_;
  std::vector<uint8_t> flags_now_;  // read_flags_now()'s
  std::atomic<bool> abandoned_{false};
  std::vector<int> held_;  // the files of the exports by descriptor
};

}  // namespace

std::unique_ptr<MemoryOps> make_host_memory(int nranks) {
  return std::make_unique<HostMemoryOps>(nranks);
}

}  // namespace magi::ce
