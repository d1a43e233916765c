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
#include "ce_transport/exports.h"
#include "ce_transport/host_window.h"
#include "ce_transport/process.h"
#include "ce_transport/protocol.h"
#include "ce_transport/sample_plan.h"
#include "ce_transport/source_log.h"
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
    bound_ = plan.bound;
    zero_copy_ = plan.bound && plan.zero_copy;
    if (bound_) {
      sources_ = exports::bound_sources(plan, Backend::Host);
      bind_ = plan.bind;
      bind_index_.reset(plan.bind);
      references_.reset(plan.bind.size());
    }
    // Slots start on cache lines, so packed 64-byte-aligned slot offsets stay aligned in memory.
    slots_at_ = sizeof(WindowHead) + flags_.bytes();
    const size_t region = bound_ ? round_up(sources_.region_bytes, kCacheLine) : 2 * stride;
    own_ = HostWindow::create(slots_at_ + region, flags_.bytes(), nranks_ - 1);
    slot_bytes_ = slot_bytes;
    slot_stride_ = stride;
    verify_.reset(plan.verify_first, plan.verify_every);
    if (bound_) {
      for (size_t i = 0; i < plan.bind.size(); ++i) {
        const BindOp& b = plan.bind[i];
        if (b.bytes > slot_bytes_ || b.slot_offset > slot_bytes_ - b.bytes)
          throw Error(ErrorKind::Usage, "a binding overflows the bound region");
        const ShardSource& source = sources_.table.sources[i];
        if (source.allocation == ShardSource::kInWindow)
          copy_checked(own_.data() + slots_at_ + source.offset, b.sendbuf, b.bytes);
      }
    }

    shape_ = {Backend::Host,
              identity_,
              nranks_,
              own_.size(),
              zero_copy_ ? sources_.region_bytes : slot_bytes,
              bound_,
              zero_copy_};
    if (bound_) log_.create(rank_, nranks_);
    HostMedium medium{};
    std::snprintf(medium.name, sizeof(medium.name), "%s", own_.name().c_str());
    protocol::write_blob(shape_, rank_, bound_ ? log_.name() : std::string(), medium, out);
  }

  const SourceTable& sources() const override {
    static const SourceTable kNone;
    return zero_copy_ ? sources_.table : kNone;
  }

  void attach(std::span<const HandleBlob> blobs, std::span<const SourceTable> tables) override {
    if (!own_.is_open()) throw Error(ErrorKind::Usage, "attach before prepare");
    if (attached_) throw Error(ErrorKind::Usage, "attach called twice for one window");
    if (blobs.size() != static_cast<size_t>(nranks_))
      throw Error(ErrorKind::Usage, std::to_string(blobs.size()) + " handle blobs for " +
                                        std::to_string(nranks_) + " ranks");
    if (zero_copy_ && tables.size() != static_cast<size_t>(nranks_))
      throw Error(ErrorKind::Usage, "a zero-copy window needs every rank's source table");
    faults_.at_attach();
    peers_.resize(static_cast<size_t>(nranks_));
    peer_pids_.assign(static_cast<size_t>(nranks_), 0);
    std::vector<std::string> logs(static_cast<size_t>(nranks_));
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_) continue;
      protocol::BlobHeader header{};
      const auto medium =
          protocol::read_blob<HostMedium>(blobs[static_cast<size_t>(r)], r, shape_, header);
      logs[static_cast<size_t>(r)] = protocol::source_log_of(header);
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
    if (bound_) {
      // Each peer's shards: in its window's region, or in its exported allocations, mapped here.
      std::vector<exports::Span> regions(static_cast<size_t>(nranks_));
      for (int r = 0; r < nranks_; ++r)
        if (r != rank_)
          regions[static_cast<size_t>(r)] = {peers_[static_cast<size_t>(r)].data() + slots_at_,
                                             peers_[static_cast<size_t>(r)].size() - slots_at_};
      peer_sources_ = exports::locate_peer_sources(
          rank_, bind_, zero_copy_ ? tables : std::span<const SourceTable>{}, regions,
          [&](const ExportRecord& record) {
            imports_.push_back(exports::HostImport::open(record));
            return exports::Span{imports_.back().data(), imports_.back().size()};
          });
      log_.open_peers(logs);
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

  // Static weights: every peer's shard has been where it is read since before the plan was
  // confirmed (its region, or its own memory), so a call is only reads. The rank's own shard is
  // checked now and then, on the sampled lines of sample_plan.h (the user asserted it does not
  // change; if it did, the gather goes back to NCCL at the next agreement round): a bound shard
  // against its binding (re-bound whole on a mismatch), an exported one as check_in_place says.
  void gather_bound(std::span<const GatherOp> bucket, Timing timing) {
    const uint64_t n = ++sequence_;
    const size_t shards = bind_.size();
    for (const GatherOp& op : bucket) {
      const int64_t index = bind_index_.find(op.slot_offset);
      if (index < 0)
        throw Error(ErrorKind::Usage, "a gather at slot offset " + std::to_string(op.slot_offset) +
                                          " that the plan did not bind");
      const auto i = static_cast<size_t>(index);
      if (op.own_offset != GatherOp::kOwn && op.own_offset != op.slot_offset)
        log_.deviate(n, op.own_offset, op.slot_offset);
      if (op.verify_now) verify_.owe(op.slot_offset);
      if (verify_.on_call(op.slot_offset, timing) && !check(op, i))
        stale_.push_back(op.slot_offset);
      auto* recv = static_cast<uint8_t*>(op.recvbuf);
      for (int r = 0; r < nranks_; ++r) {
        uint8_t* into = recv + static_cast<size_t>(r) * op.bytes;
        if (r == rank_) {
          if (into != op.sendbuf) std::memcpy(into, op.sendbuf, op.bytes);
          continue;
        }
        std::memcpy(into, peer_sources_[static_cast<size_t>(r) * shards + i], op.bytes);
      }
    }
    log_.publish(n);
  }

  std::vector<size_t> take_stale_bindings() override { return std::exchange(stale_, {}); }
  uint64_t checked_bytes() const override { return checked_bytes_; }
  std::string take_disagreement() override { return log_.check(); }

  // Only the flag: the mappings stay until release(), which comes after any call in flight.
  void abandon() override { abandoned_.store(true, std::memory_order_relaxed); }

  void release() override {
    log_.close();
    peer_sources_.clear();
    imports_.clear();  // unmaps the peers' exported allocations
    sources_ = {};
    bind_.clear();
    zero_copy_ = false;
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

  WindowMemory memory() const override {
    WindowMemory m = sources_.memory;
    m.window_bytes = own_.size();
    m.peer_mappings = imports_.size();
    return m;
  }

 private:
  // The check verify_ asked for, of the shard of binding `i` that `op` sends: false when it
  // found a change (anchor and sweep lines, sample_plan.h).
  bool check(const GatherOp& op, size_t i) {
    const SamplePlan plan(op.bytes);
    const SampleSet anchor = plan.anchor();
    const SampleSet sweep = plan.sweep(verify_.begin_check(op.slot_offset));
    const bool sweeps = sweep.first != 0;
    checked_bytes_ += anchor.bytes() + (sweeps ? sweep.bytes() : 0);
    const auto* shard = static_cast<const uint8_t*>(op.sendbuf);
    const ShardSource& source = sources_.table.sources[i];
    if (source.allocation == ShardSource::kInWindow) {
      uint8_t* region = own_.data() + slots_at_ + source.offset;
      if (same_lines(shard, region, anchor) && (!sweeps || same_lines(shard, region, sweep)))
        return true;
      // Sent from elsewhere: the peers read bytes this call does not send (exports.h).
      if (exports::sent_elsewhere(op, bind_[i]))
        log_.mark_broken(sequence_, bind_[i].slot_offset);
      else
        std::memcpy(region, shard, op.bytes);
      return false;
    }
    return check_in_place(op, i, shard, anchor, sweeps ? sweep : SampleSet{});
  }

  // An exported shard has no binding: the peers read the agreed source in place. It must still
  // hold what the first check saw (a rewrite in place, or a caching allocator that gave its block
  // to another tensor, fails this), unless its allocation is gone: then the peers' mappings keep
  // the old pages (exports.h). A call that sends another buffer (a re-homed shard) must send the
  // same bytes too. Each set is compared by its hash with the first look at it.
  bool check_in_place(const GatherOp& op, size_t i, const uint8_t* shard, const SampleSet& anchor,
                      const SampleSet& sweep) {
    const auto* agreed = static_cast<const uint8_t*>(bind_[i].sendbuf);
    const uint16_t allocation = sources_.table.sources[i].allocation;
    const bool alive = exports::host_export_alive(sources_.export_bases[allocation],
                                                  sources_.identities[allocation]);
    bool same = true;
    auto look = [&](const uint8_t* at, const SampleSet& set) {
      if (set.lines() != 0 &&
          !references_.matches(i, set.first, exports::hash_lines(at, set, scratch_)))
        same = false;
    };
    if (alive) {
      look(agreed, anchor);
      look(agreed, sweep);
    }
    if (shard != agreed || !alive) {
      // Compared only with references the agreed source set: a re-homed shard is not its own.
      if (references_.has(i, anchor.first)) look(shard, anchor);
      if (sweep.lines() != 0 && references_.has(i, sweep.first)) look(shard, sweep);
    }
    // The program sends from elsewhere now (re-homed, another position's shard, or a new
    // allocation at the old address), and the bytes differ: the allocator gave the block the
    // peers read to another tensor, or the call's shard is not the one they read. The promise may
    // have held; this rank's peers still read wrong bytes, and must hear of it (source_log.h).
    if (!same && (!alive || exports::sent_elsewhere(op, bind_[i])))
      log_.mark_broken(sequence_, bind_[i].slot_offset);
    return same;
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
  bool zero_copy_ = false;
  exports::SourcePlan sources_;               // bound: where each of this rank's shards is read
  std::vector<BindOp> bind_;                  // bound: the agreed sources, by bind index
  exports::BindIndex bind_index_;             // slot offset -> bind index
  std::vector<const uint8_t*> peer_sources_;  // [peer * shards + bind index]
  std::vector<exports::HostImport> imports_;  // the peers' exported allocations, mapped
  exports::SampleReferences references_;      // exported shards: what the first looks saw
  std::vector<uint8_t> scratch_;
  SourceLog log_;          // bound: what this rank read, for its peers to compare
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
