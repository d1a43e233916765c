// The window transport's one mechanism (ce_transport/window_transport.cc) over a fake memory that
// behaves as device memory does: every copy and flag operation is queued on the caller's stream
// and runs only when the test runs that stream, waits holding it back. All ranks live in one
// process and one thread, so a test can queue every rank's buckets first and then run the
// streams in the order it likes: what the CUDA backend enqueues is checked here, on a CPU, step
// by step and byte by byte.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "base/base.h"
#include "ce_transport/ce_transport.h"
#include "ce_transport/exports.h"
#include "ce_transport/memory_ops.h"

namespace magi::ce {

bool operator==(const Copy& a, const Copy& b) {
  return a.dst == b.dst && a.src == b.src && a.bytes == b.bytes;
}
void PrintTo(const Copy& c, std::ostream* os) {
  *os << "{dst " << c.dst << ", src " << c.src << ", " << c.bytes << " bytes}";
}

namespace {

constexpr uint64_t kCommIdentity = 0x5eed'c0ff'ee00'00f4;
constexpr size_t kLine = 64;

// A stream: what was queued on it, in order. A step returns false while it cannot run (a wait).
struct FakeStream {
  std::deque<std::function<bool()>> work;
  bool step() {
    if (work.empty() || !work.front()()) return false;
    work.pop_front();
    return true;
  }
};

// Allocations the fake exports: a shard inside one is read by the peers in place.
struct FakeExports {
  struct Allocation {
    uint8_t* base;
    size_t bytes;
    uint64_t identity;
    bool alive = true;
  };
  std::vector<Allocation> allocations;
  // The ranks' GPUs (shares_gpu_with), and imports that take a while, counted as they overlap.
  bool one_gpu = false;
  std::chrono::microseconds import_takes{0};
  std::atomic<int> importing{0};
  std::atomic<int> most_importing{0};
};

// A graph as the fake memory records it: its steps, queued at each launch, and what each launch
// fixes first (the bucket order its event nodes take then).
// Each step is made at each launch, in order: an event node takes the bucket order then.
using FakeStep = std::function<bool()>;
struct FakeGraph {
  std::vector<std::function<FakeStep()>> steps;
};

// What a rank queued, in order.
struct Event {
  enum class Kind { Copies, Rebind, Flags, Lines, Mark, Captured };
  Kind kind;
  std::vector<Copy> copies;        // Copies, Rebind
  std::vector<std::string> flags;  // Flags: "write r1:ready[0]=3", "wait done[1]>=1"
};

class FakeMemory final : public MemoryOps {
 public:
  FakeMemory(int rank, int nranks, FakeExports& exports)
      : rank_(rank), nranks_(nranks), flags_{kLine, nranks}, exports_(exports) {}

  Backend backend() const override { return Backend::Cuda; }
  bool synchronous() const override { return false; }
  const protocol::FlagLayout& flags() const override { return flags_; }
  bool paces_mappings() const override { return true; }

  WindowView allocate(size_t slot_bytes, bool bound, bool graph_slots,
                      std::span<const uint8_t> first_flags, size_t held_bytes) override {
    const size_t stride = round_up(std::max<size_t>(slot_bytes, 1), kLine);
    const size_t flags_at = (bound ? 1 : graph_slots ? 4 : 2) * stride;
    const size_t held_at = flags_at + flags_.bytes_but_failed();
    storage_.assign((held_at + round_up(held_bytes, 8)) / 8, 0);
    auto* base = reinterpret_cast<uint8_t*>(storage_.data());
    own_ = {base, flags_at, stride, base + flags_at, held_bytes != 0 ? base + held_at : nullptr};
    EXPECT_GE(first_flags.size(), flags_.bytes_but_failed());
    std::memcpy(own_.flags, first_flags.data(), flags_.bytes_but_failed());
    if (bound || held_bytes != 0) check_.assign(kCheckBytes, 0);
    return own_;
  }
  size_t window_bytes() const override { return storage_.size() * 8; }
  void bind(std::span<const Copy> shards) override {
    for (const Copy& c : shards) std::memcpy(c.dst, c.src, c.bytes);
  }
  void export_window(Medium& medium) override { std::memcpy(medium.data(), &own_, sizeof(own_)); }
  void begin_attach(std::span<const pid_t> pids) override {
    peer_flags_.assign(static_cast<size_t>(nranks_), nullptr);
    peer_pids = {pids.begin(), pids.end()};
  }
  WindowView map_peer(int rank, const protocol::BlobHeader& header, const Medium& medium) override {
    WindowView peer;
    std::memcpy(&peer, medium.data(), sizeof(peer));
    EXPECT_EQ(header.rank, rank);
    peer_flags_[static_cast<size_t>(rank)] = peer.flags;
    return peer;
  }

  exports::Exportable find_export(const void* ptr, size_t bytes) override {
    exports::Exportable e;
    const auto* at = static_cast<const uint8_t*>(ptr);
    for (const FakeExports::Allocation& a : exports_.allocations) {
      if (at < a.base || at + bytes > a.base + a.bytes) continue;
      e.ok = true;
      e.base = reinterpret_cast<uintptr_t>(a.base);
      std::memcpy(e.record.handle, &a.base, sizeof(a.base));
      e.record.bytes = a.bytes;
      e.identity = a.identity;
      return e;
    }
    e.refusal = "not in a fake allocation";
    return e;
  }
  bool export_alive(uintptr_t base, size_t, uint64_t identity) override {
    for (const FakeExports::Allocation& a : exports_.allocations)
      if (reinterpret_cast<uintptr_t>(a.base) == base) return a.alive && a.identity == identity;
    return false;
  }
  bool shares_gpu_with(const Medium&) const override { return exports_.one_gpu; }
  fd_channel::Offer descriptor_offer(const exports::Exportable&) override {
    throw Error(ErrorKind::Internal, "the fake exports nothing by descriptor");
  }
  const char* offer_refusal() const override { return "not offered: "; }
  exports::Span import(const ExportRecord& record) override {
    if (exports_.import_takes.count() > 0) {
      const int now = ++exports_.importing;
      for (int most = exports_.most_importing.load();
           now > most && !exports_.most_importing.compare_exchange_weak(most, now);) {}
      std::this_thread::sleep_for(exports_.import_takes);
      --exports_.importing;
    }
    ++imports_;
    uint8_t* base = nullptr;
    std::memcpy(&base, record.handle, sizeof(base));
    return {base, record.bytes};
  }
  size_t imports() const override { return imports_; }

