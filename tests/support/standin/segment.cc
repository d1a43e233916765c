#include "tests/support/standin/segment.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <thread>

#include "tests/support/standin/report.h"

namespace standin {

struct Segment::Header {
  // 0 while the creator sets the segment up, kReady after; joiners wait for kReady.
  std::atomic<uint32_t> layout_state;
  uint32_t nranks;
  uint64_t slot_bytes;
  uint64_t pair_bytes;
  uint64_t total_bytes;
  std::atomic<uint32_t> joined;
  std::atomic<uint32_t> doorbell;  // futex word
  std::atomic<uint32_t> sleepers;  // ring() skips the wake syscall when nobody sleeps
};

namespace {

constexpr uint32_t kReady = 0x5354414e;  // "STAN"
constexpr size_t kHeaderBytes = 4096;

static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "counters shared between processes must be address-free");

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

struct Layout {
  size_t slot_bytes, pair_bytes;
  size_t controls, pairs, slots, pair_slots, total;
};

Layout layout_for(int nranks, size_t slot_bytes, size_t pair_bytes) {
  const size_t n = static_cast<size_t>(nranks);
  Layout l{};
  l.slot_bytes = slot_bytes;
  l.pair_bytes = pair_bytes;
  l.controls = kHeaderBytes;
  l.pairs = round_up(l.controls + n * sizeof(RankControl), 4096);
  l.slots = round_up(l.pairs + n * n * sizeof(PairChannel), 4096);
  l.pair_slots = l.slots + n * slot_bytes;
  l.total = round_up(l.pair_slots + n * n * pair_bytes, 4096);
  return l;
}

// A slot must hold one element for each rank (the per-destination layouts) in 64-byte pieces.
size_t normalized_slot(int nranks, size_t requested) {
  return round_up(std::max({requested, size_t{1024}, static_cast<size_t>(nranks) * 64}), 64);
}

size_t pair_bytes_for(int nranks, size_t slot_bytes) {
  return std::max<size_t>(slot_bytes / static_cast<size_t>(nranks), 1024) / 64 * 64;
}

[[noreturn]] void fail_system(const std::string& what) {
  throw Failure(ncclSystemError, what + ": " + std::strerror(errno));
}

void* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) fail_system("mmap " + name);
  return p;
}

}  // namespace

std::shared_ptr<Segment> Segment::attach(const std::string& name, int nranks, size_t slot_bytes,
                                         double timeout_s) {
  std::shared_ptr<Segment> segment(new Segment());
  segment->name_ = name;
  segment->nranks_ = nranks;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(timeout_s > 0 ? timeout_s : 60.0);
  for (;;) {
    int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0) {
      // The creator: sizes the file and writes the layout before any joiner may read it.
      const size_t slot = normalized_slot(nranks, slot_bytes);
      const Layout l = layout_for(nranks, slot, pair_bytes_for(nranks, slot));
      if (::ftruncate(fd, static_cast<off_t>(l.total)) != 0) {
        int saved = errno;
        ::close(fd);
        ::shm_unlink(name.c_str());
        errno = saved;
        fail_system("ftruncate " + name);
      }
      segment->base_ = static_cast<std::byte*>(map_fd(fd, l.total, name));
      ::close(fd);
      segment->mapped_bytes_ = l.total;
      Header& h = segment->header();
      h.nranks = static_cast<uint32_t>(nranks);
      h.slot_bytes = l.slot_bytes;
      h.pair_bytes = l.pair_bytes;
      h.total_bytes = l.total;
      h.layout_state.store(kReady, std::memory_order_release);
      break;
    }
    if (errno != EEXIST) fail_system("shm_open " + name);
    fd = ::shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) {
      if (errno == ENOENT) continue;  // unlinked in between (a peer gave up): start afresh
      fail_system("shm_open " + name);
    }
    // A joiner: waits until the creator has sized the file and published the layout.
    struct stat st {};
    Header* h = nullptr;
    for (;;) {
      if (::fstat(fd, &st) != 0) fail_system("fstat " + name);
      if (static_cast<size_t>(st.st_size) >= kHeaderBytes) {
        if (h == nullptr) h = static_cast<Header*>(map_fd(fd, kHeaderBytes, name));
        if (h->layout_state.load(std::memory_order_acquire) == kReady) break;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        if (h != nullptr) ::munmap(h, kHeaderBytes);
        ::close(fd);
        throw Failure(ncclSystemError, "segment " + name + " was created but never set up");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    const uint32_t their_nranks = h->nranks;
    const size_t total = h->total_bytes;
    ::munmap(h, kHeaderBytes);
    if (their_nranks != static_cast<uint32_t>(nranks)) {
      ::close(fd);
      throw Failure(ncclInvalidUsage, format("communicator %s has %u ranks; this rank says %d",
                                             name.c_str(), their_nranks, nranks));
    }
    segment->base_ = static_cast<std::byte*>(map_fd(fd, total, name));
    ::close(fd);
    segment->mapped_bytes_ = total;
    break;
  }
  const Header& h = segment->header();
  const Layout l = layout_for(nranks, h.slot_bytes, h.pair_bytes);
  segment->slot_bytes_ = l.slot_bytes;
  segment->pair_bytes_ = l.pair_bytes;
  segment->controls_offset_ = l.controls;
  segment->pairs_offset_ = l.pairs;
  segment->slots_offset_ = l.slots;
  segment->pair_slots_offset_ = l.pair_slots;
  return segment;
}

