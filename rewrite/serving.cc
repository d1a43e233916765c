#include "rewrite/serving.h"

#include "base/clock.h"

#include <algorithm>
#include <exception>
#include <functional>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

namespace magi::rewrite {

ce::WindowPlan window_plan(const Decision& decision, const StepObservation& seen,
                           const SlotLayout& layout, const Options& options) {
  ce::WindowPlan plan;
  plan.slot_bytes = layout.slot_bytes;
  plan.bound = decision.bound;
  // Static weights read each shard where the program keeps it when its owner can export it.
  plan.zero_copy = decision.bound;
  plan.table_room = kPublishTableRoom;
  plan.verify_every = static_cast<uint64_t>(options.verify_every);
  plan.graph_slots = decision.graph_slots && !decision.bound;
  if (!plan.bound) return plan;
  for (const GatherDecision& g : decision.gathers) {
    if (!g.moves) continue;
    const PositionSeen& p = seen.at(g.position);
    plan.bind.push_back({reinterpret_cast<const void*>(p.sendbuf),
                         p.count * datatype_bytes(p.dtype), layout.offset_by_position[g.position]});
  }
  // The publish round is sized for this plan: every shard can be exported, whatever their count.
  plan.table_room = publish_round_bytes(plan.bind.size()) - sizeof(ContributionHeader);
  return plan;
}

namespace {

struct HomeKey {
  uint64_t sendbuf;
  uint64_t bytes;
};

template <class A, class B>
bool home_order(const A& a, const B& b) {
  return std::tie(a.sendbuf, a.bytes) < std::tie(b.sendbuf, b.bytes);
}

}  // namespace

void BoundSources::reset(const Decision& decision, const StepObservation& seen,
                         const SlotLayout& layout) {
  clear();
  if (!decision.bound) return;
  slots_.assign(seen.period(), SIZE_MAX);
  for (const GatherDecision& g : decision.gathers) {
    if (!g.moves) continue;
    const PositionSeen& p = seen.at(g.position);
    const size_t slot = layout.offset_by_position[g.position];
    homes_.push_back({p.sendbuf, p.count * datatype_bytes(p.dtype), slot});
    slots_[g.position] = slot;
  }
  std::sort(homes_.begin(), homes_.end(), home_order<Home, Home>);
  other_checked_.assign(seen.period(), 0);
  owed_.assign(seen.period(), false);
}

void BoundSources::clear() {
  homes_.clear();
  other_checked_.clear();
  owed_.clear();
  slots_.clear();
  changed_ = false;
}

void BoundSources::observe(uint32_t position, uint64_t sendbuf, uint64_t bytes,
                           size_t slot_offset) {
  const bool owed = look_up(position, sendbuf, bytes, slot_offset).verify_now;
  if (owed && position < owed_.size()) owed_[position] = true;
}

BoundSources::Found BoundSources::find(uint32_t position, uint64_t sendbuf, uint64_t bytes,
                                       size_t slot_offset) {
  Found found = look_up(position, sendbuf, bytes, slot_offset);
  if (position < owed_.size() && owed_[position]) {
    owed_[position] = false;
    found.verify_now = true;
  }
  return found;
}

BoundSources::Found BoundSources::look_up(uint32_t position, uint64_t sendbuf, uint64_t bytes,
                                          size_t slot_offset) {
  const HomeKey key{sendbuf, bytes};
  const auto it =
      std::lower_bound(homes_.begin(), homes_.end(), key,
                       [](const Home& h, const HomeKey& k) { return home_order(h, k); });
  if (it != homes_.end() && it->sendbuf == sendbuf && it->bytes == bytes) {
    if (it->slot_offset == slot_offset) return {slot_offset, false, false};
    changed_ = true;
    bool verify = false;
    if (position < other_checked_.size() && other_checked_[position] != sendbuf) {
      other_checked_[position] = sendbuf;
      verify = true;
    }
    return {it->slot_offset, verify, true};
  }
  // Re-homed: this position's shard lives here from now on. The homes stay sorted by moving the
  // one entry to its new place (no allocation).
  changed_ = true;
  const auto own = std::find_if(homes_.begin(), homes_.end(),
                                [&](const Home& h) { return h.slot_offset == slot_offset; });
  if (own != homes_.end()) {
    own->sendbuf = sendbuf;
    own->bytes = bytes;
    const auto after = [](const HomeKey& k, const Home& h) { return home_order(k, h); };
    if (own != homes_.begin() && home_order(*own, *(own - 1)))
      std::rotate(std::upper_bound(homes_.begin(), own, key, after), own, own + 1);
    else if (own + 1 != homes_.end() && home_order(*(own + 1), *own))
      std::rotate(own, own + 1, std::upper_bound(own + 1, homes_.end(), key, after));
  }
  return {slot_offset, true, false};
}

Serving::Serving(const AgreementWorld& world, const capture::CommInfo& info, ncclComm_t comm)
    : world_(world), info_(info), comm_(comm) {}

Serving::~Serving() { drop(); }

ncclResult_t Serving::serve(std::span<const ce::GatherOp> bucket, std::span<const NcclGather> calls,
                            cudaStream_t stream, uint16_t bucket_id, bool via_nccl, bool captured,
                            CostTrial& trial, const SlotLayout& layout, bool& moved) {
  moved = false;
  // A trial's NCCL side needs no transport: before the activation it is timed while the window
  // may not be there on every rank (routes never depend on it).
  if (!transport_ && !via_nccl) return ncclInternalError;  // routes say Move only with one
  // Recorded into a CUDA graph: never timed (a graph holds no host clock of this run).
  struct Timed {  // stops the timer once the bucket is served, whichever way it leaves
    CostTrial& trial;
    std::unique_ptr<ce::CompletionTimer> timer;
    cudaStream_t stream;
    uint16_t bucket;
    bool via_nccl;
    ~Timed() { trial.end_timing(std::move(timer), stream, bucket, via_nccl); }
  } timed{trial, captured ? nullptr : trial.begin_timing(world_.make, stream), stream, bucket_id,
          via_nccl};
  if (via_nccl) return forward_to_nccl(calls, stream);
  try {
    const auto timing = captured      ? ce::Transport::Timing::Captured
                        : timed.timer ? ce::Transport::Timing::Timed
                                      : ce::Transport::Timing::Untimed;
    ncclResult_t inter = ncclSuccess;
    const ce::Transport::Served served =
        two_levels() ? gather_in_two_levels(bucket, calls, stream, timing, inter)
                     : transport_->gather(bucket, stream, timing);
    if (served == ce::Transport::Served::FallBack && two_levels()) {
      // Only this machine's ranks learned of it: the others moved their part, so NCCL on the
      // whole communicator would wait for them. An error here, NCCL everywhere from the next
      // round on.
      fail(inter != ncclSuccess
               ? ("this rank's NCCL part between machines failed (ncclResult_t " +
                  std::to_string(static_cast<int>(inter)) + "), so its machine fell back")
                     .c_str()
               : "a machine's part of a two-level gather failed on a local peer");
      return inter != ncclSuccess ? inter : ncclInternalError;
    }
    if (served == ce::Transport::Served::FallBack) {
      // Every rank learned of the failure in this bucket: all of them hand it to NCCL now, and
      // refuse its gathers at the next round.
      if (!failed_)
        MAGI_WARN(Transport,
                  "comm %012llx: the transport failed on some rank; its gathers go to "
                  "NCCL until the next agreement round takes them back",
                  short_id(info_.identity));
      failed_ = true;
      return forward_to_nccl(calls, stream);
    }
    moved = true;
    if (std::string what = transport_->take_disagreement(); !what.empty()) disagreement(what);
    // Once the error is reported, a change the same check found is part of it: no WARN of its own.
    const bool reported = async_error_.load(std::memory_order_relaxed) != ncclSuccess;
    for (const size_t offset : transport_->take_stale_bindings()) {
      if (two_levels()) {
        stale_held(offset);
        continue;
      }
      for (uint32_t p = 0; p < layout.offset_by_position.size(); ++p) {
        if (layout.offset_by_position[p] != offset) continue;
        if (!reported)
          MAGI_WARN(Transport,
                    "comm %012llx: MAGI_STATIC_WEIGHTS=1, but the shard of the gather at "
                    "position %u changed after it was bound; peers may have read stale or "
                    "half-written bytes. It goes back to NCCL at the next agreement round",
                    short_id(info_.identity), p);
        stale_positions_.push_back(p);
      }
    }
    // Bytes this plan served may be wrong on some rank: every moved call says so until the
    // communicator is back on NCCL.
    return async_error_.load(std::memory_order_relaxed);
  } catch (const Error& e) {
    fail(e.what());
    return e.result();
  } catch (const std::exception& e) {  // not one of ours: the bucket's state is unknown
    fail(e.what());
    return ncclInternalError;
  }
}

void Serving::disagreement(const std::string& what) {
  if (async_error_.exchange(ncclRemoteError) == ncclSuccess)
    MAGI_WARN(Transport,
              "comm %012llx: MAGI_STATIC_WEIGHTS=1: %s. The communicator reports ncclRemoteError "
              "(its moved gathers and ncclCommGetAsyncError) and goes back to NCCL at its next "
              "agreement round",
              short_id(info_.identity), what.c_str());
  failed_ = true;
}

ncclResult_t Serving::async_error() {
  constexpr int64_t kPeerCheckPeriodNs = 1'000'000'000;
  std::string what, lost;
  {
    std::lock_guard<std::mutex> lock(transport_mutex_);
    if (transport_) what = transport_->take_disagreement();
    const auto now = static_cast<int64_t>(clock_ns());
    if (transport_ && async_error_.load() == ncclSuccess && now >= next_peer_check_ns_.load()) {
      next_peer_check_ns_.store(now + kPeerCheckPeriodNs);
      lost = transport_->lost_peer();
    }
  }
  if (!what.empty()) disagreement(what);
  if (!lost.empty()) peer_lost(lost);
  return async_error_.load();
}

void Serving::peer_lost(const std::string& who) {
  if (async_error_.exchange(ncclRemoteError) == ncclSuccess)
    MAGI_WARN(Transport,
              "comm %012llx: %s ended without releasing its window: it died with the "
              "communicator in use, and its part of the moved gathers (and of replays of CUDA "
              "graphs that hold them) will never come. The communicator reports ncclRemoteError "
              "(its moved gathers and ncclCommGetAsyncError); aborting it ends every wait on that "
              "rank",
              short_id(info_.identity), who.c_str());
  failed_ = true;
}

void Serving::fail(const char* why) noexcept {
  if (!failed_)
    MAGI_WARN(Transport,
              "comm %012llx: a moved gather failed: %s; the communicator goes back "
              "to NCCL at its next agreement round",
              short_id(info_.identity), why);
  failed_ = true;
}

ncclResult_t Serving::forward_to_nccl(std::span<const NcclGather> calls, cudaStream_t stream) {
  const RealNcclCalls& nccl = world_.nccl;
  const bool grouped = calls.size() > 1;
  if (grouped) nccl.group_start();
  ncclResult_t result = ncclSuccess;
  for (const NcclGather& g : calls) {
    const ncclResult_t r = nccl.all_gather(g.sendbuf, g.recvbuf, g.count, g.dtype, comm_, stream);
    if (result == ncclSuccess) result = r;
  }
  if (grouped) {
    const ncclResult_t r = nccl.group_end();
    if (result == ncclSuccess) result = r;
  }
  return result;
}

void Serving::span_machines(const Decision& decision, const SlotLayout& layout,
                            const StepObservation& seen) {
  say_two_levels();  // the plan before, if it moved in two levels
  machines_ = decision.machines;
  plan_gathers_ = decision.gathers.size();
  network_once_ = machines_.spans() && decision.network_once;
  held_.clear();
  held_bytes_ = 0;
  if (!network_once_) return;
  size_t at = 0;
  for (const GatherDecision& g : decision.gathers) {
    if (!g.moves || g.position >= layout.offset_by_position.size()) continue;
    const PositionSeen& p = seen.at(g.position);
    held_.push_back({g.bucket, layout.offset_by_position[g.position], at, g.position});
    at += held_room(p.count * datatype_bytes(p.dtype), machines_.count);
  }
  held_bytes_ = at;
  std::sort(held_.begin(), held_.end(), [](const Held& a, const Held& b) {
    return std::tie(a.bucket, a.slot_offset) < std::tie(b.bucket, b.slot_offset);
  });
}

Serving::Held* Serving::held_of(const ce::GatherOp& op) {
  const auto it =
      std::lower_bound(held_.begin(), held_.end(), std::make_pair(op.bucket, op.slot_offset),
                       [](const Held& h, const std::pair<uint16_t, size_t>& k) {
                         return std::tie(h.bucket, h.slot_offset) < std::tie(k.first, k.second);
                       });
  return it != held_.end() && it->bucket == op.bucket && it->slot_offset == op.slot_offset
             ? &*it
             : nullptr;
}

void Serving::say_two_levels() noexcept {
  if (two_level_calls_ != 0)
    MAGI_INFO(Transport,
              "comm %012llx: two levels: %llu gathers moved, %llu of them crossed machines (%llu "
              "bytes of this rank's shards sent to the other machines)%s",
              short_id(info_.identity), static_cast<unsigned long long>(two_level_calls_),
              static_cast<unsigned long long>(crossed_calls_),
              static_cast<unsigned long long>(crossed_bytes_),
              network_once_ ? "; static weights: the network crossed once a gather" : "");
  two_level_calls_ = crossed_calls_ = crossed_bytes_ = 0;
}

std::unique_ptr<ce::Transport> Serving::make_transport() const {
  if (!two_levels()) return world_.make.transport(info_);
  // This machine's ranks, by local index, with an identity of their own: the machines may share
  // one host (MAGI_INJECT_HOST), and their windows' names must not meet.
  const size_t r = static_cast<size_t>(info_.rank);
  capture::CommInfo local = info_;
  local.rank = machines_.local_of[r];
  local.nranks = machines_.per_machine;
  local.identity =
      info_.identity ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(machines_.machine_of[r] + 1));
  return world_.make.transport(local);
}