  void copy_batch(std::span<const Copy> copies, void* stream) override {
    if (copies.empty()) return;
    events.push_back({Event::Kind::Copies, {copies.begin(), copies.end()}, {}});
    on(stream).work.push_back([c = events.back().copies] {
      for (const Copy& one : c) std::memcpy(one.dst, one.src, one.bytes);
      return true;
    });
  }
  // A graph: while `capturing`, what a call queues is recorded instead (its copies also in
  // `graph`), with the values it has now; launch() queues a replay of it on a stream, replay()
  // runs it at once (a graph with no wait).
  void copy_captured(std::span<const Copy> copies, void*) override {
    events.push_back({Event::Kind::Captured, {copies.begin(), copies.end()}, {}});
    graph.insert(graph.end(), copies.begin(), copies.end());
    record([c = std::vector<Copy>(copies.begin(), copies.end())] {
      for (const Copy& one : c) std::memcpy(one.dst, one.src, one.bytes);
      return true;
    });
  }
  void hold_for_graph(void*) override { ++graph_holds; }
  void replay() const {
    for (const auto& make : recorded) EXPECT_TRUE(make()()) << "a replay waited";
  }
  void launch(const FakeGraph& g, void* stream) {
    for (const auto& make : g.steps) on(stream).work.push_back(make());
  }
  // Ends a capture: what it recorded.
  FakeGraph take_graph() {
    graph.clear();
    return {std::exchange(recorded, {})};
  }
  // A word of this rank's own window.
  uint64_t word(size_t offset) const {
    uint64_t v = 0;
    std::memcpy(&v, own_.flags + offset, sizeof(v));
    return v;
  }
  // As an event recorded at each bucket's end and waited for by a bucket on another stream.
  // Captured: as external event nodes, resolved at each launch (launch()).
  void follow_last_bucket(void* stream, bool captured) override {
    if (captured) {
      recorded.push_back(
          [this]() -> FakeStep { return [this, target = ends_] { return ended_ >= target; }; });
      return;
    }
    if (ends_ == 0 || (stream == last_stream_ && !graphs_end_)) return;
    const uint64_t target = ends_;
    on(stream).work.push_back([this, target] { return ended_ >= target; });
  }
  void end_bucket(void* stream, bool captured) override {
    if (captured) {
      recorded.push_back(
          [this]() -> FakeStep { return [this, mark = ++ends_] { return ended_ = mark, true; }; });
      graphs_end_ = true;
      return;
    }
    const uint64_t mark = ++ends_;
    on(stream).work.push_back([this, mark] { return ended_ = mark, true; });
    last_stream_ = stream;
  }
  void rebind(const Copy& shard, void* stream) override {
    events.push_back({Event::Kind::Rebind, {shard}, {}});
    on(stream).work.push_back([shard] {
      std::memcpy(shard.dst, shard.src, shard.bytes);
      return true;
    });
  }
  void run_flags(std::span<const FlagOp> ops, void* stream) override {
    if (ops.empty()) return;
    Event event{Event::Kind::Flags, {}, {}};
    for (const FlagOp& op : ops) {
      event.flags.push_back(describe(op));
      uint8_t* word = op.word;
      const uint64_t value = op.value;
      std::function<bool()> step;
      switch (op.kind) {
        case FlagOp::Kind::Write: step = [word, value] { return store(word, value), true; }; break;
        case FlagOp::Kind::Wait: step = [word, value] { return load(word) >= value; }; break;
        case FlagOp::Kind::Latch:
          step = [word, value] {  // the low half alone
            const auto half = static_cast<uint32_t>(value);
            std::memcpy(word, &half, sizeof(half));
            return true;
          };
          break;
        case FlagOp::Kind::WaitLatch:
          step = [word] { return (load(word) & protocol::kLatchOpen) != 0; };
          break;
        case FlagOp::Kind::Open:
          step = [word] {  // the high half alone
            const uint32_t one = 1;
            std::memcpy(word + 4, &one, sizeof(one));
            return true;
          };
          break;
      }
      if (capturing)
        record(std::move(step));
      else
        on(stream).work.push_back(std::move(step));
    }
    events.push_back(std::move(event));
  }
  uint64_t read_flag(const uint8_t* /*word*/) const override {
    ADD_FAILURE() << "a stream's flags read on the host";
    return 0;
  }
  uint64_t read_word_now(const uint8_t* word) override { return load(word); }
  void write_word_now(uint8_t* word, uint64_t value) override { store(word, value); }

  uint8_t* check_buffer() override { return check_.data(); }
  void copy_lines(uint8_t* into, const uint8_t* from, const SampleSet& set, void* stream) override {
    events.push_back({Event::Kind::Lines, {}, {}});
    on(stream).work.push_back([into, from, set] {
      uint8_t* at = into;
      for (size_t i = 0; i < set.lines(); ++i) {
        std::memcpy(at, from + set.offset(i), set.line_bytes(i));
        at += set.line_bytes(i);
      }
      return true;
    });
  }
  void mark_lines(void* stream) override {
    events.push_back({Event::Kind::Mark, {}, {}});
    lines_copied_ = false;
    on(stream).work.push_back([this] { return lines_copied_ = true; });
  }
  bool lines_copied() override { return lines_copied_; }

  // The words as they are: what no stream has run yet is not in them.
  const uint8_t* read_flags_now() override {
    ++flag_reads;
    return flags_unreadable ? nullptr : own_.flags;
  }
  // Run at once, off every stream (as on the window's own), and said in `ran_now`.
  bool run_flags_now(std::span<const FlagOp> ops) override {
    for (const FlagOp& op : ops) {
      ran_now.push_back(describe(op));
      if (op.kind == FlagOp::Kind::Write) {
        store(op.word, op.value);
      } else if (op.kind == FlagOp::Kind::Open) {
        const uint32_t one = 1;  // the high half alone
        std::memcpy(op.word + 4, &one, sizeof(one));
      } else {
        ADD_FAILURE() << "a wait or a latch's low half run now";
      }
    }
    return true;
  }
  void release(bool settled) override {
    if (!storage_.empty()) releases.push_back(settled);
    storage_.clear();
    own_ = {};
    imports_ = 0;
  }

  const WindowView& own() const { return own_; }

  std::vector<Event> events;
  std::vector<bool> releases;        // settled or not, one per window
  std::vector<std::string> ran_now;  // run_flags_now()'s operations, described
  int flag_reads = 0;                // read_flags_now()'s
  bool flags_unreadable = false;     // read_flags_now() fails
  std::vector<pid_t> peer_pids;      // begin_attach()'s
  std::vector<Copy> graph;           // what copy_captured recorded
  int graph_holds = 0;
  bool capturing = false;  // flag operations are recorded, not queued
  std::vector<std::function<FakeStep()>> recorded;

 private:
  static FakeStream& on(void* stream) { return *static_cast<FakeStream*>(stream); }
  void record(FakeStep step) {
    recorded.push_back([step = std::move(step)] { return step; });
  }
  static void store(uint8_t* word, uint64_t value) { std::memcpy(word, &value, sizeof(value)); }
  static uint64_t load(const uint8_t* word) {
    uint64_t v = 0;
    std::memcpy(&v, word, sizeof(v));
    return v;
  }

  // A flag word by the window it lies in and its place in protocol.h's layout.
  std::string describe(const FlagOp& op) const {
    const bool waits = op.kind == FlagOp::Kind::Wait || op.kind == FlagOp::Kind::WaitLatch;
    const uint8_t* flags =
        op.rank == rank_ || waits ? own_.flags : peer_flags_[static_cast<size_t>(op.rank)];
    const size_t line = static_cast<size_t>(op.word - flags) / kLine;
    const auto n = static_cast<size_t>(nranks_);
    const size_t latch = line - 2 * n - 1;  // staged[slot][rank], then read[slot][rank]
    const std::string word = line < n           ? "ready[" + std::to_string(line) + "]"
                             : line < 2 * n     ? "done[" + std::to_string(line - n) + "]"
                             : line == 2 * n    ? "own"
                             : line < 6 * n + 1 ? std::string(latch < 2 * n ? "staged" : "read") +
                                                      std::to_string(latch / n % 2) + "[" +
                                                      std::to_string(latch % n) + "]"
                                                : "?";
    if (op.kind == FlagOp::Kind::Wait) return "wait " + word + ">=" + std::to_string(op.value);
    if (op.kind == FlagOp::Kind::WaitLatch) return "wait " + word;
    const int window = flags == own_.flags ? rank_ : op.rank;
    const std::string value =
        op.value == protocol::kReleased ? "released" : std::to_string(op.value);
    return (op.kind == FlagOp::Kind::Latch  ? "latch r"
            : op.kind == FlagOp::Kind::Open ? "open r"
                                            : "write r") +
           std::to_string(window) + ":" + word + "=" + value;
  }

  const int rank_;
  const int nranks_;
  const protocol::FlagLayout flags_;
  FakeExports& exports_;
  std::vector<uint64_t> storage_;  // the window: its region, then its flags
  WindowView own_;
  std::vector<uint8_t*> peer_flags_;
  std::vector<uint8_t> check_;
  size_t imports_ = 0;
  bool lines_copied_ = false;
  uint64_t ends_ = 0;   // end_bucket() marks queued
  uint64_t ended_ = 0;  // the last one run
  void* last_stream_ = nullptr;
  bool graphs_end_ = false;  // a graph marks bucket ends too, on any stream
};

// `nranks` transports over fake memory, each with its own stream.
class FakeRanks {
 public:
  explicit FakeRanks(int nranks, const Options::Fault& fault = {}) : nranks_(nranks) {
    streams_.resize(static_cast<size_t>(nranks));
    for (int r = 0; r < nranks; ++r) {
      auto memory = std::make_unique<FakeMemory>(r, nranks, exports_);
      memories_.push_back(memory.get());
      transports_.push_back(
          make_window_transport(std::move(memory), r, nranks, kCommIdentity, fault));
    }
  }
  // A bucket some rank never ran would hold a release's settle for its whole limit: at the end
  // of a test, the words read as lost make it give up at once (what a release does is checked
  // where a test releases itself).
  ~FakeRanks() {
    for (FakeMemory* m : memories_) m->flags_unreadable = true;
    for (auto& t : transports_) t->release();
  }

  // Every rank prepares its plan (plans[r]): the blobs and source tables the ranks attach with.
  void prepare_all(const std::vector<WindowPlan>& plans, std::vector<HandleBlob>& blobs,
                   std::vector<SourceTable>& tables) {
    blobs.assign(static_cast<size_t>(nranks_), HandleBlob{});
    tables.clear();
    for (int r = 0; r < nranks_; ++r) {
      transport(r).prepare(plans[static_cast<size_t>(r)], blobs[static_cast<size_t>(r)]);
      tables.push_back(transport(r).sources());
    }
  }

