// The transport, once for every kind of memory (memory_ops.h): windows, handles, the bucket
// handshake of ce_transport.h, and static weights read where they are bound or exported.
//
// The flag words lie where the protocol puts them (protocol.h's FlagLayout): a peer writes its
// ready, done (and, on synchronous memory, failed) words into this rank's window, and this rank
// waits only on words of its own window. Every step of a bucket runs in the caller's order:
// synchronous memory does it before the operation returns (stores release, loads acquire), device
// memory queues it on the caller's stream (a stream write carries the memory barrier that
// precedes it by default, a stream wait holds back what is queued after it).
// Why a bucket cannot read a stale byte: a peer writes its ready >= n here after its shards of
// bucket n are in its slot n % 2, and this rank reads that slot only after its wait for that
// ready. Why it cannot overwrite a byte still being read: slot n % 2 is written only after every
// peer's done >= n - 2, and a peer writes done only after its reads of that bucket.
// Why it cannot hang: on synchronous memory every wait is on a peer that is either alive (and
// then gets there, as every rank runs the same buckets) or dead, which the wait notices through
// the peer's pid and reports; on a stream, a wait holds the stream as NCCL's kernels would, until
// the communicator is aborted, which releases this rank's waits by writing its own words
// (abandon(), window_end.h), and a window on a stream is freed only once it has settled.
// Everything here decides which words a step reads and writes; the memory only executes.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/base.h"
#include "ce_transport/descriptor_offers.h"
#include "ce_transport/exports.h"
#include "ce_transport/mapping_turns.h"
#include "ce_transport/memory_ops.h"
#include "ce_transport/process.h"
#include "ce_transport/protocol.h"
#include "ce_transport/sample_plan.h"
#include "ce_transport/source_log.h"
#include "ce_transport/verify_schedule.h"
#include "ce_transport/window_end.h"

namespace magi::ce {
namespace {

// pace_mappings_on_this_thread (ce_transport.h): after each mapping of a set-up made off the
// program's calls, a pause as long as the mapping took (within these bounds), which lets the
// program's CUDA calls waiting behind it in: the set-up holds the driver at most half the time,
// and a mapping of a few KiB costs the set-up a few µs, not a fixed tenth of a millisecond.
// The ranks on one GPU also take turns at it (mapping_turns.h).
thread_local bool t_pace_mappings = false;
constexpr std::chrono::microseconds kMappingPauseMin{20};
constexpr std::chrono::microseconds kMappingPauseMax{1000};

class WindowTransport final : public Transport {
 public:
  WindowTransport(std::unique_ptr<MemoryOps> memory, int rank, int nranks, uint64_t identity,
                  const Options::Fault& fault)
      : memory_(std::move(memory)),
        rank_(rank),
        nranks_(nranks),
        identity_(identity),
        flags_(memory_->flags()),
        faults_(fault, rank),
        offers_(identity, rank) {}
  ~WindowTransport() override {
    try {
      release();
    } catch (...) {}
  }

  void prepare(const WindowPlan& plan, HandleBlob& out) override {
    std::lock_guard<std::mutex> lock(lifetime_);
    const OwnCalls own_calls(*memory_);
    release_locked();  // a new plan starts from a new window and bucket 1
    faults_.at_prepare();
    memory_->use_on_any_thread();
    slot_bytes_ = plan.slot_bytes;
    bound_ = plan.bound;
    graph_slots_ = !plan.bound && plan.graph_slots;
    zero_copy_ = plan.bound && plan.zero_copy;
    if (bound_) {
      const auto find = memory_->export_finder();
      sources_ = exports::bound_sources(plan, [&](const BindOp& b) {
        return offers_.offered(find(b.sendbuf, b.bytes), *memory_);
      });
      bind_ = plan.bind;
      bind_index_.reset(plan.bind);
      references_.reset(plan.bind.size());
    }
    verify_.reset(plan.verify_first, plan.verify_every);
    own_ = memory_->allocate(bound_ ? sources_.region_bytes : slot_bytes_, bound_, graph_slots_,
                             protocol::first_flags(flags_), bound_ ? 0 : plan.held_bytes);
    held_bytes_ = own_.held != nullptr ? plan.held_bytes : 0;
    if (bound_) bind_shards(plan);
    shape_ = {memory_->backend(),
              identity_,
              nranks_,
              memory_->window_bytes(),
              zero_copy_ ? sources_.region_bytes : slot_bytes_,
              bound_,
              zero_copy_};
    Medium medium{};
    memory_->export_window(medium);
    if (bound_) log_.create(rank_, nranks_);
    protocol::write_blob(shape_, rank_, bound_ ? log_.name() : std::string(), medium, out);
  }

  const SourceTable& sources() const override {
    static const SourceTable kNone;
    return zero_copy_ ? sources_.table : kNone;
  }