ce::WindowPlan Serving::machine_plan(const ce::WindowPlan& plan) const {
  ce::WindowPlan local = plan;
  // Offsets scale with the slot: gather g's M shards lie at M × its offset, past gather g - 1's.
  local.slot_bytes = plan.slot_bytes * static_cast<size_t>(machines_.count);
  local.bound = false;
  local.zero_copy = false;
  local.bind.clear();
  local.held_bytes = network_once_ ? held_bytes_ : 0;  // every moved gather's machines' shards
  return local;
}

void Serving::open_window(const ce::WindowPlan& plan, ce::HandleBlob& handle) {
  drop();
  failed_ = false;
  {
    std::lock_guard<std::mutex> lock(transport_mutex_);
    if (aborted_) throw Error(ErrorKind::Usage, "the communicator is being aborted");
    transport_ = make_transport();
    if (two_levels()) sub_comm_ = std::make_shared<SubComm>(world_.nccl);
  }
  if (!two_levels()) {
    transport_->prepare(plan, handle);
    handle_ = handle;
    return;
  }
  const ce::WindowPlan local = machine_plan(plan);
  transport_->prepare(local, handle);
  handle_ = handle;
  const auto machines = static_cast<size_t>(machines_.count);
  const auto per_machine = static_cast<size_t>(machines_.per_machine);
  places_.assign(per_machine * machines, -1);
  for (size_t l = 0; l < per_machine; ++l)
    for (size_t m = 0; m < machines; ++m)
      places_[l * machines + m] =
          machines_.rank_of(static_cast<int32_t>(m), static_cast<int32_t>(l));
  two_level_ops_.clear();
  two_level_ops_.reserve(plan_gathers_);
  crossing_.clear();
  crossing_.reserve(plan_gathers_);
  writes_.clear();
  writes_.reserve(plan_gathers_);
}