  // Every rank prepares its plan (plans[r]) and attaches to all the others.
  void join(const std::vector<WindowPlan>& plans) {
    std::vector<HandleBlob> blobs;
    std::vector<SourceTable> tables;
    prepare_all(plans, blobs, tables);
    for (int r = 0; r < nranks_; ++r)
      transport(r).attach(blobs, plans[0].zero_copy ? std::span<const SourceTable>(tables)
                                                    : std::span<const SourceTable>{});
  }

  // As join(), each rank attaching on a thread of its own as a set-up off the calls does (its
  // mappings paced: pace_mappings_on_this_thread), all at once.
  void join_on_threads(const std::vector<WindowPlan>& plans) {
    std::vector<HandleBlob> blobs;
    std::vector<SourceTable> tables;
    prepare_all(plans, blobs, tables);
    std::vector<std::thread> threads;
    for (int r = 0; r < nranks_; ++r)
      threads.emplace_back([&, r] {
        pace_mappings_on_this_thread(true);
        transport(r).attach(blobs, tables);
      });
    for (std::thread& t : threads) t.join();
  }

  Transport::Served gather(int r, std::span<const GatherOp> bucket,
                           Transport::Timing timing = Transport::Timing::Untimed) {
    return transport(r).gather(bucket, &streams_[static_cast<size_t>(r)], timing);
  }
  // On a stream of the test's (which the test runs).
  Transport::Served gather_on(int r, std::span<const GatherOp> bucket, FakeStream& stream) {
    return transport(r).gather(bucket, &stream);
  }

  // Runs the streams until every one is empty, each as far as it goes before the next (in
  // `order`), or one step of each in turn (`round_robin`). False when they wait on each other
  // for ever.
  bool run(const std::vector<int>& order, bool round_robin = false) {
    for (;;) {
      bool progress = false;
      for (const int r : order) {
        FakeStream& s = streams_[static_cast<size_t>(r)];
        if (round_robin) {
          progress |= s.step();
        } else {
          while (s.step()) progress = true;
        }
      }
      if (!progress) break;
    }
    for (const FakeStream& s : streams_)
      if (!s.work.empty()) return false;
    return true;
  }
  bool run() { return run(ranks()); }

  std::vector<int> ranks() const {
    std::vector<int> all;
    for (int r = 0; r < nranks_; ++r) all.push_back(r);
    return all;
  }
  Transport& transport(int r) { return *transports_[static_cast<size_t>(r)]; }
  FakeMemory& memory(int r) { return *memories_[static_cast<size_t>(r)]; }
  FakeStream& stream(int r) { return streams_[static_cast<size_t>(r)]; }
  FakeExports& exports() { return exports_; }

 private:
  int nranks_;
  FakeExports exports_;
  std::vector<FakeMemory*> memories_;
  std::vector<std::unique_ptr<Transport>> transports_;
  std::vector<FakeStream> streams_;
};

uint8_t pattern(uint64_t bucket, int rank, size_t gather, size_t i) {
  return static_cast<uint8_t>(bucket * 37 + static_cast<uint64_t>(rank) * 11 + gather * 5 + i);
}

ErrorKind kind_of(const std::function<void()>& work) {
  try {
    work();
  } catch (const Error& e) {
    return e.kind();
  }
  ADD_FAILURE() << "nothing thrown";
  return ErrorKind::Internal;
}

WindowPlan staging_plan(size_t slot_bytes) {
  WindowPlan plan;
  plan.slot_bytes = slot_bytes;
  return plan;
}

// ---- the handshake, queued on streams -----------------------------------------------------------

// One bucket's buffers on every rank: its gathers' shards (one in place, one empty), received
// into buffers first filled with 0xee.
struct Gather {
  size_t bytes;
  size_t slot_offset;
  bool in_place;
};
constexpr Gather kBucket[] = {{100, 0, false}, {37, 128, true}, {0, 192, false}, {256, 256, false}};
constexpr size_t kSlotBytes = 512;

struct BucketBuffers {
  std::vector<std::vector<uint8_t>> send, recv;  // [rank * gathers + gather]
  std::vector<std::vector<GatherOp>> ops;        // by rank