  void attach(std::span<const HandleBlob> blobs, std::span<const SourceTable> tables) override {
    const OwnCalls own_calls(*memory_);
    if (memory_->window_bytes() == 0) throw Error(ErrorKind::Usage, "attach before prepare");
    if (attached_) throw Error(ErrorKind::Usage, "attach called twice for one window");
    if (blobs.size() != static_cast<size_t>(nranks_))
      throw Error(ErrorKind::Usage, std::to_string(blobs.size()) + " handle blobs for " +
                                        std::to_string(nranks_) + " ranks");
    if (zero_copy_ && tables.size() != static_cast<size_t>(nranks_))
      throw Error(ErrorKind::Usage, "a zero-copy window needs every rank's source table");
    faults_.at_attach();
    std::lock_guard<std::mutex> lock(lifetime_);
    peers_.assign(static_cast<size_t>(nranks_), WindowView{});
    std::vector<std::string> logs(static_cast<size_t>(nranks_));
    std::vector<protocol::BlobHeader> headers(static_cast<size_t>(nranks_));
    std::vector<Medium> media(static_cast<size_t>(nranks_));
    std::vector<pid_t> pids(static_cast<size_t>(nranks_), 0);
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_) continue;
      const auto i = static_cast<size_t>(r);
      media[i] = protocol::read_blob<Medium>(blobs[i], r, shape_, headers[i]);
      pids[i] = static_cast<pid_t>(headers[i].pid);
    }
    memory_->begin_attach(pids);
    // Before any mapping: a peer may already be asking for this rank's exports by descriptor.
    offers_.allow(faults_.refuses_descriptors() ? std::span<const pid_t>{}
                                                : std::span<const pid_t>(pids));
    peer_pids_ = pids;
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_) continue;
      const auto i = static_cast<size_t>(r);
      logs[i] = protocol::source_log_of(headers[i]);
      peers_[i] = memory_->map_peer(r, headers[i], media[i]);
    }
    if (bound_) {
      log_.open_peers(logs);  // first: the mapping turns live in the logs
      const MappingTurns turns = mapping_turns(media);
      // Each peer's shards: in its window's region, or in its exported allocations, mapped here.
      std::vector<exports::Span> regions(static_cast<size_t>(nranks_));
      for (int r = 0; r < nranks_; ++r)
        if (r != rank_)
          regions[static_cast<size_t>(r)] = {peers_[static_cast<size_t>(r)].region,
                                             peers_[static_cast<size_t>(r)].region_bytes};
      peer_sources_ = exports::locate_peer_sources(
          rank_, bind_, zero_copy_ ? tables : std::span<const SourceTable>{}, regions,
          [&](const ExportRecord& record) {
            if (!t_pace_mappings || !memory_->paces_mappings()) return memory_->import(record);
            exports::Span mapped;
            std::chrono::steady_clock::duration took;
            {
              const MappingTurns::Turn turn(turns);
              const auto began = std::chrono::steady_clock::now();
              mapped = memory_->import(record);
              took = std::chrono::steady_clock::now() - began;
            }
            std::this_thread::sleep_for(std::clamp<std::chrono::steady_clock::duration>(
                took, kMappingPauseMin, kMappingPauseMax));
            return mapped;
          });
    }
    attached_ = true;
  }

  Served gather(std::span<const GatherOp> bucket, void* stream, Timing timing = Timing::Untimed,
                PartWriter* writer = nullptr) override {
    if (!attached_) throw Error(ErrorKind::Usage, "gather before attach");
    if (broken_)
      throw Error(ErrorKind::System, "an earlier bucket failed; this window is unusable");
    if (abandoned_.load())
      throw Error(ErrorKind::Usage, "gather after the communicator was aborted");
    faults_.at_bucket_start();
    memory_->use();
    for (const GatherOp& op : bucket) {
      const size_t part = op.bytes * op.pieces;  // what the rank stages of it
      if (part > slot_bytes_ || op.slot_offset > slot_bytes_ - part)
        throw Error(ErrorKind::Usage, "gather of " + std::to_string(op.bytes) + " bytes (" +
                                          std::to_string(op.pieces) + " pieces) at slot offset " +
                                          std::to_string(op.slot_offset) + " overflows a slot of " +
                                          std::to_string(slot_bytes_));
      if (op.pieces > 1 && bound_) throw Error(ErrorKind::Usage, "a gather of pieces is staged");
      if (op.own_source != nullptr && !holds(op))
        throw Error(ErrorKind::Usage,
                    "an own piece named for pieces outside the window's held region");
      if (op.own_source != nullptr && timing == Timing::Captured)
        throw Error(ErrorKind::Usage, "held pieces in a captured bucket");
      if (op.sendbuf == nullptr && (op.pieces == 1 || writer == nullptr) && op.bytes != 0)
        throw Error(ErrorKind::Usage,
                    "a gather without a send buffer is two levels' (pieces), "
                    "written by the bucket's PartWriter");
    }
    if (timing == Timing::Captured && !bound_ && !graph_slots_)
      throw Error(ErrorKind::Usage,
                  "a captured bucket on a staged window without graph slots (its handshake "
                  "counts buckets, which a replay repeats)");
    // Every bucket has a sequence number (what the source log says); the eager ones are counted
    // apart, since only they write the counters the eager handshake waits for: a rank's n-th
    // eager bucket meets its peers' n-th whatever graphs were captured between them.
    const uint64_t n = sequence_.load() + 1;
    sequence_.store(n);
    if (timing == Timing::Captured) {
      if (bound_)
        gather_captured(bucket, n, stream);
      else
        gather_captured_staged(bucket, stream, writer);
      return Served::Moved;
    }
    const uint64_t eager = eager_.load() + 1;
    eager_.store(eager);
    if (bound_) {
      gather_bound(bucket, n, eager, stream, timing);
      return Served::Moved;
    }
    return gather_staged(bucket, eager, stream, writer, timing);
  }

  // Synchronous memory: the waits running on threads give up. On a stream: a healthy abort (the
  // program's shutdown) finds every bucket run or about to be; anything else is released at once
  // (a dead peer) or after a short grace (a peer that stalls). A graph's latches are opened in
  // any case: a replay may come after the eager buckets settled, and would wait on peers that no
  // longer serve it (window_end.h).
  void abandon() override {
    std::lock_guard<std::mutex> lock(lifetime_);
    const OwnCalls own_calls(*memory_);
    abandoned_.store(true);
    if (!attached_) return;
    if (memory_->synchronous()) {
      memory_->interrupt_waits();
      return;
    }
    memory_->use_on_any_thread();
    const uint64_t last = settling_bucket();
    std::string unfinished;  // not said: an abort that finds a bucket in flight says so at release
    if (settle(*memory_, flags_, rank_, peer_pids_, last, kAbortGrace, unfinished) ==
        Settled::Finished) {
      settled_at_ = last;
      release_waits(false);
    } else {
      release_waits(true);
    }
  }

  void release() override {
    std::lock_guard<std::mutex> lock(lifetime_);
    const OwnCalls own_calls(*memory_);
    release_locked();
  }

  size_t window_bytes() const override { return memory_->window_bytes(); }

  WindowMemory memory() const override {
    WindowMemory m = sources_.memory;
    m.window_bytes = window_bytes();
    m.peer_mappings = memory_->imports();
    return m;
  }

  // A peer's process gone without its left word (protocol.h): it died with the communicator in
  // use. Never waits for a prepare, attach or release in flight: asked again later.
  std::string lost_peer() override {
    std::unique_lock<std::mutex> lock(lifetime_, std::try_to_lock);
    if (!lock.owns_lock() || !attached_) return {};
    const OwnCalls own_calls(*memory_);
    for (int r = 0; r < nranks_; ++r) {
      const pid_t pid = peer_pids_[static_cast<size_t>(r)];
      if (r == rank_ || pid <= 0 || process_alive(pid)) continue;
      try {
        if (memory_->read_word_now(peers_[static_cast<size_t>(r)].flags + flags_.left()) != 0)
          continue;
      } catch (const Error&) {
        continue;  // unknown this time: asked again later
      }
      return "rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ")";
    }
    return {};
  }

  std::vector<size_t> take_stale_bindings() override { return std::exchange(stale_, {}); }
  uint8_t* held_region() const override { return held_bytes_ != 0 ? own_.held : nullptr; }
  uint64_t checked_bytes() const override { return checked_bytes_; }
  std::string take_disagreement() override { return log_.check(); }

 private:
  // Bound windows: every shard that is not read in place is copied into the region, at its
  // source's offset.
  void bind_shards(const WindowPlan& plan) {
    std::vector<Copy> shards;
    for (size_t i = 0; i < plan.bind.size(); ++i) {
      const BindOp& b = plan.bind[i];
      if (b.bytes > slot_bytes_ || b.slot_offset > slot_bytes_ - b.bytes)
        throw Error(ErrorKind::Usage, "a binding overflows the bound region");
      const ShardSource& source = sources_.table.sources[i];
      if (b.bytes == 0 || source.allocation != ShardSource::kInWindow) continue;
      shards.push_back({own_.region + source.offset, b.sendbuf, b.bytes});
    }
    memory_->bind(shards);
  }

  // The handshake of ce_transport.h. Only synchronous memory can fall back within a bucket: a
  // rank that cannot serve says so before its ready, and every peer sees it once its wait for
  // ready is over. On a stream nothing of the bucket has run when gather() returns, so a failing
  // rank throws, before queuing anything, and its peers' streams wait for it (ce_transport.h).
  Served gather_staged(std::span<const GatherOp> bucket, uint64_t n, void* stream,
                       PartWriter* writer, Timing timing) {
    const bool synchronous = memory_->synchronous();
    if (held_bytes_ != 0) finish_check(stream);
    const bool refuses =
        faults_.fails_bucket() ||
        std::any_of(bucket.begin(), bucket.end(), [](const GatherOp& op) { return op.refuse; });
    if (refuses && !synchronous)
      throw Error(ErrorKind::Cuda,
                  "bucket " + std::to_string(n) + ": injected by MAGI_INJECT_FAULT");
    // Until this bucket completes: a throw below leaves the ranks out of step. Known only where
    // the handshake runs here; on a stream, the peers wait for this rank until the abort.
    broken_ = synchronous;
    memory_->follow_last_bucket(stream, false);
    const size_t slot = (n % 2) * own_.slot_stride;
    // 1. Slot n % 2 was last read in bucket n - 2: every peer must be done with it.
    flag_ops_.clear();
    if (n > 2) add_waits(flags_.done(0), n - 2);
    memory_->run_flags(flag_ops_, stream);
    // A rank that cannot serve waited above like a serving rank: running ahead, its next failure
    // could overwrite this one before a peer read it. Done is still published, so the slots stay
    // in step for the buckets after.
    const auto refuse = [&] {
      flag_ops_.clear();
      add_writes(flags_.failed(rank_, n), n);
      add_writes(flags_.ready(rank_), n);
      memory_->run_flags(flag_ops_, stream);
      finish_staged(n, stream);
      broken_ = false;
      return Served::FallBack;
    };
    if (refuses) return refuse();
    // 2. Stage this rank's shards; two levels: the writer's parts, now that the slot is free.
    add_stages(bucket, slot);
    memory_->copy_batch(copies_, stream);
    if (writer != nullptr && !writer->write_parts(bucket, own_.region + slot, stream)) {
      if (synchronous) return refuse();
      throw Error(ErrorKind::System,
                  "bucket " + std::to_string(n) + ": this rank's part between machines failed");
    }
    // 3. Staged: say so in every peer's window, and wait until every peer has said so in ours.
    flag_ops_.clear();
    add_writes(flags_.ready(rank_), n);
    add_waits(flags_.ready(0), n);
    memory_->run_flags(flag_ops_, stream);
    if (synchronous)
      for (int r = 0; r < nranks_; ++r)
        if (r != rank_ && memory_->read_flag(own_.flags + flags_.failed(r, n)) == n) {
          finish_staged(n, stream);
          broken_ = false;
          return Served::FallBack;
        }
    // 4. Read every peer's slot, and this rank's shard from its send buffer.
    copies_.clear();
    add_reads(
        bucket,
        [&](int r, const GatherOp& op) {
          return peers_[static_cast<size_t>(r)].region + slot + op.slot_offset;
        },
        own_.region + slot);
    memory_->copy_batch(copies_, stream);
    // Held pieces: this rank's own compared with the one the other machines took; before the
    // bucket's end, so a release that sees it finished knows the check's copies have run too.
    if (held_bytes_ != 0) start_held_check(bucket, stream, timing);
    // 5. Done reading: peers may reuse their slot n % 2 (in bucket n + 2).
    finish_staged(n, stream);
    broken_ = false;
    return Served::Moved;
  }

  // Static weights: every peer's shard has been where it is read since before the plan was
  // confirmed (its region, or its own memory), so a call is only reads. The rank's own shard is
  // checked now and then (start_check).
  void gather_bound(std::span<const GatherOp> bucket, uint64_t n, uint64_t eager, void* stream,
                    Timing timing) {
    finish_check(stream);
    copies_.clear();
    add_reads(bucket, [&](int r, const GatherOp& op) {  // where that peer keeps its shard
      return peer_sources_[static_cast<size_t>(r) * bind_.size() + bound_index(op)];
    });
    memory_->copy_batch(copies_, stream);
    for (const GatherOp& op : bucket)
      if (op.own_offset != GatherOp::kOwn && op.own_offset != op.slot_offset)
        log_.deviate(n, op.own_offset, op.slot_offset);
    log_.publish(n);
    // After the reads, so the gather is not delayed by it; before the bucket's end marks, so a
    // release that sees this bucket finished knows the check's copies have run too.
    start_check(bucket, stream, timing);
    finish_bucket(eager, stream);
  }

  // A bound bucket recorded into the CUDA graph its stream is capturing: the reads only, from
  // memory that does not change while the promise holds, so every replay gets the same bytes
  // the eager call would. No check (its lines would be compared once, at the capture) and no
  // flag (a replay would write the capture's numbers again): a check this call owes stays
  // owed to a later eager one, and release() settles on the last bucket that wrote its flags.
  // The graph keeps what it reads mapped (hold_for_graph).
  void gather_captured(std::span<const GatherOp> bucket, uint64_t n, void* stream) {
    copies_.clear();
    add_reads(bucket, [&](int r, const GatherOp& op) {
      return peer_sources_[static_cast<size_t>(r) * bind_.size() + bound_index(op)];
    });
    memory_->hold_for_graph(stream);
    memory_->copy_captured(copies_, stream);
    for (const GatherOp& op : bucket) {
      if (op.verify_now) verify_.owe(op.slot_offset);
      if (op.own_offset != GatherOp::kOwn && op.own_offset != op.slot_offset)
        log_.deviate(n, op.own_offset, op.slot_offset);
    }
    log_.publish(n);
  }

  // A staged bucket recorded into the CUDA graph its stream is capturing, on graph slot
  // bucket % 2 (the plan's bucket index: the same on every rank, so the k-th use of a graph slot
  // on one rank meets the k-th on every other, in whatever order graphs were captured). Each
  // latch this rank waits on it puts back (protocol.h), so every use ends with the words as it
  // found them, and a replay finds them as the capture did:
  //  0. after this rank's bucket issued or launched last before the replay, on whatever stream
  //     (follow_last_bucket), as NCCL orders graph launches: two graphs launched on unordered
  //     streams use a slot's latches one after the other, in launch order on every rank;
  //  1. every peer has read this rank's last use of the slot: wait on their read latches here,
  //     and lower them (they rise again once each has read this use);
  //  2. stage this rank's shards in the slot;
  //  3. set this rank's staged latch in every peer's window; wait on theirs here, and lower
  //     them;
  //  4. read every peer's slot;
  //  5. set this rank's read latch in every peer's window.
  // Why no byte is stale or overwritten: as in the eager handshake (the top of this file), with
  // "the peer's last use of the slot has been read" in place of done >= n - 2. A latch is raised
  // again only after its lowering: a peer raises its staged latch here for its next use only
  // after its wait on this rank's read latch, which this rank raises after lowering the staged
  // one (stream order, and the barrier before every stream write).
  // Two levels: the writer's parts are written in step 2, after the copies.
  void gather_captured_staged(std::span<const GatherOp> bucket, void* stream, PartWriter* writer) {
    if (bucket.empty()) return;
    const int slot = bucket.front().bucket % 2;
    for (const GatherOp& op : bucket)
      if (op.bucket != bucket.front().bucket)
        throw Error(ErrorKind::Usage, "a captured bucket whose gathers name different buckets");
    const size_t at = (2 + static_cast<size_t>(slot)) * own_.slot_stride;
    memory_->hold_for_graph(stream);
    memory_->follow_last_bucket(stream, true);
    flag_ops_.clear();
    add_latch_waits([&](int r) { return flags_.read(slot, r); });
    memory_->run_flags(flag_ops_, stream);
    add_stages(bucket, at);
    memory_->copy_captured(copies_, stream);
    if (writer != nullptr && !writer->write_parts(bucket, own_.region + at, stream))
      throw Error(ErrorKind::System, "a captured bucket: this rank's part between machines failed");
    flag_ops_.clear();
    add_latch_sets(flags_.staged(slot, rank_));
    add_latch_waits([&](int r) { return flags_.staged(slot, r); });
    memory_->run_flags(flag_ops_, stream);
    copies_.clear();
    add_reads(
        bucket,
        [&](int r, const GatherOp& op) {
          return peers_[static_cast<size_t>(r)].region + at + op.slot_offset;
        },
        own_.region + at);
    memory_->copy_captured(copies_, stream);
    flag_ops_.clear();
    add_latch_sets(flags_.read(slot, rank_));
    memory_->run_flags(flag_ops_, stream);
    memory_->end_bucket(stream, true);
  }

  // Every peer's latch `word_of(peer)` in this rank's own window: waited on, then lowered.
  template <class WordOf>
  void add_latch_waits(WordOf word_of) {
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_) continue;
      uint8_t* word = own_.flags + word_of(r);
      flag_ops_.push_back({FlagOp::Kind::WaitLatch, r, word, 0});
      flag_ops_.push_back({FlagOp::Kind::Latch, rank_, word, 0});
    }
  }
  // This rank's latch at `word` set in every peer's window.
  void add_latch_sets(size_t word) {
    for (int r = 0; r < nranks_; ++r)
      if (r != rank_)
        flag_ops_.push_back(
            {FlagOp::Kind::Latch, r, peers_[static_cast<size_t>(r)].flags + word, 1});
  }

  // A bucket's staging: this rank's shards into its own slot at `slot_at` (not the parts a
  // PartWriter writes there); held pieces with this rank's own piece from the program's buffer.
  void add_stages(std::span<const GatherOp> bucket, size_t slot_at) {
    copies_.clear();
    for (const GatherOp& op : bucket) {
      if (op.bytes == 0 || op.sendbuf == nullptr) continue;
      uint8_t* into = own_.region + slot_at + op.slot_offset;
      const auto* from = static_cast<const uint8_t*>(op.sendbuf);
      if (op.own_source == nullptr) {
        copies_.push_back({into, from, op.bytes * op.pieces});
        continue;
      }
      const size_t own_at = static_cast<size_t>(op.own_piece) * op.bytes;
      const size_t after = own_at + op.bytes;
      if (own_at != 0) copies_.push_back({into, from, own_at});
      copies_.push_back({into + own_at, op.own_source, op.bytes});
      if (after < op.bytes * op.pieces)
        copies_.push_back({into + after, from + after, op.bytes * op.pieces - after});
    }
  }
  // Whether `op`'s pieces lie in this window's held region (GatherOp::own_source).
  bool holds(const GatherOp& op) const {
    const auto* at = static_cast<const uint8_t*>(op.sendbuf);
    return held_bytes_ != 0 && op.pieces > 1 && op.own_piece < op.pieces && at >= own_.held &&
           op.bytes * op.pieces <= held_bytes_ &&
           static_cast<size_t>(at - own_.held) <= held_bytes_ - op.bytes * op.pieces;
  }

  // A bucket's reads: every peer's part of each gather from `peer_part(r, op)`, this rank's own
  // from its send buffer (none in place); two levels, a part a PartWriter wrote from this rank's
  // slot, at `own_slot` (staged buckets).
  template <class PeerPart>
  void add_reads(std::span<const GatherOp> bucket, PeerPart peer_part,
                 const uint8_t* own_slot = nullptr) {
    for (const GatherOp& op : bucket) {
      if (op.bytes == 0) continue;
      auto* recv = static_cast<uint8_t*>(op.recvbuf);
      if (op.pieces > 1) {
        add_pieces(op, peer_part, own_slot);
        continue;
      }
      for (int r = 0; r < nranks_; ++r) {
        uint8_t* into = recv + static_cast<size_t>(r) * op.bytes;
        if (r == rank_) {
          if (into != op.sendbuf) copies_.push_back({into, op.sendbuf, op.bytes});
          continue;
        }
        copies_.push_back({into, peer_part(r, op), op.bytes});
      }
    }
  }

  // Two levels (GatherOp): every local rank's part is its pieces, each read to its global
  // rank's place; this rank's own from its send buffer, or from its slot where written there.
  template <class PeerPart>
  void add_pieces(const GatherOp& op, PeerPart peer_part, const uint8_t* own_slot) {
    if (op.places == nullptr) throw Error(ErrorKind::Usage, "a gather of pieces without places");
    if ((op.sendbuf == nullptr || op.own_source != nullptr) && own_slot == nullptr)
      throw Error(ErrorKind::Internal, "a part staged in the slot read outside a staged bucket");
    const uint8_t* own = op.sendbuf != nullptr && op.own_source == nullptr
                             ? static_cast<const uint8_t*>(op.sendbuf)
                             : own_slot + op.slot_offset;
    auto* recv = static_cast<uint8_t*>(op.recvbuf);
    for (int r = 0; r < nranks_; ++r) {
      const auto* part = r == rank_ ? own : static_cast<const uint8_t*>(peer_part(r, op));
      for (uint32_t m = 0; m < op.pieces; ++m) {
        const int32_t place = op.places[static_cast<size_t>(r) * op.pieces + m];
        uint8_t* into = recv + static_cast<size_t>(place) * op.bytes;
        const uint8_t* from = part + static_cast<size_t>(m) * op.bytes;
        if (into != from) copies_.push_back({into, from, op.bytes});
      }
    }
  }

  // Bucket n has run on this rank: its reads are done (peers may reuse what it read) and its own
  // part is over (a release may free what it used).
  void finish_bucket(uint64_t n, void* stream) {
    flag_ops_.clear();
    add_writes(flags_.done(rank_), n);
    flag_ops_.push_back({FlagOp::Kind::Write, rank_, own_.flags + flags_.own(), n});
    memory_->run_flags(flag_ops_, stream);
  }

  // A staged bucket's end: finish_bucket(), and the mark a bucket issued next on another stream
  // waits for (follow_last_bucket() at its start).
  void finish_staged(uint64_t n, void* stream) {
    finish_bucket(n, stream);
    memory_->end_bucket(stream, false);
  }

  // This rank's word at `word` in every peer's window.
  void add_writes(size_t word, uint64_t value) {
    for (int r = 0; r < nranks_; ++r)
      if (r != rank_)
        flag_ops_.push_back(
            {FlagOp::Kind::Write, r, peers_[static_cast<size_t>(r)].flags + word, value});
  }
  // Until every peer's word of a kind (`rank0_word`: rank 0's, e.g. flags_.done(0)) in this
  // rank's own window reaches `target`. The words of one kind lie one line apart, by rank.
  void add_waits(size_t rank0_word, uint64_t target) {
    for (int r = 0; r < nranks_; ++r)
      if (r != rank_)
        flag_ops_.push_back({FlagOp::Kind::Wait, r,
                             own_.flags + rank0_word + static_cast<size_t>(r) * flags_.line_bytes,
                             target});
  }

  // The turns this rank's set-up takes at mapping (mapping_turns.h): with the ranks on its GPU,
  // kept in the lowest one's log, where more than MappingTurns::kSlots share the GPU. Every rank
  // of the group finds the same lowest: sharing a GPU is the same device on both sides.
  MappingTurns mapping_turns(std::span<const Medium> media) const {
    int lowest = rank_;
    size_t sharing = 1;
    for (int r = 0; r < nranks_; ++r)
      if (r != rank_ && memory_->shares_gpu_with(media[static_cast<size_t>(r)])) {
        ++sharing;
        lowest = std::min(lowest, r);
      }
    if (sharing <= MappingTurns::kSlots || !log_.is_open()) return {};
    return MappingTurns(log_.mapping_turns(lowest));
  }

  // The bind index of a bound gather (its slot offset must be one the plan bound).
  size_t bound_index(const GatherOp& op) const {
    const int64_t index = bind_index_.find(op.slot_offset);
    if (index < 0)
      throw Error(ErrorKind::Usage, "a gather at slot offset " + std::to_string(op.slot_offset) +
                                        " that the plan did not bind");
    return static_cast<size_t>(index);
  }

  // Static weights: the rank's shard checked when verify_ says (never on a timed call), on the
  // lines sample_plan.h picks. A bound shard is compared with its binding; an exported one has
  // none, so the memory its peers read (the agreed source, while its allocation is the one
  // exported: a freed one is pinned by the peers' mappings, exports.h) and the buffer this call
  // sends (when another) are compared with what the first look at each set saw. The lines are
  // copied to the host on the call's stream, and compared once those copies have run: at once on
  // synchronous memory; on a stream at a later call, never waiting for the program's stream (the
  // shard as this call saw it, and never after the program freed it). One check at a time;
  // another that falls due meanwhile is owed to a later call.
  void start_check(std::span<const GatherOp> bucket, void* stream, Timing timing) {
    for (const GatherOp& op : bucket) {
      if (op.verify_now) verify_.owe(op.slot_offset);
      if (!verify_.on_call(op.slot_offset, timing) || op.bytes == 0) continue;
      if (check_.pending) {
        verify_.owe(op.slot_offset);
        continue;
      }
      const size_t index = bound_index(op);
      const ShardSource& source = sources_.table.sources[index];
      const SamplePlan plan(op.bytes);
      check_.anchor = plan.anchor();
      check_.sweep = plan.sweep(verify_.begin_check(op.slot_offset));
      if (check_.sweep.first == 0) check_.sweep = {};  // the anchor itself: compared once
      check_.index = index;
      check_.in_place = source.allocation != ShardSource::kInWindow;
      uint8_t* host = memory_->check_buffer();
      const auto* shard = static_cast<const uint8_t*>(op.sendbuf);
      // Sets 0 and 2 (anchor, sweep): the reference side; 1 and 3: the shard this call sends.
      const uint8_t* reference = nullptr;
      if (!check_.in_place) {
        reference = own_.region + source.offset;
      } else {
        const auto* agreed = static_cast<const uint8_t*>(bind_[index].sendbuf);
        const bool alive = memory_->export_alive(sources_.export_bases[source.allocation],
                                                 sources_.table.exports[source.allocation].bytes,
                                                 sources_.identities[source.allocation]);
        if (alive) reference = agreed;
        if (shard == agreed) shard = alive ? nullptr : agreed;  // one look is enough
      }
      check_.reference_copied = reference != nullptr;
      check_.shard_copied = shard != nullptr;
      if (reference != nullptr) {
        memory_->copy_lines(host, reference, check_.anchor, stream);
        memory_->copy_lines(host + 2 * kCheckSetBytes, reference, check_.sweep, stream);
      }
      if (shard != nullptr) {
        memory_->copy_lines(host + kCheckSetBytes, shard, check_.anchor, stream);
        memory_->copy_lines(host + 3 * kCheckSetBytes, shard, check_.sweep, stream);
      }
      memory_->mark_lines(stream);
      check_.pending = true;
      check_.op = op;
      // The shard's bytes looked at: a binding's copy is not counted (checked_bytes()); an
      // exported shard's agreed source and re-homed buffer are both the shard.
      const size_t looks =
          check_.in_place ? (reference != nullptr ? 1 : 0) + (shard != nullptr ? 1 : 0) : 1;
      checked_bytes_ += (check_.anchor.bytes() + check_.sweep.bytes()) * looks;
      if (memory_->synchronous()) finish_check(stream);
    }
  }

  // Two levels, held pieces (GatherOp::own_source): the other machines took this rank's own
  // piece once, and read that copy since; the program's buffer, which this machine's ranks read,
  // must still hold the same bytes. On synchronous memory the whole piece is compared at every
  // call; on a stream, sampled lines on the schedule of bound windows (start_check), compared at
  // a later call. A change is reported by take_stale_bindings(), at the held pieces' offset in
  // the held region (a slot offset names a gather within its bucket only), at every check that
  // finds it (the caller says it once).
  void start_held_check(std::span<const GatherOp> bucket, void* stream, Timing timing) {
    for (const GatherOp& op : bucket) {
      if (op.own_source == nullptr || op.bytes == 0) continue;
      const auto* pieces = static_cast<const uint8_t*>(op.sendbuf);
      const auto key = static_cast<size_t>(pieces - own_.held);
      const uint8_t* held = pieces + op.own_piece * op.bytes;
      if (memory_->synchronous()) {
        checked_bytes_ += op.bytes;
        if (std::memcmp(held, op.own_source, op.bytes) != 0) stale_.push_back(key);
        continue;
      }
      if (!verify_.on_call(key, timing)) continue;
      if (check_.pending) {
        verify_.owe(key);
        continue;
      }
      const SamplePlan plan(op.bytes);
      check_.anchor = plan.anchor();
      check_.sweep = plan.sweep(verify_.begin_check(key));
      if (check_.sweep.first == 0) check_.sweep = {};  // the anchor itself: compared once
      check_.held = true;
      uint8_t* host = memory_->check_buffer();
      const auto* shard = static_cast<const uint8_t*>(op.own_source);
      memory_->copy_lines(host, held, check_.anchor, stream);
      memory_->copy_lines(host + 2 * kCheckSetBytes, held, check_.sweep, stream);
      memory_->copy_lines(host + kCheckSetBytes, shard, check_.anchor, stream);
      memory_->copy_lines(host + 3 * kCheckSetBytes, shard, check_.sweep, stream);
      memory_->mark_lines(stream);
      check_.pending = true;
      check_.op = op;
      check_.held_at = key;
      checked_bytes_ += check_.anchor.bytes() + check_.sweep.bytes();
    }
  }

  // The check in flight, if its copies have run: a bound shard that changed is re-bound whole
  // on this call's stream (ahead of its reads); a change is reported by take_stale_bindings().
  void finish_check(void* stream) {
    if (!check_.pending) return;
    check_.pending = false;  // also when the copies failed (lines_copied() throws)
    if (!memory_->lines_copied()) {
      check_.pending = true;
      return;
    }
    const GatherOp& op = check_.op;
    const uint8_t* host = memory_->check_buffer();
    if (check_.held) {
      check_.held = false;
      if (std::memcmp(host, host + kCheckSetBytes, check_.anchor.bytes()) != 0 ||
          std::memcmp(host + 2 * kCheckSetBytes, host + 3 * kCheckSetBytes, check_.sweep.bytes()) !=
              0)
        stale_.push_back(check_.held_at);
      return;
    }
    const bool elsewhere = exports::sent_elsewhere(op, bind_[check_.index]);
    if (!check_.in_place) {
      if (std::memcmp(host, host + kCheckSetBytes, check_.anchor.bytes()) != 0 ||
          std::memcmp(host + 2 * kCheckSetBytes, host + 3 * kCheckSetBytes, check_.sweep.bytes()) !=
              0) {
        // Sent from elsewhere: the peers read bytes this call did not send (exports.h); the
        // binding is never re-bound from another buffer.
        if (elsewhere)
          log_.mark_broken(sequence_.load(), bind_[check_.index].slot_offset);
        else
          memory_->rebind(
              {own_.region + sources_.table.sources[check_.index].offset, op.sendbuf, op.bytes},
              stream);
        stale_.push_back(op.slot_offset);
      }
      return;
    }
    bool same = true;
    auto look = [&](const uint8_t* packed, const SampleSet& set, bool learn) {
      if (set.lines() == 0 || (!learn && !references_.has(check_.index, set.first))) return;
      if (!references_.matches(check_.index, set.first, exports::hash_packed(packed, set)))
        same = false;
    };
    // The agreed source sets the references; a re-homed shard is only compared with them.
    if (check_.reference_copied) {
      look(host, check_.anchor, true);
      look(host + 2 * kCheckSetBytes, check_.sweep, true);
    }
    if (check_.shard_copied) {
      look(host + kCheckSetBytes, check_.anchor, false);
      look(host + 3 * kCheckSetBytes, check_.sweep, false);
    }
    // Sent from elsewhere (or the exported allocation is gone), and the bytes differ: the
    // allocator gave the block the peers read to another tensor, or the call's shard is not the
    // one they read. The promise may have held; the peers must still hear of it (source_log.h).
    if (!same && (elsewhere || !check_.reference_copied))
      log_.mark_broken(sequence_.load(), bind_[check_.index].slot_offset);
    if (!same) stale_.push_back(op.slot_offset);
  }

  // The bucket whose end (the peers' done words, this rank's own word) an abort or a release
  // waits for: the last eager one, since a captured bucket writes no counter on any rank (a
  // graph's own lifetime keeps what it uses: hold_for_graph).
  uint64_t settling_bucket() const { return eager_.load(); }

  // Every wait of this rank on its peers passes, queued or to come (window_end.h): its ready and
  // done words (`counters`) and its graph slots' latches. Not flag_ops_: a call may be filling
  // that on another thread.
  void release_waits(bool counters) {
    if (own_.flags == nullptr) return;  // no window: nothing ever waited on it
    std::vector<FlagOp> ops;
    add_wait_releases(ops, flags_, rank_, own_.flags, counters);
    if (ops.empty()) return;
    if (!memory_->run_flags_now(ops))
      MAGI_WARN(Transport,
                "could not release this rank's waits on its peers; its stream may stay blocked");
  }

  void release_locked() {
    // Peers that outlive this process must not take its end for a death (lost_peer()).
    if (own_.flags != nullptr) {
      try {
        memory_->write_word_now(own_.flags + flags_.left(), 1);
      } catch (const Error&) {}
    }
    offers_.stop();
    memory_->end_offers();
    bool settled = true;
    if (memory_->window_bytes() != 0 && !memory_->synchronous()) {
      memory_->use_on_any_thread();
      const uint64_t last = settling_bucket();
      Settled how = Settled::Finished;
      std::string unfinished;
      if (attached_ && last > 0) {
        if (abandoned_.load())
          how = settled_at_ == last ? Settled::Finished : Settled::Abandoned;
        else
          how = settle(*memory_, flags_, rank_, peer_pids_, last, kSettleLimit, unfinished);
      } else if (!memory_->own_work_done()) {
        // Nothing was gathered: only this rank's own set-up (flags, binding) may be queued.
        how = Settled::Unreadable;
      }
      if (how != Settled::Finished) {
        // This rank's stream must not wait for ever on peers that will never come; freeing
        // would wait for the whole device (window_end.h). The process's end returns it all.
        release_waits(true);
        MAGI_WARN(Transport,
                  "window of %zu bytes left allocated, with its %d peer mappings and %zu mapped "
                  "peer allocations: %s",
                  memory_->window_bytes(), nranks_ - 1, memory_->imports(),
                  settled_name(how, unfinished).c_str());
        settled = false;
      }
    }
    memory_->release(settled);
    settled_at_ = kNotSettled;
    log_.close();
    peers_.clear();
    peer_pids_.clear();
    own_ = {};
    peer_sources_.clear();
    sources_ = {};
    bind_.clear();
    slot_bytes_ = 0;
    bound_ = zero_copy_ = graph_slots_ = false;
    shape_ = {};
    sequence_.store(0);
    eager_.store(0);
    verify_.reset(0, 0);
    check_ = {};
    checked_bytes_ = 0;
    stale_.clear();
    attached_ = broken_ = false;
    abandoned_.store(false);
  }

  const std::unique_ptr<MemoryOps> memory_;
  const int rank_;
  const int nranks_;
  const uint64_t identity_;
  const protocol::FlagLayout flags_;
  const protocol::FaultPoints faults_;
  WindowView own_;
  std::vector<WindowView> peers_;  // by rank; this rank's entry stays empty
  std::vector<pid_t> peer_pids_;   // by rank, from their blobs; this rank's entry 0
  protocol::WindowShape shape_;    // what every peer's blob must match
  size_t slot_bytes_ = 0;
  bool bound_ = false;
  bool zero_copy_ = false;
  bool graph_slots_ = false;                  // staged: two more slots, for captured buckets
  exports::SourcePlan sources_;               // bound: where each of this rank's shards is read
  std::vector<BindOp> bind_;                  // bound: the agreed sources, by bind index
  exports::BindIndex bind_index_;             // slot offset -> bind index
  std::vector<const uint8_t*> peer_sources_;  // [peer * shards + bind index]
  exports::SampleReferences references_;      // exported shards: what the first looks saw
  SourceLog log_;                             // bound: what this rank read, for its peers
  VerifySchedule verify_;                     // bound: when each binding is checked
  struct Check {
    bool pending = false;  // its copies are queued; compared once they have run
    GatherOp op{};
    size_t index = 0;       // in the plan's bind
    bool in_place = false;  // an exported shard: compared with references_, not a binding
    bool reference_copied = false;
    bool shard_copied = false;
    bool held = false;  // a held piece's check (start_held_check), of the pieces at held_at
    size_t held_at = 0;
    SampleSet anchor;
    SampleSet sweep;  // empty when it was the anchor
  } check_;
  std::vector<size_t> stale_;
  uint64_t checked_bytes_ = 0;
  size_t held_bytes_ = 0;         // staged: the held region's (WindowView::held)
  std::vector<Copy> copies_;      // a bucket's, kept for their room
  std::vector<FlagOp> flag_ops_;  // likewise
  bool attached_ = false;
  bool broken_ = false;                // synchronous memory: a bucket threw part way
  std::atomic<uint64_t> sequence_{0};  // the last bucket started; read by abandon() from any thread
  std::atomic<uint64_t> eager_{0};     // buckets started that were not captured
  std::atomic<bool> abandoned_{false};
  static constexpr uint64_t kNotSettled = ~uint64_t{0};
  uint64_t settled_at_ = kNotSettled;  // abandon() found buckets 1..settled_at_ all finished
  DescriptorOffers offers_;            // exports by descriptor (bound windows)
  std::mutex lifetime_;  // prepare, attach, release and abandon, which may come from another thread
};

}  // namespace

void pace_mappings_on_this_thread(bool on) { t_pace_mappings = on; }

void check_rank(int rank, int nranks) {
  if (nranks < 1 || rank < 0 || rank >= nranks)
    throw Error(ErrorKind::Usage, "rank " + std::to_string(rank) + " of " + std::to_string(nranks));
}

std::unique_ptr<Transport> make_window_transport(std::unique_ptr<MemoryOps> memory, int rank,
                                                 int nranks, uint64_t comm_identity,
                                                 const Options::Fault& fault) {
  check_rank(rank, nranks);
  return std::make_unique<WindowTransport>(std::move(memory), rank, nranks, comm_identity, fault);
}

}  // namespace magi::ce