const std::vector<uint8_t>& Serving::sub_comm_id() {
  const bool first_member =
      two_levels() && machines_.machine_of[static_cast<size_t>(info_.rank)] == 0;
  if (first_member && sub_comm_id_.empty() && sub_comm_) sub_comm_id_ = sub_comm_->make_id();
  if (!first_member) sub_comm_id_.clear();
  return sub_comm_id_;
}

ce::Transport::Served Serving::gather_in_two_levels(std::span<const ce::GatherOp> bucket,
                                                    std::span<const NcclGather> calls,
                                                    cudaStream_t stream,
                                                    ce::Transport::Timing timing,
                                                    ncclResult_t& nccl) {
  const ncclComm_t sub = sub_comm_ ? sub_comm_->comm() : nullptr;
  if (sub == nullptr) throw Error(ErrorKind::Internal, "a two-level gather without its sub-comm");
  // A graph that records NCCL's part names the sub-communicator at every replay, after this plan
  // too: it then lives as long as the parent (a graph that outlives the parent is NCCL's error).
  if (timing == ce::Transport::Timing::Captured &&
      std::find(graph_sub_comms_.begin(), graph_sub_comms_.end(), sub_comm_) ==
          graph_sub_comms_.end())
    graph_sub_comms_.push_back(sub_comm_);
  const auto machines = static_cast<size_t>(machines_.count);
  const auto machine = static_cast<size_t>(machines_.machine_of[static_cast<size_t>(info_.rank)]);
  // A captured call crosses at every replay, into the slot, whatever is held: it runs only when
  // replayed, so it can neither bring held shards before an eager call reads them nor be
  // compared with them at its capture.
  const bool holds = network_once_ && timing != ce::Transport::Timing::Captured;
  two_level_ops_.clear();
  crossing_.clear();
  writes_.clear();
  bool refused = false;
  for (size_t i = 0; i < bucket.size(); ++i) {
    const ce::GatherOp& op = bucket[i];
    ce::GatherOp two = op;
    two.slot_offset = op.slot_offset * machines;
    two.pieces = static_cast<uint32_t>(machines);
    two.places = places_.data();
    Held* held = holds ? held_of(op) : nullptr;
    if (holds && held == nullptr)
      throw Error(ErrorKind::Internal, "a gather the plan holds no place for");
    if (held == nullptr) {
      // NCCL between machines writes this rank's part straight into its staging slot.
      two.sendbuf = nullptr;
      writes_.push_back(i);
      two_level_ops_.push_back(two);
      continue;
    }
    // Network once: the machines' shards are kept in the window's held region, brought there at
    // the gather's first moved call, on every rank alike (routes are). The transport stages this
    // rank's own piece from the call's buffer and checks it against the held one, which the
    // other machines took: a change breaks the promise, said (stale_held) and sent back to NCCL
    // at the next round on every rank.
    uint8_t* region = transport_->held_region();
    if (region == nullptr) throw Error(ErrorKind::Internal, "a held gather without a held region");
    uint8_t* shards = region + held->at;
    if (!held->came) {
      crossing_.push_back(i);
      held->came = true;
    } else if (held->failed) {
      refused = true;  // its held shards never came: the machine falls back, an error
    }
    two.sendbuf = shards;
    two.own_source = op.sendbuf;
    two.own_piece = static_cast<uint32_t>(machine);
    two_level_ops_.push_back(two);
  }
  // (a) Network once, a first call: the machines' shards into their held place.
  if (!crossing_.empty()) {
    nccl = cross_machines(crossing_, calls, stream,
                          [&](size_t i) { return const_cast<void*>(two_level_ops_[i].sendbuf); });
    if (nccl != ncclSuccess)
      for (const size_t i : crossing_)
        if (Held* held = held_of(bucket[i])) held->failed = true;
  }
  two_level_calls_ += bucket.size();
  // (b) Inside the machine: every local rank's machines' shards, each to its global rank's place,
  // NCCL writing the rest between machines into the slot once no local peer reads it (write_parts).
  // A failed NCCL part is said in the handshake, so this machine's ranks fall back together.
  for (ce::GatherOp& two : two_level_ops_) two.refuse = refused || nccl != ncclSuccess;
  writer_.calls = calls;
  writer_.nccl = ncclSuccess;
  const ce::Transport::Served served =
      transport_->gather(two_level_ops_, stream, timing, writes_.empty() ? nullptr : &writer_);
  if (nccl == ncclSuccess) nccl = writer_.nccl;
  return served;
}