  BucketBuffers(uint64_t bucket, int nranks) {
    ops.resize(static_cast<size_t>(nranks));
    for (int r = 0; r < nranks; ++r)
      for (size_t g = 0; g < std::size(kBucket); ++g) {
        const Gather& gather = kBucket[g];
        send.emplace_back(gather.bytes);
        recv.emplace_back(gather.bytes * static_cast<size_t>(nranks), 0xee);
        uint8_t* own = recv.back().data() + static_cast<size_t>(r) * gather.bytes;
        uint8_t* from = gather.in_place ? own : send.back().data();
        for (size_t i = 0; i < gather.bytes; ++i) from[i] = pattern(bucket, r, g, i);
        ops[static_cast<size_t>(r)].push_back(
            {from, recv.back().data(), gather.bytes, gather.slot_offset});
      }
  }
  // Wrong bytes rank `reader` received.
  size_t wrong(uint64_t bucket, int reader, int nranks) const {
    size_t n = 0;
    for (size_t g = 0; g < std::size(kBucket); ++g) {
      const std::vector<uint8_t>& got = recv[static_cast<size_t>(reader) * std::size(kBucket) + g];
      for (int r = 0; r < nranks; ++r)
        for (size_t i = 0; i < kBucket[g].bytes; ++i)
          n += got[static_cast<size_t>(r) * kBucket[g].bytes + i] != pattern(bucket, r, g, i);
    }
    return n;
  }
};

// Every rank queues six buckets before any stream runs: bucket n + 2 reuses bucket n's slot, so
// a rank whose stream runs ahead overwrites what a slower peer has not read yet, unless it waits
// for that peer's done. Each order of running the streams must deliver every byte.
TEST(WindowTransport, BucketsQueuedOnStreamsDeliverEveryByteWhateverOrderTheStreamsRunIn) {
  constexpr int kRanks = 3;
  constexpr uint64_t kBuckets = 6;
  struct Schedule {
    std::vector<int> order;
    bool round_robin;
  };
  for (const Schedule& schedule : {Schedule{{0, 1, 2}, false}, Schedule{{2, 1, 0}, false},
                                   Schedule{{1, 0, 2}, false}, Schedule{{0, 1, 2}, true}}) {
    FakeRanks ranks(kRanks);
    ranks.join(std::vector<WindowPlan>(kRanks, staging_plan(kSlotBytes)));
    std::vector<BucketBuffers> buckets;
    for (uint64_t b = 1; b <= kBuckets; ++b) buckets.emplace_back(b, kRanks);
    for (int r = 0; r < kRanks; ++r)
      for (uint64_t b = 1; b <= kBuckets; ++b)
        ASSERT_EQ(ranks.gather(r, buckets[b - 1].ops[static_cast<size_t>(r)]),
                  Transport::Served::Moved);
    ASSERT_TRUE(ranks.run(schedule.order, schedule.round_robin)) << "the streams wait for ever";
    for (uint64_t b = 1; b <= kBuckets; ++b)
      for (int r = 0; r < kRanks; ++r)
        EXPECT_EQ(buckets[b - 1].wrong(b, r, kRanks), 0u)
            << "bucket " << b << " on rank " << r << ", streams run "
            << (schedule.round_robin ? "in turn" : "one after the other from rank ")
            << schedule.order[0];
  }
}

// A rank issues bucket 1 on one stream and bucket 2 on another, with nothing ordering them (as
// NCCL allows: it orders a communicator's work itself). Run the second stream first: bucket 2
// must wait for bucket 1's end, else its ready would be taken for bucket 1's by the peer, which
// would read a slot not yet staged.
TEST(WindowTransport, BucketsIssuedOnTwoStreamsRunInTheOrderTheyWereIssued) {
  FakeRanks ranks(2);
  ranks.join({staging_plan(kSlotBytes), staging_plan(kSlotBytes)});
  BucketBuffers first(1, 2), second(2, 2);
  FakeStream a, b;
  ranks.gather_on(0, first.ops[0], a);
  ranks.gather_on(0, second.ops[0], b);
  ranks.gather(1, first.ops[1]);
  ranks.gather(1, second.ops[1]);
  while (b.step()) {}
  EXPECT_FALSE(b.work.empty()) << "bucket 2 ran before bucket 1, on another stream";
  for (int turn = 0; turn < 8; ++turn) {
    while (ranks.stream(1).step()) {}
    while (a.step()) {}
    while (b.step()) {}
  }
  EXPECT_TRUE(a.work.empty() && b.work.empty() && ranks.stream(1).work.empty())
      << "the streams wait for ever";
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(first.wrong(1, r, 2), 0u) << "rank " << r;
    EXPECT_EQ(second.wrong(2, r, 2), 0u) << "rank " << r;
  }
}

// What the CUDA backend turns into cuStreamBatchMemOp and cudaMemcpyBatchAsync calls, in order.
TEST(WindowTransport, ABucketQueuesItsStepsInTheHandshakesOrder) {
  FakeRanks ranks(2);
  ranks.join({staging_plan(kSlotBytes), staging_plan(kSlotBytes)});
  std::vector<uint8_t> send(100, 1), recv(200, 0), peer_send(100, 2), peer_recv(200, 0);
  const GatherOp op{send.data(), recv.data(), 100, 64};
  const GatherOp peer_op{peer_send.data(), peer_recv.data(), 100, 64};
  const WindowView own = ranks.memory(0).own();
  const WindowView peer = ranks.memory(1).own();
  for (uint64_t n = 1; n <= 3; ++n) {
    ranks.memory(0).events.clear();
    ranks.gather(0, std::span<const GatherOp>(&op, 1));
    ranks.gather(1, std::span<const GatherOp>(&peer_op, 1));
    ASSERT_TRUE(ranks.run());
    const std::vector<Event>& events = ranks.memory(0).events;
    const std::string m = std::to_string(n);
    const size_t slot = (n % 2) * own.slot_stride;
    std::vector<Event> expected;
    // Slot n % 2 was read by the peer in bucket n - 2: wait for its done first.
    if (n > 2)
      expected.push_back({Event::Kind::Flags, {}, {"wait done[1]>=" + std::to_string(n - 2)}});
    expected.push_back({Event::Kind::Copies, {{own.region + slot + 64, send.data(), 100}}, {}});
    expected.push_back({Event::Kind::Flags, {}, {"write r1:ready[0]=" + m, "wait ready[1]>=" + m}});
    expected.push_back(
        {Event::Kind::Copies,
         {{recv.data(), send.data(), 100}, {recv.data() + 100, peer.region + slot + 64, 100}},
         {}});
    expected.push_back({Event::Kind::Flags, {}, {"write r1:done[0]=" + m, "write r0:own=" + m}});
    ASSERT_EQ(events.size(), expected.size()) << "bucket " << n;
    for (size_t i = 0; i < events.size(); ++i) {
      EXPECT_EQ(events[i].kind, expected[i].kind) << "bucket " << n << " step " << i;
      EXPECT_EQ(events[i].copies, expected[i].copies) << "bucket " << n << " step " << i;
      EXPECT_EQ(events[i].flags, expected[i].flags) << "bucket " << n << " step " << i;
    }
    EXPECT_EQ(recv, peer_recv);
  }
}

TEST(WindowTransport, AnOwnShardInPlaceIsNotCopiedAndAnEmptyGatherCopiesNothing) {
  FakeRanks ranks(2);
  ranks.join({staging_plan(kSlotBytes), staging_plan(kSlotBytes)});
  std::vector<uint8_t> recv(2 * 64, 0);
  std::vector<uint8_t> other(8, 0);
  const GatherOp bucket[] = {{recv.data() + 64, recv.data(), 64, 0},
                             {other.data(), other.data(), 0, 128}};
  ranks.gather(1, bucket);
  const std::vector<Event>& events = ranks.memory(1).events;
  ASSERT_EQ(events.size(), 4u);
  // Staged from its place in the receive buffer; read: the peer's part only.
  EXPECT_EQ(events[0].copies,
            (std::vector<Copy>{{ranks.memory(1).own().region + ranks.memory(1).own().slot_stride,
                                recv.data() + 64, 64}}));
  ASSERT_EQ(events[2].kind, Event::Kind::Copies);
  ASSERT_EQ(events[2].copies.size(), 1u);
  EXPECT_EQ(events[2].copies[0].dst, recv.data());
}

// On a stream nothing of the bucket has run when gather() returns, so a rank that cannot serve
// throws before queuing anything (its peers wait for it until the abort: ce_transport.h).
TEST(WindowTransport, AFailingBucketOnAStreamThrowsBeforeQueuingAnything) {
  FakeRanks ranks(2, {Options::Fault::Where::Gather, 0});
  ranks.join({staging_plan(kSlotBytes), staging_plan(kSlotBytes)});
  std::vector<uint8_t> send(64, 3), recv(128, 0);
  const GatherOp op{send.data(), recv.data(), 64, 0};
  EXPECT_EQ(kind_of([&] { ranks.gather(0, std::span<const GatherOp>(&op, 1)); }), ErrorKind::Cuda);
  EXPECT_TRUE(ranks.memory(0).events.empty());
  EXPECT_TRUE(ranks.stream(0).work.empty());
}

TEST(WindowTransport, AGatherThatOverflowsItsSlotIsRefusedBeforeItTakesABucketNumber) {
  FakeRanks ranks(2);
  ranks.join({staging_plan(kSlotBytes), staging_plan(kSlotBytes)});
  std::vector<uint8_t> send(kSlotBytes + 1, 3), recv(2 * (kSlotBytes + 1), 0);
  for (const GatherOp& op : {GatherOp{send.data(), recv.data(), kSlotBytes + 1, 0},
                             GatherOp{send.data(), recv.data(), 100, kSlotBytes - 99},
                             GatherOp{send.data(), recv.data(), 1, ~size_t{0}}})
    EXPECT_EQ(kind_of([&] { ranks.gather(0, std::span<const GatherOp>(&op, 1)); }),
              ErrorKind::Usage);
  EXPECT_TRUE(ranks.memory(0).events.empty());
  // The slot's last byte fits, and is bucket 1.
  const GatherOp last{send.data(), recv.data(), 1, kSlotBytes - 1};
  ranks.gather(0, std::span<const GatherOp>(&last, 1));
  ASSERT_GE(ranks.memory(0).events.size(), 2u);
  EXPECT_EQ(ranks.memory(0).events[1].flags,
            (std::vector<std::string>{"write r1:ready[0]=1", "wait ready[1]>=1"}));
}

TEST(WindowTransport, AttachAndGatherRefuseWhatCannotBeRight) {
  FakeRanks ranks(2);
  HandleBlob blobs[2];
  std::vector<uint8_t> send(8), recv(16);
  const GatherOp op{send.data(), recv.data(), 8, 0};
  EXPECT_EQ(kind_of([&] { ranks.transport(0).attach(blobs); }), ErrorKind::Usage);  // unprepared
  EXPECT_EQ(kind_of([&] { ranks.gather(0, std::span<const GatherOp>(&op, 1)); }), ErrorKind::Usage);
  WindowPlan zero_copy = staging_plan(64);
  zero_copy.bound = zero_copy.zero_copy = true;
  zero_copy.table_room = 1024;
  zero_copy.bind = {{send.data(), 8, 0}};
  for (int r = 0; r < 2; ++r) ranks.transport(r).prepare(zero_copy, blobs[r]);
  EXPECT_EQ(kind_of([&] { ranks.transport(0).attach(std::span<const HandleBlob>(blobs, 1)); }),
            ErrorKind::Usage);  // one blob for two ranks
  EXPECT_EQ(kind_of([&] { ranks.transport(0).attach(blobs); }),
            ErrorKind::Usage);  // zero-copy without the peers' source tables
  const SourceTable tables[] = {ranks.transport(0).sources(), ranks.transport(1).sources()};
  ranks.transport(0).attach(blobs, tables);
  EXPECT_EQ(kind_of([&] { ranks.transport(0).attach(blobs, tables); }), ErrorKind::Usage);  // twice
  // A gather at a slot offset the plan did not bind.
  const GatherOp unbound{send.data(), recv.data(), 8, 32};
  EXPECT_EQ(kind_of([&] { ranks.gather(0, std::span<const GatherOp>(&unbound, 1)); }),
            ErrorKind::Usage);
  // The unbound one counted: it never ran, so the abort finds it in flight (after its grace)
  // and releases every wait of this rank, its counters with its latches.
  const std::vector<std::string> every_wait = {
      "write r0:ready[1]=released", "write r0:done[1]=released", "open r0:staged0[1]=1",
      "open r0:read0[1]=1",         "open r0:staged1[1]=1",      "open r0:read1[1]=1"};
  ranks.transport(0).abandon();
  EXPECT_EQ(ranks.memory(0).ran_now, every_wait);
  EXPECT_EQ(kind_of([&] { ranks.gather(0, std::span<const GatherOp>(&op, 1)); }), ErrorKind::Usage);
  // Left allocated, its waits released again: the abort found a bucket in flight.
  ranks.transport(0).release();
  EXPECT_EQ(ranks.memory(0).releases, std::vector<bool>{false});
  EXPECT_EQ(ranks.memory(0).ran_now.size(), 2 * every_wait.size());
  // Unattached, an abort has no waits to release.
  ranks.transport(1).abandon();
  EXPECT_TRUE(ranks.memory(1).ran_now.empty());
  EXPECT_EQ(ranks.memory(1).flag_reads, 0);
}

TEST(WindowTransport, ABindingThatOverflowsTheRegionIsRefused) {
  FakeRanks ranks(1);
  std::vector<uint8_t> send(100);
  WindowPlan plan = staging_plan(128);
  plan.bound = true;
  plan.bind = {{send.data(), 100, 64}};
  HandleBlob blob;
  EXPECT_EQ(kind_of([&] { ranks.transport(0).prepare(plan, blob); }), ErrorKind::Usage);
}

// ---- static weights
// ------------------------------------------------------------------------------

// Three ranks of static weights: each rank's first shard lies in an allocation the fake
// exports (read by the peers where its owner keeps it), its second on the heap (bound: read from
// the owner's region). `ops[r]` gathers both into `recv`, first filled with 0xee.
struct StaticShards {
  static constexpr int kRanks = 3;
  static constexpr size_t kBytes[] = {300, 200};
  FakeRanks ranks{kRanks};
  std::vector<std::vector<uint8_t>> allocations, heap, recv;
  std::vector<WindowPlan> plans;
  std::vector<std::vector<GatherOp>> ops{kRanks};

