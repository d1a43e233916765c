// The host backend of the transport: windows in POSIX shared memory, memcpy, and the bucket
// handshake of ce_transport.h on host atomics in each window's flags.
//
// The flag words lie where the protocol puts them (protocol.h's FlagLayout, one cache line each):
// a peer writes its ready, done and failed words into this rank's window, which this rank polls.
// Why a bucket cannot read a stale byte: a peer stores its ready >= n here (release) after its
// shards of bucket n are in its slot n % 2, and this rank loads it (acquire) before reading those
// bytes. Why it cannot overwrite a byte still being read: slot n % 2 is written only after every
// peer's done >= n - 2, and a peer stores done (release) only after its reads of that bucket.
// Why it cannot hang: every wait is on a peer that is either alive (and then gets there, as every
// rank runs the same buckets) or dead, which the wait notices through the peer's pid and reports.
#include <sched.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "base/base.h"
#include "ce_transport/backends.h"
#include "ce_transport/host_window.h"
#include "ce_transport/process.h"
#include "ce_transport/protocol.h"
#include "ce_transport/sample_plan.h"
#include "ce_transport/verify_schedule.h"

namespace magi::ce {
namespace {

// What the host backend adds to the protocol's blob header: the name of the window to open.
struct HostMedium {
  char name[64];
};

// ---- waiting ----------------------------------------------------------------------------------

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

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

// ---- the transport ----------------------------------------------------------------------------

class HostTransport final : public Transport {
 public:
  HostTransport(int rank, int nranks, uint64_t comm_identity, const Options::Fault& fault)
      : rank_(rank),
        nranks_(nranks),
        identity_(comm_identity),
        flags_{kCacheLine, nranks},
        faults_(fault, rank) {
    if (nranks < 1 || rank < 0 || rank >= nranks)
      throw Error(ErrorKind::Usage,
                  "rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  }
  ~HostTransport() override { release(); }

  void prepare(const WindowPlan& plan, HandleBlob& out) override {
    release();  // a new plan starts from a new window and bucket 1
    faults_.at_prepare();
    const size_t slot_bytes = plan.slot_bytes;
    const size_t stride = round_up(slot_bytes, kCacheLine);
    // Slots start on cache lines, so packed 64-byte-aligned slot offsets stay aligned in memory.
    slots_at_ = sizeof(WindowHead) + flags_.bytes();
    own_ =
        HostWindow::create(slots_at_ + (plan.bound ? 1 : 2) * stride, flags_.bytes(), nranks_ - 1);
    slot_bytes_ = slot_bytes;
    slot_stride_ = stride;
    bound_ = plan.bound;
    verify_.reset(plan.verify_first, plan.verify_every);
    if (bound_) {
      for (const BindOp& b : plan.bind) {
        if (b.bytes > slot_bytes_ || b.slot_offset > slot_bytes_ - b.bytes)
          throw Error(ErrorKind::Usage, "a binding overflows the bound region");
        copy_checked(own_.data() + slots_at_ + b.slot_offset, b.sendbuf, b.bytes);
      }
    }

    shape_ = {Backend::Host, identity_, nranks_, own_.size(), slot_bytes, bound_};
    HostMedium medium{};
    std::snprintf(medium.name, sizeof(medium.name), "%s", own_.name().c_str());
    protocol::write_blob(shape_, rank_, medium, out);
  }

  void attach(std::span<const HandleBlob> blobs) override {
    if (!own_.is_open()) throw Error(ErrorKind::Usage, "attach before prepare");
    if (attached_) throw Error(ErrorKind::Usage, "attach called twice for one window");
    if (blobs.size() != static_cast<size_t>(nranks_))
      throw Error(ErrorKind::Usage, std::to_string(blobs.size()) + " handle blobs for " +
                                        std::to_string(nranks_) + " ranks");
    faults_.at_attach();
    peers_.resize(static_cast<size_t>(nranks_));
    peer_pids_.assign(static_cast<size_t>(nranks_), 0);
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_) continue;
      protocol::BlobHeader header{};
      const auto medium =
          protocol::read_blob<HostMedium>(blobs[static_cast<size_t>(r)], r, shape_, header);
      if (strnlen(medium.name, sizeof(medium.name)) == sizeof(medium.name))
        throw Error(ErrorKind::Usage,
                    "rank " + std::to_string(r) + "'s handle blob has no window name");
      HostWindow& peer = peers_[static_cast<size_t>(r)];
      peer = HostWindow::open(std::string(medium.name, strnlen(medium.name, sizeof(medium.name))),
                              header.window_bytes, nranks_ - 1);
      const auto pid = static_cast<pid_t>(peer.head().pid.value.load(std::memory_order_acquire));
      if (pid != header.pid)
        throw Error(ErrorKind::Usage, "rank " + std::to_string(r) + "'s window belongs to pid " +
                                          std::to_string(pid) + ", its blob says " +
                                          std::to_string(header.pid));
      // A peer whose pid this process cannot see (another pid namespace) could never be told
      // apart from a dead one while waiting: refuse it now.
      if (!process_alive(pid)) peer_gone(r, pid);
      peer_pids_[static_cast<size_t>(r)] = pid;
    }
    attached_ = true;
  }