template <class Into>
ncclResult_t Serving::cross_machines(std::span<const size_t> gathers,
                                     std::span<const NcclGather> calls, cudaStream_t stream,
                                     Into into) {
  const RealNcclCalls& real = world_.nccl;
  const ncclComm_t sub = sub_comm_->comm();
  const auto machines = static_cast<size_t>(machines_.count);
  ncclResult_t first = ncclSuccess;
  const auto keep = [&](ncclResult_t r) {
    if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
  };
  // This rank's shard to its peers of the same local index, theirs here, in machine order.
  const bool grouped = gathers.size() > 1;
  if (grouped) keep(real.group_start());
  for (const size_t i : gathers) {
    const NcclGather& g = calls[i];
    keep(real.all_gather(g.sendbuf, into(i), g.count, g.dtype, sub, stream));
    crossed_bytes_ += g.count * datatype_bytes(g.dtype) * (machines - 1);
  }
  if (grouped) keep(real.group_end());
  crossed_calls_ += gathers.size();
  return first;
}

bool Serving::InterMachine::write_parts(std::span<const ce::GatherOp> bucket, uint8_t* slot,
                                        void* stream) {
  nccl = serving.cross_machines(serving.writes_, calls, static_cast<cudaStream_t>(stream),
                                [&](size_t i) { return slot + bucket[i].slot_offset; });
  return nccl == ncclSuccess;
}