  StaticShards() {
    allocations.reserve(kRanks);
    heap.reserve(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      allocations.emplace_back(4096);
      heap.emplace_back(kBytes[1]);
      ranks.exports().allocations.push_back(
          {allocations.back().data(), allocations.back().size(), 100u + static_cast<uint64_t>(r)});
      const uint8_t* shards[] = {allocations.back().data() + 1000, heap.back().data()};
      WindowPlan plan = staging_plan(512);
      plan.bound = plan.zero_copy = true;
      plan.table_room = 4096;
      for (size_t g = 0; g < 2; ++g) {
        for (size_t i = 0; i < kBytes[g]; ++i)
          const_cast<uint8_t*>(shards[g])[i] = pattern(0, r, g, i);
        plan.bind.push_back({shards[g], kBytes[g], g * 256});
      }
      plans.push_back(plan);
    }
    ranks.join(plans);
    for (int r = 0; r < kRanks; ++r)
      for (size_t g = 0; g < 2; ++g) {
        recv.emplace_back(kBytes[g] * kRanks, 0xee);
        ops[static_cast<size_t>(r)].push_back({plans[static_cast<size_t>(r)].bind[g].sendbuf,
                                               recv.back().data(), kBytes[g], g * 256});
      }
  }
  // "" when every rank received every byte of both gathers; else the first wrong one.
  std::string wrong() const {
    for (int reader = 0; reader < kRanks; ++reader)
      for (size_t g = 0; g < 2; ++g)
        for (int r = 0; r < kRanks; ++r)
          for (size_t i = 0; i < kBytes[g]; ++i)
            if (recv[static_cast<size_t>(reader) * 2 + g][static_cast<size_t>(r) * kBytes[g] + i] !=
                pattern(0, r, g, i))
              return "rank " + std::to_string(reader) + " reading rank " + std::to_string(r) +
                     "'s shard " + std::to_string(g) + " byte " + std::to_string(i);
    return "";
  }
  void poison() {
    for (auto& buffer : recv) std::fill(buffer.begin(), buffer.end(), 0xee);
  }
};

// Ranks that share one GPU take turns at mapping their peers' allocations (mapping_turns.h): at
// most two map at once, and every byte is read where its owner keeps it.
TEST(WindowTransport, RanksOnOneGpuMapTheirPeersAllocationsAtMostTwoAtATime) {
  constexpr int kRanks = 5;
  constexpr size_t kShards = 6, kBytes = 256;
  FakeRanks ranks(kRanks);
  ranks.exports().one_gpu = true;
  ranks.exports().import_takes = std::chrono::microseconds(300);
  std::vector<std::vector<uint8_t>> allocations;
  allocations.reserve(kRanks * kShards);
  std::vector<WindowPlan> plans;
  for (int r = 0; r < kRanks; ++r) {
    WindowPlan plan = staging_plan(kBytes * kShards);
    plan.bound = plan.zero_copy = true;
    plan.table_room = 4096;
    for (size_t g = 0; g < kShards; ++g) {
      allocations.emplace_back(kBytes);
      for (size_t i = 0; i < kBytes; ++i) allocations.back()[i] = pattern(0, r, g, i);
      ranks.exports().allocations.push_back(
          {allocations.back().data(), kBytes, 1000u + static_cast<uint64_t>(r) * kShards + g});
      plan.bind.push_back({allocations.back().data(), kBytes, g * kBytes});
    }
    plans.push_back(plan);
  }
  ranks.join_on_threads(plans);
  EXPECT_LE(ranks.exports().most_importing.load(), 2) << "more than two ranks mapped at once";
  std::vector<std::vector<uint8_t>> recv;
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(ranks.transport(r).memory().peer_mappings, (kRanks - 1) * kShards) << "rank " << r;
    std::vector<GatherOp> ops;
    for (size_t g = 0; g < kShards; ++g) {
      recv.emplace_back(kBytes * kRanks, 0xee);
      ops.push_back(
          {plans[static_cast<size_t>(r)].bind[g].sendbuf, recv.back().data(), kBytes, g * kBytes});
    }
    ranks.gather(r, ops);
  }
  ASSERT_TRUE(ranks.run());
  for (int reader = 0; reader < kRanks; ++reader)
    for (size_t g = 0; g < kShards; ++g)
      for (int r = 0; r < kRanks; ++r)
        for (size_t i = 0; i < kBytes; ++i)
          ASSERT_EQ(
              recv[static_cast<size_t>(reader) * kShards + g][static_cast<size_t>(r) * kBytes + i],
              pattern(0, r, g, i))
              << "rank " << reader << " reading rank " << r << "'s shard " << g << " byte " << i;
}

// Peers read the first shard where its owner keeps it and the second from the owner's region.
TEST(WindowTransport, PeersReadExportedShardsInPlaceAndTheOthersFromTheOwnersRegion) {
  StaticShards s;
  constexpr int kRanks = StaticShards::kRanks;
  for (int r = 0; r < kRanks; ++r) {
    const WindowMemory m = s.ranks.transport(r).memory();
    EXPECT_EQ(m.exported_shards, 1u);
    EXPECT_EQ(m.bound_shards, 1u);
    EXPECT_EQ(m.first_refused, 1);
    EXPECT_EQ(m.refusal, "not in a fake allocation");
    EXPECT_EQ(m.peer_mappings, 2u);
  }
  for (int r = 0; r < kRanks; ++r) s.ranks.gather(r, s.ops[static_cast<size_t>(r)]);
  // Rank 0's reads: no handshake, its own shards from its send buffers, each peer's exported
  // shard in the peer's allocation, its bound one at the start of the peer's region (packed).
  const std::vector<Event>& events = s.ranks.memory(0).events;
  ASSERT_EQ(events[0].kind, Event::Kind::Copies);
  std::vector<Copy> expected;
  for (size_t g = 0; g < 2; ++g)
    for (int r = 0; r < kRanks; ++r) {
      const void* from =
          r == 0   ? s.plans[0].bind[g].sendbuf
          : g == 0 ? static_cast<const void*>(s.allocations[static_cast<size_t>(r)].data() + 1000)
                   : s.ranks.memory(r).own().region;
      const size_t bytes = StaticShards::kBytes[g];
      expected.push_back({s.recv[g].data() + static_cast<size_t>(r) * bytes, from, bytes});
    }
  EXPECT_EQ(events[0].copies, expected);
  ASSERT_TRUE(s.ranks.run());
  EXPECT_EQ(s.wrong(), "");
}