  Served gather(std::span<const GatherOp> bucket, void* /*stream*/,
                Timing timing = Timing::Untimed) override {
    if (!attached_) throw Error(ErrorKind::Usage, "gather before attach");
    if (broken_)
      throw Error(ErrorKind::System, "an earlier bucket failed; this window is unusable");
    if (abandoned_.load(std::memory_order_relaxed))
      throw Error(ErrorKind::Usage, "gather after the communicator was aborted");
    faults_.at_bucket_start();
    for (const GatherOp& op : bucket)
      if (op.bytes > slot_bytes_ || op.slot_offset > slot_bytes_ - op.bytes)
        throw Error(ErrorKind::Usage, "gather of " + std::to_string(op.bytes) +
                                          " bytes at slot offset " +
                                          std::to_string(op.slot_offset) + " overflows a slot of " +
                                          std::to_string(slot_bytes_));
    if (bound_) {
      gather_bound(bucket, timing);
      return Served::Moved;
    }
    broken_ = true;  // until this bucket completes: a throw below leaves the ranks out of step
    const uint64_t n = ++sequence_;
    const size_t slot_offset = slots_at_ + (n % 2) * slot_stride_;

    wait_for_every_peer(flags_.done(0), n > 2 ? n - 2 : 0);  // 0: nothing to wait for
    // A rank that cannot serve says so before its ready: every peer, once its wait for ready is
    // over, sees it, and the whole bucket falls back together (done is still published, so the
    // slots stay in step for the buckets after). It waited above like a serving rank: running
    // ahead, its next failure could overwrite this one before a peer read it.
    if (faults_.fails_bucket()) {
      publish(flags_.failed(rank_, n), n, std::memory_order_relaxed);
      publish(flags_.ready(rank_), n, std::memory_order_release);
      publish(flags_.done(rank_), n, std::memory_order_release);
      broken_ = false;
      return Served::FallBack;
    }
    uint8_t* staging = own_.data() + slot_offset;
    for (const GatherOp& op : bucket) std::memcpy(staging + op.slot_offset, op.sendbuf, op.bytes);
    publish(flags_.ready(rank_), n, std::memory_order_release);

    wait_for_every_peer(flags_.ready(0), n);
    for (int r = 0; r < nranks_; ++r) {
      if (r != rank_ && own_.flag(flags_.failed(r, n)).load(std::memory_order_relaxed) == n) {
        publish(flags_.done(rank_), n, std::memory_order_release);
        broken_ = false;
        return Served::FallBack;
      }
    }
    for (const GatherOp& op : bucket) {
      auto* recv = static_cast<uint8_t*>(op.recvbuf);
      for (int r = 0; r < nranks_; ++r) {
        uint8_t* into = recv + static_cast<size_t>(r) * op.bytes;
        if (r == rank_) {
          if (into != op.sendbuf) std::memcpy(into, op.sendbuf, op.bytes);  // else in place
          continue;
        }
        const uint8_t* from = peers_[static_cast<size_t>(r)].data() + slot_offset + op.slot_offset;
        std::memcpy(into, from, op.bytes);
      }
    }
    publish(flags_.done(rank_), n, std::memory_order_release);
    broken_ = false;
    return Served::Moved;
  }