void Serving::stale_held(size_t at) {
  for (const Held& h : held_)
    if (h.at == at) return shard_changed(h.position);
}

void Serving::shard_changed(uint32_t position) {
  if (std::find(stale_positions_.begin(), stale_positions_.end(), position) !=
      stale_positions_.end())
    return;
  MAGI_WARN(Transport,
            "comm %012llx: MAGI_STATIC_WEIGHTS=1, but the shard of the gather at position %u "
            "changed after the other machines took it; they read its old bytes. It goes back to "
            "NCCL at the next agreement round",
            short_id(info_.identity), position);
  stale_positions_.push_back(position);
}

void Serving::begin_prepare(const ce::WindowPlan& plan, std::chrono::milliseconds delay) {
  if (two_levels()) throw Error(ErrorKind::Internal, "a two-level window is prepared at the call");
  drop();
  failed_ = false;
  handle_ = {};
  std::lock_guard<std::mutex> lock(transport_mutex_);
  if (aborted_) throw Error(ErrorKind::Usage, "the communicator is being aborted");
  try {
    set_up_ = SetUpJob::prepare(make_transport(), plan, delay);
  } catch (const std::system_error& e) {  // no thread to be had: the plan is not served
    throw Error(ErrorKind::System, std::string("starting the set-up thread: ") + e.what());
  }
}