// A bucket captured into a CUDA graph (static weights): the reads alone are recorded, the same
// reads an eager bucket makes, with no flag and no check (a replay would repeat the capture's
// values; the plan's first calls owe a check, which a captured one must not take); the graph
// holds the window. Every replay then delivers every byte, also after later eager buckets, and a
// release settles on the last eager bucket.
TEST(WindowTransport, ACapturedBucketRecordsTheReadsAloneAndEveryReplayIsRight) {
  StaticShards s;
  constexpr int kRanks = StaticShards::kRanks;
  FakeRanks& ranks = s.ranks;
  // Bucket 1, captured on every rank: nothing queued on the streams, one recorded batch.
  for (int r = 0; r < kRanks; ++r)
    EXPECT_EQ(ranks.gather(r, s.ops[static_cast<size_t>(r)], Transport::Timing::Captured),
              Transport::Served::Moved);
  for (int r = 0; r < kRanks; ++r) {
    const FakeMemory& m = ranks.memory(r);
    ASSERT_EQ(m.events.size(), 1u) << "rank " << r;
    EXPECT_EQ(m.events[0].kind, Event::Kind::Captured);
    EXPECT_EQ(m.events[0].copies.size(), 2u * kRanks);  // every rank's part of both gathers
    EXPECT_EQ(m.graph_holds, 1);
    EXPECT_TRUE(ranks.stream(r).work.empty());
  }
  // Replayed three times, each after the receive buffers were poisoned.
  for (int replay = 0; replay < 3; ++replay) {
    s.poison();
    for (int r = 0; r < kRanks; ++r) ranks.memory(r).replay();
    EXPECT_EQ(s.wrong(), "") << "replay " << replay;
  }
  // An eager bucket after the capture (the first eager one: its flags count eager buckets
  // alone): the reads, its check and its flags, as ever.
  s.poison();
  for (int r = 0; r < kRanks; ++r) ranks.gather(r, s.ops[static_cast<size_t>(r)]);
  ASSERT_TRUE(ranks.run());
  EXPECT_EQ(s.wrong(), "");
  const std::vector<Event>& events = ranks.memory(0).events;
  EXPECT_EQ(events[1].kind, Event::Kind::Copies);
  EXPECT_EQ(events.back().kind, Event::Kind::Flags);
  EXPECT_EQ(
      events.back().flags,
      (std::vector<std::string>{"write r1:done[0]=1", "write r2:done[0]=1", "write r0:own=1"}));
  // A replay after the eager bucket still reads the same bytes.
  s.poison();
  for (int r = 0; r < kRanks; ++r) ranks.memory(r).replay();
  EXPECT_EQ(s.wrong(), "");
  // Bucket 3 captured last: the release settles on the first eager bucket, the last eager one
  // (a captured bucket writes no flag on any rank: its end would be waited for in vain, and the
  // window left allocated).
  for (int r = 0; r < kRanks; ++r)
    ranks.gather(r, s.ops[static_cast<size_t>(r)], Transport::Timing::Captured);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(ranks.memory(r).graph_holds, 2);
    ranks.transport(r).release();
    EXPECT_EQ(ranks.memory(r).releases, std::vector<bool>{true}) << "rank " << r;
  }
}

// A staged window's handshake counts buckets, which a replay would repeat: without graph slots
// a captured bucket there is refused before it takes a number or queues anything.
TEST(WindowTransport, ACapturedBucketOnAStagedWindowWithoutGraphSlotsIsRefused) {
  FakeRanks ranks(2);
  ranks.join({staging_plan(kSlotBytes), staging_plan(kSlotBytes)});
  BucketBuffers b(1, 2);
  EXPECT_EQ(kind_of([&] { ranks.gather(0, b.ops[0], Transport::Timing::Captured); }),
            ErrorKind::Usage);
  EXPECT_TRUE(ranks.memory(0).events.empty());
  EXPECT_TRUE(ranks.stream(0).work.empty());
  // The bucket numbers are untouched: the next eager bucket is bucket 1 on both ranks.
  for (int r = 0; r < 2; ++r) ranks.gather(r, b.ops[static_cast<size_t>(r)]);
  ASSERT_TRUE(ranks.run());
  EXPECT_EQ(b.wrong(1, 0, 2), 0u);
  EXPECT_EQ(b.wrong(1, 1, 2), 0u);
}

// ---- staged buckets captured into CUDA graphs (graph slots) ------------------------------------

WindowPlan graph_plan(size_t slot_bytes) {
  WindowPlan plan = staging_plan(slot_bytes);
  plan.graph_slots = true;
  return plan;
}

// A bucket of BucketBuffers whose send buffers the program rewrites between calls (the default
// mode's promise: every call sends what its buffers hold then), as the plan's bucket `index`.
struct Rewritten : BucketBuffers {
  Rewritten(uint16_t index, int ranks) : BucketBuffers(0, ranks), nranks(ranks) {
    for (auto& rank_ops : ops)
      for (GatherOp& op : rank_ops) op.bucket = index;
  }
  // Every send buffer holds `value`'s pattern, every receive buffer 0xee elsewhere.
  void refill(uint64_t with) {
    for (int r = 0; r < nranks; ++r)
      for (size_t g = 0; g < std::size(kBucket); ++g) {
        std::vector<uint8_t>& recv_buffer = recv[static_cast<size_t>(r) * std::size(kBucket) + g];
        std::fill(recv_buffer.begin(), recv_buffer.end(), 0xee);
        auto* from =
            static_cast<uint8_t*>(const_cast<void*>(ops[static_cast<size_t>(r)][g].sendbuf));
        for (size_t i = 0; i < kBucket[g].bytes; ++i) from[i] = pattern(with, r, g, i);
      }
    value = with;
  }
  size_t wrong_anywhere() const {
    size_t n = 0;
    for (int r = 0; r < nranks; ++r) n += wrong(value, r, nranks);
    return n;
  }
  int nranks;
  uint64_t value = 0;
};

// Rank r's graph of `bucket`: what its captured call recorded.
FakeGraph capture(FakeRanks& ranks, int r, Rewritten& bucket) {
  FakeMemory& memory = ranks.memory(r);
  memory.capturing = true;
  EXPECT_EQ(ranks.gather(r, bucket.ops[static_cast<size_t>(r)], Transport::Timing::Captured),
            Transport::Served::Moved);
  memory.capturing = false;
  EXPECT_TRUE(ranks.stream(r).work.empty()) << "a captured call queued work on its stream";
  return memory.take_graph();
}

// The latches of rank r's window as a capture found them: no peer's slot staged, every read
// owed read (protocol.h). "" when so.
std::string latches_at_rest(FakeRanks& ranks, int r, int nranks) {
  std::string odd;
  const protocol::FlagLayout layout{kLine, nranks};
  for (int slot = 0; slot < 2; ++slot)
    for (int peer = 0; peer < nranks; ++peer) {
      if (peer == r) continue;
      const std::string at = " slot " + std::to_string(slot) + " peer " + std::to_string(peer);
      if (ranks.memory(r).word(layout.staged(slot, peer)) != 0) odd += " staged" + at;
      if (ranks.memory(r).word(layout.read(slot, peer)) != 1) odd += " read" + at;
    }
  return odd;
}

// What one captured bucket records, for two ranks: wait until the peer read this rank's last use
// of the graph slot (and lower that latch), stage, say so in the peer's window, wait for the
// peer's staged latch (and lower it), read, say so.
TEST(WindowTransport, ACapturedStagedBucketRecordsAHandshakeOfLatchesOnItsGraphSlot) {
  FakeRanks ranks(2);
  ranks.join({graph_plan(kSlotBytes), graph_plan(kSlotBytes)});
  Rewritten bucket(3, 2);  // bucket 3 of the plan: graph slot 1
  bucket.refill(1);
  capture(ranks, 0, bucket);
  const std::vector<Event>& events = ranks.memory(0).events;
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].flags, (std::vector<std::string>{"wait read1[1]", "latch r0:read1[1]=0"}));
  EXPECT_EQ(events[1].kind, Event::Kind::Captured);  // staging, into graph slot 1 (slot 3)
  const size_t stride = ranks.memory(0).own().slot_stride;
  EXPECT_EQ(events[1].copies.front().dst, ranks.memory(0).own().region + 3 * stride);
  EXPECT_EQ(events[2].flags, (std::vector<std::string>{"latch r1:staged1[0]=1", "wait staged1[1]",
                                                       "latch r0:staged1[1]=0"}));
  EXPECT_EQ(events[3].kind, Event::Kind::Captured);  // the reads
  EXPECT_EQ(events[4].flags, (std::vector<std::string>{"latch r1:read1[0]=1"}));
  EXPECT_EQ(ranks.memory(0).graph_holds, 1);
}