  // Static weights: every peer's shard has been in its region since before the plan was
  // confirmed, so a call is only reads. The rank's own shard is checked against its region now
  // and then, on the sampled lines of sample_plan.h (the user asserted it does not change; if it
  // did, peers read stale bytes until the next agreement round takes the gather back to NCCL, and
  // the whole region is re-bound meanwhile).
  void gather_bound(std::span<const GatherOp> bucket, Timing timing) {
    ++sequence_;
    for (const GatherOp& op : bucket) {
      auto* recv = static_cast<uint8_t*>(op.recvbuf);
      uint8_t* region = own_.data() + slots_at_ + op.slot_offset;
      if (op.verify_now) verify_.owe(op.slot_offset);
      if (verify_.on_call(op.slot_offset, timing) && !samples_match(op, region)) {
        std::memcpy(region, op.sendbuf, op.bytes);
        stale_.push_back(op.slot_offset);
      }
      for (int r = 0; r < nranks_; ++r) {
        uint8_t* into = recv + static_cast<size_t>(r) * op.bytes;
        if (r == rank_) {
          if (into != op.sendbuf) std::memcpy(into, op.sendbuf, op.bytes);
          continue;
        }
        std::memcpy(into, peers_[static_cast<size_t>(r)].data() + slots_at_ + op.slot_offset,
                    op.bytes);
      }
    }
  }

  std::vector<size_t> take_stale_bindings() override { return std::exchange(stale_, {}); }
  uint64_t checked_bytes() const override { return checked_bytes_; }

  // Only the flag: the mappings stay until release(), which comes after any call in flight.
  void abandon() override { abandoned_.store(true, std::memory_order_relaxed); }

  void release() override {
    peers_.clear();  // unmaps; their names were removed when the last peer opened them
    peer_pids_.clear();
    own_.close();
    slot_bytes_ = slot_stride_ = 0;
    shape_ = {};
    sequence_ = 0;
    bound_ = false;
    verify_.reset(0, 0);
    checked_bytes_ = 0;
    stale_.clear();
    attached_ = broken_ = false;
    abandoned_.store(false, std::memory_order_relaxed);
  }

  size_t window_bytes() const override { return own_.size(); }

 private:
  // The check of `op`'s binding that verify_ asked for: its anchor and sweep lines.
  bool samples_match(const GatherOp& op, const uint8_t* region) {
    const SamplePlan plan(op.bytes);
    const SampleSet anchor = plan.anchor();
    const SampleSet sweep = plan.sweep(verify_.begin_check(op.slot_offset));
    const auto* shard = static_cast<const uint8_t*>(op.sendbuf);
    checked_bytes_ += anchor.bytes() + (sweep.first != 0 ? sweep.bytes() : 0);
    return same_lines(shard, region, anchor) &&
           (sweep.first == 0 || same_lines(shard, region, sweep));
  }

  // Until every peer's word of a kind (`rank0_word`: rank 0's, e.g. flags_.done(0)) in this
  // rank's own window reaches `target`. The words of one kind lie one line apart, by rank.
  void wait_for_every_peer(size_t rank0_word, uint64_t target) const {
    if (target == 0) return;
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_) continue;
      const std::atomic<uint64_t>& flag =
          own_.flag(rank0_word + static_cast<size_t>(r) * flags_.line_bytes);
      wait_for(r, peer_pids_[static_cast<size_t>(r)], abandoned_,
               [&] { return flag.load(std::memory_order_acquire) >= target; });
    }
  }

  // This rank's word at `word` in every peer's window.
  void publish(size_t word, uint64_t value, std::memory_order order) const {
    for (int r = 0; r < nranks_; ++r)
      if (r != rank_) peers_[static_cast<size_t>(r)].flag(word).store(value, order);
  }

  const int rank_;
  const int nranks_;
  const uint64_t identity_;
  HostWindow own_;
  const protocol::FlagLayout flags_;
  size_t slots_at_ = 0;          // where the slots (or the bound region) start in a window
  protocol::WindowShape shape_;  // what every peer's blob must match
  const protocol::FaultPoints faults_;
  std::vector<HostWindow> peers_;  // by rank; this rank's entry stays closed
  std::vector<pid_t> peer_pids_;
  size_t slot_bytes_ = 0;
  size_t slot_stride_ = 0;
  uint64_t sequence_ = 0;  // the last bucket started
  bool bound_ = false;
  VerifySchedule verify_;  // bound: when each binding is checked
  std::vector<size_t> stale_;
  uint64_t checked_bytes_ = 0;
  bool attached_ = false;
  bool broken_ = false;
  std::atomic<bool> abandoned_{false};
};

}  // namespace

std::unique_ptr<Transport> make_host_transport(int rank, int nranks, uint64_t comm_identity,
                                               const Options::Fault& fault) {
  return std::make_unique<HostTransport>(rank, nranks, comm_identity, fault);
}

}  // namespace magi::ce