Segment::~Segment() {
  if (base_ != nullptr) ::munmap(base_, mapped_bytes_);
}

Segment::Header& Segment::header() const { return *reinterpret_cast<Header*>(base_); }

bool Segment::claim(int rank) {
  int32_t expected = 0;
  return control(rank).owner_pid.compare_exchange_strong(expected, static_cast<int32_t>(::getpid()),
                                                         std::memory_order_acq_rel);
}

bool Segment::rank_alive(int rank) {
  const pid_t pid = control(rank).owner_pid.load(std::memory_order_acquire);
  return pid == 0 || ::kill(pid, 0) == 0 || errno != ESRCH;
}

void Segment::count_join() {
  const uint32_t now_joined = header().joined.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (now_joined == static_cast<uint32_t>(nranks_)) unlink_name();
  ring();
}

int Segment::joined() const {
  return static_cast<int>(header().joined.load(std::memory_order_acquire));
}

void Segment::unlink_name() {
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    report("shm_unlink %s: %s", name_.c_str(), std::strerror(errno));
  }
}

RankControl& Segment::control(int rank) {
  return reinterpret_cast<RankControl*>(base_ + controls_offset_)[rank];
}

PairChannel& Segment::pair(int sender, int receiver) {
  return reinterpret_cast<PairChannel*>(base_ + pairs_offset_)[sender * nranks_ + receiver];
}

std::byte* Segment::collective_slot(int rank) {
  return base_ + slots_offset_ + static_cast<size_t>(rank) * slot_bytes_;
}

std::byte* Segment::pair_slot(int sender, int receiver) {
  return base_ + pair_slots_offset_ +
         static_cast<size_t>(sender * nranks_ + receiver) * pair_bytes_;
}

uint32_t Segment::doorbell() const { return header().doorbell.load(std::memory_order_seq_cst); }

// Dekker-style pairing with sleep_unless_rung: either the sleeper's futex check sees the new
// doorbell value, or this load sees the sleeper and wakes it. No wake is lost.
void Segment::ring() {
  Header& h = header();
  h.doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h.sleepers.load(std::memory_order_seq_cst) != 0) {
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h.doorbell), FUTEX_WAKE, INT_MAX, nullptr,
              nullptr, 0);
  }
}

void Segment::sleep_unless_rung(uint32_t seen, std::chrono::microseconds limit) {
  Header& h = header();
  h.sleepers.fetch_add(1, std::memory_order_seq_cst);
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(limit.count() / 1000000);
  ts.tv_nsec = static_cast<long>(limit.count() % 1000000) * 1000;
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h.doorbell), FUTEX_WAIT, seen, &ts, nullptr, 0);
  h.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace standin