// Three ranks capture three buckets each (two on the same graph slot), every rank in another
// order, and replay them with an eager bucket among them, the send buffers rewritten before each
// round: every replay delivers the bytes the buffers hold then, whatever order the streams run
// in, and leaves the latches as the capture found them.
TEST(WindowTransport, CapturedStagedBucketsAreRightAtEveryReplayAmongEagerOnes) {
  constexpr int kRanks = 3;
  FakeRanks ranks(kRanks);
  ranks.join(std::vector<WindowPlan>(kRanks, graph_plan(kSlotBytes)));
  Rewritten g0(0, kRanks), g1(1, kRanks), g2(2, kRanks), eager(0, kRanks);
  std::vector<FakeGraph> graphs[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    graphs[r].resize(3);
    Rewritten* captured[] = {&g0, &g1, &g2};
    const int order[3][3] = {{0, 1, 2}, {2, 0, 1}, {1, 2, 0}};
    for (const int g : order[r])
      graphs[r][static_cast<size_t>(g)] = capture(ranks, r, *captured[g]);
  }
  struct Schedule {
    std::vector<int> order;
    bool round_robin;
  };
  const Schedule schedules[] = {{{0, 1, 2}, false}, {{2, 1, 0}, false}, {{1, 0, 2}, true},
                                {{1, 2, 0}, false}, {{0, 2, 1}, true},  {{2, 0, 1}, false}};
  for (uint64_t round = 1; round <= std::size(schedules); ++round) {
    const Schedule& schedule = schedules[round - 1];
    g0.refill(round * 10);
    g1.refill(round * 10 + 1);
    g2.refill(round * 10 + 2);
    eager.refill(round * 10 + 3);
    for (int r = 0; r < kRanks; ++r) {
      void* stream = &ranks.stream(r);
      ranks.memory(r).launch(graphs[r][0], stream);
      ASSERT_EQ(ranks.gather(r, eager.ops[static_cast<size_t>(r)]), Transport::Served::Moved);
      ranks.memory(r).launch(graphs[r][1], stream);
      ranks.memory(r).launch(graphs[r][2], stream);
    }
    ASSERT_TRUE(ranks.run(schedule.order, schedule.round_robin))
        << "round " << round << ": the streams wait for ever";
    EXPECT_EQ(g0.wrong_anywhere(), 0u) << "round " << round;
    EXPECT_EQ(g1.wrong_anywhere(), 0u) << "round " << round;
    EXPECT_EQ(g2.wrong_anywhere(), 0u) << "round " << round;
    EXPECT_EQ(eager.wrong_anywhere(), 0u) << "round " << round;
    for (int r = 0; r < kRanks; ++r)
      EXPECT_EQ(latches_at_rest(ranks, r, kRanks), "") << "round " << round << ", rank " << r;
  }
}

// Two graphs on one graph slot, replayed twice each before any stream runs: a rank that runs
// ahead stages the second graph's shards only once every peer has read the first's, so each
// graph's bytes are its own.
TEST(WindowTransport, AGraphSlotIsStagedAgainOnlyOnceEveryPeerReadItsLastUse) {
  constexpr int kRanks = 3;
  for (const int ahead : {0, 2}) {
    FakeRanks ranks(kRanks);
    ranks.join(std::vector<WindowPlan>(kRanks, graph_plan(kSlotBytes)));
    Rewritten first(4, kRanks), second(6, kRanks);  // both on graph slot 0
    first.refill(41);
    second.refill(62);
    for (int r = 0; r < kRanks; ++r) {
      const auto a = capture(ranks, r, first);
      const auto b = capture(ranks, r, second);
      for (int twice = 0; twice < 2; ++twice) {
        ranks.memory(r).launch(a, &ranks.stream(r));
        ranks.memory(r).launch(b, &ranks.stream(r));
      }
    }
    std::vector<int> order{ahead};
    for (int r = 0; r < kRanks; ++r)
      if (r != ahead) order.push_back(r);
    ASSERT_TRUE(ranks.run(order)) << "rank " << ahead << " ahead: the streams wait for ever";
    EXPECT_EQ(first.wrong_anywhere(), 0u) << "rank " << ahead << " ahead";
    EXPECT_EQ(second.wrong_anywhere(), 0u) << "rank " << ahead << " ahead";
  }
}

// Two graphs on one graph slot, launched one after the other on two streams that nothing orders
// (as NCCL allows of a communicator's graphs): each rank's second launch waits for its first,
// however the streams run, so the slot's latches pair the same graph on every rank. Unordered,
// a rank's second graph could stage while its peers' first read the slot.
TEST(WindowTransport, GraphsLaunchedOnUnorderedStreamsReplayInLaunchOrder) {
  constexpr int kRanks = 3;
  for (const bool second_first : {true, false}) {
    SCOPED_TRACE(second_first ? "the second launch's streams run first" : "in launch order");
    FakeRanks ranks(kRanks);
    ranks.join(std::vector<WindowPlan>(kRanks, graph_plan(kSlotBytes)));
    Rewritten first(4, kRanks), second(6, kRanks);  // both on graph slot 0
    FakeStream a[kRanks], b[kRanks];
    FakeGraph graphs[kRanks][2];
    for (int r = 0; r < kRanks; ++r) {
      graphs[r][0] = capture(ranks, r, first);
      graphs[r][1] = capture(ranks, r, second);
    }
    for (uint64_t round = 1; round <= 3; ++round) {
      first.refill(round * 10);
      second.refill(round * 10 + 1);
      for (int r = 0; r < kRanks; ++r) {
        ranks.memory(r).launch(graphs[r][0], &a[r]);
        ranks.memory(r).launch(graphs[r][1], &b[r]);
      }
      if (second_first) {
        for (int r = 0; r < kRanks; ++r) {
          while (b[r].step()) {}
          EXPECT_FALSE(b[r].work.empty())
              << "round " << round << ": rank " << r << "'s second graph ran before its first";
        }
      }
      for (int turn = 0; turn < 16; ++turn)
        for (int r = 0; r < kRanks; ++r) {
          FakeStream& later = second_first ? b[r] : a[r];
          FakeStream& sooner = second_first ? a[r] : b[r];
          while (later.step()) {}
          while (sooner.step()) {}
        }
      for (int r = 0; r < kRanks; ++r)
        ASSERT_TRUE(a[r].work.empty() && b[r].work.empty())
            << "round " << round << ": rank " << r << "'s streams wait for ever";
      EXPECT_EQ(first.wrong_anywhere(), 0u) << "round " << round;
      EXPECT_EQ(second.wrong_anywhere(), 0u) << "round " << round;
      for (int r = 0; r < kRanks; ++r)
        EXPECT_EQ(latches_at_rest(ranks, r, kRanks), "") << "round " << round << ", rank " << r;
    }
  }
}

// A peer that never replays holds the others' replays at their waits, as NCCL's kernels would
// be held; the abort opens this rank's latches for good (their high halves), so the stuck replay
// ends and later ones never block, though each lowers the latches it waited on: the handshake's own
// stores write the low halves alone.
TEST(WindowTransport, AnAbortOpensTheGraphLatchesForEveryReplayToCome) {
  constexpr int kRanks = 3;
  FakeRanks ranks(kRanks);
  ranks.join(std::vector<WindowPlan>(kRanks, graph_plan(kSlotBytes)));
  Rewritten bucket(0, kRanks);
  bucket.refill(5);
  FakeGraph graphs[kRanks];
  for (int r = 0; r < kRanks; ++r) graphs[r] = capture(ranks, r, bucket);
  for (int r = 0; r < 2; ++r) ranks.memory(r).launch(graphs[r], &ranks.stream(r));  // not rank 2
  EXPECT_FALSE(ranks.run({0, 1})) << "replays ended without their peer";
  for (int r = 0; r < 2; ++r) ranks.transport(r).abandon();
  EXPECT_TRUE(ranks.run({0, 1})) << "the abort did not release the replay in flight";
  for (int replay = 0; replay < 3; ++replay) {
    for (int r = 0; r < 2; ++r) ranks.memory(r).launch(graphs[r], &ranks.stream(r));
    EXPECT_TRUE(ranks.run({0, 1})) << "replay " << replay << " after the abort blocked";
  }
}

TEST(WindowTransport, ASourceTableNamingBytesOutsideItsExportIsRefusedAtAttach) {
  FakeRanks ranks(2);
  std::vector<uint8_t> allocation(1024), other(64);
  ranks.exports().allocations.push_back({allocation.data(), allocation.size(), 7});
  WindowPlan plan = staging_plan(64);
  plan.bound = plan.zero_copy = true;
  plan.table_room = 1024;
  plan.bind = {{allocation.data() + 512, 64, 0}};
  HandleBlob blobs[2];
  ranks.transport(0).prepare(plan, blobs[0]);
  plan.bind = {{other.data(), 64, 0}};
  ranks.transport(1).prepare(plan, blobs[1]);
  SourceTable tables[] = {ranks.transport(0).sources(), ranks.transport(1).sources()};
  ASSERT_EQ(tables[0].sources[0].allocation, 0);
  tables[0].sources[0].offset = 1000;  // 1000 + 64 > 1024
  EXPECT_EQ(kind_of([&] { ranks.transport(1).attach(blobs, tables); }), ErrorKind::Usage);
}