void Serving::begin_attach(std::span<const ce::HandleBlob> handles,
                           std::span<const ce::SourceTable> tables, std::chrono::milliseconds delay,
                           std::span<const std::vector<uint8_t>> sub_comm_ids) {
  std::lock_guard<std::mutex> lock(transport_mutex_);
  if (aborted_) throw Error(ErrorKind::Usage, "the communicator is being aborted");
  if (!transport_) throw Error(ErrorKind::Internal, "no window to attach");
  std::vector<ce::HandleBlob> blobs(handles.begin(), handles.end());
  std::function<void()> first;
  if (two_levels()) {
    // This machine's windows, by local index; the sub-communicator of this rank's local index,
    // from the id its first member (machine 0) published.
    const size_t r = static_cast<size_t>(info_.rank);
    const int32_t machine = machines_.machine_of[r];
    const int32_t local = machines_.local_of[r];
    blobs.clear();
    for (int32_t l = 0; l < machines_.per_machine; ++l)
      blobs.push_back(handles[static_cast<size_t>(machines_.rank_of(machine, l))]);
    const auto founder = static_cast<size_t>(machines_.rank_of(0, local));
    if (!sub_comm_ || founder >= sub_comm_ids.size())
      throw Error(ErrorKind::Internal, "no sub-communicator to form");
    const bool fail = world_.options.inject_fault.where == Options::Fault::Where::SubComm &&
                      world_.options.inject_fault.rank == info_.rank;
    first = [sub = sub_comm_, id = sub_comm_ids[founder], count = machines_.count, machine, local,
             identity = info_.identity, fail] {
      const uint64_t began = clock_ns();
      sub->form(id, count, machine, fail);
      MAGI_INFO(Transport,
                "comm %012llx: the sub-communicator of local index %d formed (rank %d of %d) in "
                "%.2f ms, off the program's calls",
                short_id(identity), local, machine, count,
                static_cast<double>(clock_ns() - began) / 1e6);
    };
  }
  try {
    set_up_ = SetUpJob::attach(std::move(transport_), std::move(blobs),
                               std::vector<ce::SourceTable>(tables.begin(), tables.end()), delay,
                               std::move(first));
  } catch (const std::system_error& e) {  // no thread to be had: the plan is not served
    throw Error(ErrorKind::System, std::string("starting the set-up thread: ") + e.what());
  }
}

void Serving::attach_now(std::span<const ce::HandleBlob> handles,
                         std::span<const ce::SourceTable> tables) {
  if (two_levels()) throw Error(ErrorKind::Internal, "a two-level window is attached off the call");
  const uint64_t began = clock_ns();
  transport_->attach(handles, tables);
  set_up_ns_ = clock_ns() - began;
}

Serving::SetUp Serving::poll_set_up(std::string& error) {
  std::lock_guard<std::mutex> lock(transport_mutex_);
  if (!set_up_) return transport_ ? SetUp::Done : SetUp::Failed;
  const SetUpJob::State state = set_up_->state();
  if (state == SetUpJob::State::Running) return SetUp::Running;
  error = set_up_->error();
  set_up_ns_ = set_up_->took_ns();
  transport_ = set_up_->take();
  if (state == SetUpJob::State::Done && set_up_->handle() != nullptr) handle_ = *set_up_->handle();
  set_up_.reset();
  return state == SetUpJob::State::Done ? SetUp::Done : SetUp::Failed;
}

void Serving::drop() {
  say_two_levels();
  std::lock_guard<std::mutex> lock(transport_mutex_);
  // A set-up still running finishes, and releases its transport, on its own thread; a
  // sub-communicator still forming gives up, a formed one is destroyed with its last holder
  // (graph_sub_comms_ holds those that CUDA graphs replay).
  if (sub_comm_) sub_comm_->cancel(false);
  sub_comm_.reset();
  sub_comm_id_.clear();
  orphan(std::move(set_up_));
  reap_orphans();
  if (!transport_) return;
  try {
    transport_->release();
  } catch (const Error& e) {
    MAGI_WARN(Transport, "comm %012llx: releasing the window: %s", short_id(info_.identity),
              e.what());
  }
  transport_.reset();
}

void Serving::abandon() {
  std::lock_guard<std::mutex> lock(transport_mutex_);
  aborted_ = true;
  // The inter-machine part of a call blocked on another thread returns once its own
  // communicator is aborted too.
  if (sub_comm_) sub_comm_->cancel(true);
  for (const std::shared_ptr<SubComm>& sub : graph_sub_comms_) sub->cancel(true);
  orphan(std::move(set_up_));          // no gather waits on a window being set up
  ce::abandon_graphs(info_.identity);  // windows of earlier plans that graphs still replay
  if (!transport_) return;
  try {
    transport_->abandon();
  } catch (const Error& e) {
    MAGI_WARN(Transport, "comm %012llx: abandoning the window: %s", short_id(info_.identity),
              e.what());
  }
}

}  // namespace magi::rewrite