// One rank, bound, a check on every call. On a stream the check's lines are copied on the
// call's stream and compared at a later call, once they have run; a changed shard is then
// re-bound on that call's stream ahead of its reads. A check falling due while one is in flight
// is owed, not dropped.
TEST(WindowTransport, AStreamsCheckIsComparedOnceItsCopiesRanAndReboundAheadOfTheReads) {
  constexpr size_t kBytes = 1000;
  FakeRanks ranks(2);
  std::vector<uint8_t> shard[2], recv[2];
  std::vector<WindowPlan> plans;
  for (int r = 0; r < 2; ++r) {
    shard[r].assign(kBytes, static_cast<uint8_t>(r + 1));
    recv[r].assign(2 * kBytes, 0);
    WindowPlan plan = staging_plan(kBytes);
    plan.bound = true;
    plan.bind = {{shard[r].data(), kBytes, 0}};
    plan.verify_first = 100;  // every call
    plans.push_back(plan);
  }
  ranks.join(plans);
  auto call = [&] {
    for (int r = 0; r < 2; ++r) {
      const GatherOp op{shard[r].data(), recv[r].data(), kBytes, 0};
      ranks.gather(r, std::span<const GatherOp>(&op, 1));
    }
  };
  auto count = [&](Event::Kind kind) {
    size_t n = 0;
    for (const Event& e : ranks.memory(0).events) n += e.kind == kind ? 1 : 0;
    return n;
  };
  call();  // call 1: the check's lines queued after the reads
  EXPECT_EQ(count(Event::Kind::Mark), 1u);
  EXPECT_TRUE(ranks.transport(0).take_stale_bindings().empty());
  ASSERT_TRUE(ranks.run());
  shard[0].assign(kBytes, 0x77);  // a broken promise
  call();  // call 2: call 1's check compared (unchanged then); its own check queued
  EXPECT_TRUE(ranks.transport(0).take_stale_bindings().empty());
  call();  // call 3: call 2's lines have not run, so nothing is compared and no check starts
  EXPECT_TRUE(ranks.transport(0).take_stale_bindings().empty());
  EXPECT_EQ(count(Event::Kind::Mark), 2u);
  ASSERT_TRUE(ranks.run());
  EXPECT_EQ(recv[1][0], 1);  // rank 1 still read the binding
  ranks.memory(0).events.clear();
  call();  // call 4: call 2's check compared: changed, re-bound before the reads
  EXPECT_EQ(ranks.transport(0).take_stale_bindings(), std::vector<size_t>{0});
  const std::vector<Event>& events = ranks.memory(0).events;
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Event::Kind::Rebind);
  EXPECT_EQ(events[0].copies,
            (std::vector<Copy>{{ranks.memory(0).own().region, shard[0].data(), kBytes}}));
  EXPECT_EQ(events[1].kind, Event::Kind::Copies);
  EXPECT_EQ(count(Event::Kind::Mark), 1u);  // the check owed by call 3 starts
  ASSERT_TRUE(ranks.run());
  EXPECT_EQ(recv[1][0], 0x77);  // rank 1 reads the re-bound shard
  EXPECT_EQ(recv[1][kBytes - 1], 0x77);
}

// Two levels with held pieces on a stream: this rank's own piece is staged from the call's
// buffer (its machine reads the call's bytes at once), and checked against the held piece the
// other machines took on sampled lines, compared at a later call once the copies ran; a change
// is reported at the pieces' offset in the held region. Local ranks 0 and 1 of one machine, two
// machines (global ranks 0, 1 here; 2, 3 on the other), a check on every call.
TEST(WindowTransport, AHeldPiecesOwnPieceIsStagedFromTheCallAndItsChangeFoundByALaterCheck) {
  constexpr size_t kShard = 512;
  constexpr uint32_t kMachines = 2;
  const int32_t places[4] = {0, 2, 1, 3};  // [local][machine]
  FakeRanks ranks(2);
  std::vector<uint8_t> own[2], recv[2];
  std::vector<WindowPlan> plans;
  for (int r = 0; r < 2; ++r) {
    own[r].assign(kShard, static_cast<uint8_t>(r + 1));
    recv[r].assign(4 * kShard, 0);
    WindowPlan plan = staging_plan(kShard * kMachines);
    plan.held_bytes = 2 * kShard * kMachines;  // two gathers' pieces; this one's at kShard * 2
    plan.verify_first = 100;                   // a check on every call
    plans.push_back(plan);
  }
  ranks.join(plans);
  constexpr size_t kAt = kShard * kMachines;
  for (int r = 0; r < 2; ++r) {  // what NCCL brought: its own piece, and the other machine's
    uint8_t* held = ranks.transport(r).held_region();
    ASSERT_NE(held, nullptr);
    std::memset(held + kAt, r + 1, kShard);
    std::memset(held + kAt + kShard, r + 3, kShard);
  }
  auto call = [&] {
    for (int r = 0; r < 2; ++r) {
      GatherOp op{ranks.transport(r).held_region() + kAt, recv[r].data(), kShard, 0};
      op.pieces = kMachines;
      op.places = places;
      op.own_source = own[r].data();
      op.own_piece = 0;
      ranks.gather(r, std::span<const GatherOp>(&op, 1));
    }
  };
  call();
  ASSERT_TRUE(ranks.run());
  for (int r = 0; r < 2; ++r)
    for (int g = 0; g < 4; ++g)  // global ranks 0, 2: local rank 0's pieces; 1, 3: local 1's
      EXPECT_EQ(recv[r][static_cast<size_t>(g) * kShard], g == 0   ? 1
                                                          : g == 1 ? 2
                                                          : g == 2 ? 3
                                                                   : 4)
          << "rank " << r << " place " << g;
  own[0].assign(kShard, 0x77);  // a broken promise on local rank 0
  call();                       // call 1's check compared (unchanged then); call 2's queued
  EXPECT_TRUE(ranks.transport(0).take_stale_bindings().empty());
  ASSERT_TRUE(ranks.run());
  EXPECT_EQ(recv[1][0], 0x77) << "this machine reads the call's own bytes";
  EXPECT_EQ(recv[1][2 * kShard], 3) << "the other machine's piece as held";
  call();  // call 2's check compared: changed
  EXPECT_EQ(ranks.transport(0).take_stale_bindings(), std::vector<size_t>{kAt});
  EXPECT_TRUE(ranks.transport(1).take_stale_bindings().empty());
  ASSERT_TRUE(ranks.run());
}

// An exported shard has no binding: its check compares the memory the peers read with what the
// first check saw there, and a buffer the program sends from instead (re-homed) with the same
// references. Both looks count in checked_bytes.
TEST(WindowTransport, AnExportedShardChangedInPlaceIsFoundByALaterCheck) {
  constexpr size_t kBytes = 512;
  FakeRanks ranks(1);
  std::vector<uint8_t> allocation(4096, 5), moved(kBytes, 5), recv(kBytes);
  ranks.exports().allocations.push_back({allocation.data(), allocation.size(), 9});
  WindowPlan plan = staging_plan(kBytes);
  plan.bound = plan.zero_copy = true;
  plan.table_room = 1024;
  plan.bind = {{allocation.data(), kBytes, 0}};
  plan.verify_first = 100;
  ranks.join({plan});
  auto call = [&](const uint8_t* from) {
    const GatherOp op{from, recv.data(), kBytes, 0};
    ranks.gather(0, std::span<const GatherOp>(&op, 1));
    EXPECT_TRUE(ranks.run());
    return ranks.transport(0).take_stale_bindings().size();
  };
  EXPECT_EQ(call(allocation.data()), 0u);  // the first look: the references
  const uint64_t one_look = ranks.transport(0).checked_bytes();
  EXPECT_EQ(one_look, kBytes);        // a shard under 64 KiB: its anchor is all of it
  EXPECT_EQ(call(moved.data()), 0u);  // call 1's check: the same bytes
  EXPECT_EQ(ranks.transport(0).checked_bytes(), 3 * one_look);  // call 2's: agreed and re-homed
  allocation[kBytes - 1] ^= 0xff;
  EXPECT_EQ(call(allocation.data()), 0u);  // call 2's check: still the same
  EXPECT_EQ(call(allocation.data()), 1u);  // call 3's check: the change
  EXPECT_EQ(call(allocation.data()), 0u);  // reported once
}

}  // namespace
}  // namespace magi::ce
