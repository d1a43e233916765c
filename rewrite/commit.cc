#include "rewrite/commit.h"

#include <algorithm>
#include <chrono>

namespace magi::rewrite {
namespace {

// MAGI_INJECT_FAULT=slow-prepare or slow-attach on this rank: the set-up waits this long first.
std::chrono::milliseconds injected_delay(const Options& options, int rank,
                                         Options::Fault::Where where) {
  const bool slow = options.inject_fault.where == where && options.inject_fault.rank == rank;
  return std::chrono::milliseconds(slow ? Commit::kSlowSetUpMs : 0);
}

uint64_t ns_of(std::chrono::milliseconds delay) {
  return static_cast<uint64_t>(std::chrono::nanoseconds(delay).count());
}

}  // namespace

void Commit::prepare(Contribution& c, ActivePlan& plan, const StepObservation& seen) {
  // The owner's side of the set-up (finding and exporting each allocation that holds a shard,
  // the window) runs off the program's calls when it would take long, as the attach does: the
  // publish then says "still setting up" and is issued again until every rank's is ready. Each
  // rank chooses for itself: the publish reads the same either way.
  const std::chrono::milliseconds delay =
      injected_delay(world_.options, info_.rank, Options::Fault::Where::SlowPrepare);
  const uint64_t expected_ns = plan.bound_shards() * world_.make.export_ns + ns_of(delay);
  wait_ = SetUpWait{};
  // A two-level window is one machine's staging window, made at the call like any other.
  prepare_in_background_ = expected_ns > kSetUpAtTheCallNs && !plan.decision.machines.spans();
  log_.new_plan();
  serving_.span_machines(plan.decision, plan.layout, seen);
  try {
    const ce::WindowPlan window = window_plan(plan.decision, seen, plan.layout, world_.options);
    plan.sources.reset(plan.decision, seen, plan.layout);
    if (prepare_in_background_) {
      serving_.begin_prepare(window, delay);
      c.header.flags |= kCanServe | kSettingUp;
    } else {
      serving_.open_window(window, c.header.handle);
      fill_publish(c, plan);
    }
  } catch (const Error& e) {
    log_.cannot_prepare_window(e.what());
    c.header.reason = static_cast<uint8_t>(Reason::TransportFailed);
    serving_.drop();
  }
}

void Commit::prepare_again(Contribution& c, const ActivePlan& plan) {
  std::string error;
  switch (serving_.poll_set_up(error)) {
    case Serving::SetUp::Running: c.header.flags |= kCanServe | kSettingUp; break;
    case Serving::SetUp::Done:
      c.header.handle = serving_.handle();
      fill_publish(c, plan);
      break;
    case Serving::SetUp::Failed:
      log_.cannot_prepare_window(error.empty() ? "no window" : error.c_str());
      c.header.reason = static_cast<uint8_t>(Reason::TransportFailed);
      serving_.drop();
      break;
  }
}

void Commit::fill_publish(Contribution& c, const ActivePlan& plan) {
  const size_t window = serving_.window_bytes();
  if (serving_.two_levels()) {
    // The first member of each sub-communicator (machine 0) hands its id to the others.
    const std::vector<uint8_t>& id = serving_.sub_comm_id();
    if (!id.empty()) {
      c.table = id;
      c.header.table_bytes = static_cast<uint32_t>(c.table.size());
      c.header.flags |= kSubCommId;
    }
  }
  c.header.flags |= kCanServe;
  if (!plan.decision.bound) {  // the default mode's staging window
    log_.staging_window(window, plan.layout.slot_bytes, plan.decision.moved);
    return;
  }
  const ce::SourceTable& table = serving_.sources();  // zero-copy: what the peers need to read
  c.table.resize(table.bytes() + 8);
  table.serialize(c.table);
  c.header.table_bytes = static_cast<uint32_t>(c.table.size());
  if (!log_.window_unsaid()) return;  // said at an earlier publish of this plan
  const double off_ms =
      prepare_in_background_ ? static_cast<double>(serving_.set_up_ns()) / 1e6 : -1.0;
  log_.static_window(plan.decision.moved, serving_.memory(), window, off_ms);
}

void Commit::attach(const CommitOutcome& publish) {
  // Opening the peers' memory (a mapping per peer window and exported allocation) runs off the
  // program's calls when it would take long (set_up.h): the confirm says whether it is done, and
  // is asked again at each step until every rank is. Each rank chooses for itself: the confirm
  // says the same either way.
  const std::chrono::milliseconds delay =
      injected_delay(world_.options, info_.rank, Options::Fault::Where::SlowAttach);
  // An export by descriptor is fetched from its owner's channel, which may wait for the owner's
  // own attach (ce_transport/fd_channel.h): never at a program call.
  size_t mappings = 0;
  bool by_descriptor = false;
  for (size_t r = 0; r < publish.handles.size(); ++r) {
    if (static_cast<int>(r) == info_.rank) continue;
    mappings += 1 + (r < publish.tables.size() ? publish.tables[r].exports.size() : 0);
    if (r < publish.tables.size())
      for (const ce::ExportRecord& e : publish.tables[r].exports)
        by_descriptor |= e.kind == ce::ExportRecord::Kind::ByDescriptor;
  }
  const uint64_t expected_ns = mappings * world_.make.mapping_ns + ns_of(delay);
  set_up_failed_.clear();
  log_.attach_begins();
  try {
    // Two levels: forming the sub-communicator waits for its members, never at a program call.
    set_up_in_background_ =
        by_descriptor || expected_ns > kSetUpAtTheCallNs || serving_.two_levels();
    if (set_up_in_background_)
      serving_.begin_attach(publish.handles, publish.tables, delay, publish.sub_comm_ids);
    else
      serving_.attach_now(publish.handles, publish.tables);
  } catch (const Error& e) {
    set_up_failed_ = e.what();
  }
}

void Commit::confirm(Contribution& c, const ActivePlan& plan, uint64_t seq) {
  if (plan.sources.changed()) {
    // A shard moved since the publish copied or exported it: what the peers would read may be
    // another tensor's. Every rank reads this refusal at the same call.
    log_.binding_changed(plan.round);
    c.header.reason = static_cast<uint8_t>(Reason::BindingChanged);
    return;
  }
  std::string error = set_up_failed_;
  const Serving::SetUp set_up =
      error.empty() ? serving_.poll_set_up(error) : Serving::SetUp::Failed;
  switch (set_up) {
    case Serving::SetUp::Running: c.header.flags |= kCanServe | kSettingUp; break;
    case Serving::SetUp::Done: {
      c.header.flags |= kCanServe;
      if (!log_.set_up_unsaid()) break;  // said at an earlier confirm
      const ce::WindowMemory m = serving_.memory();
      log_.set_up_done(m, static_cast<double>(serving_.set_up_ns()) / 1e6, set_up_in_background_);
      RoundStamp stamp;
      stamp.comm_id = info_.identity;
      stamp.rank = info_.rank;
      stamp.round = plan.round;
      record_window(world_.trace, stamp, seq, plan.decision.mode, m);
      break;
    }
    case Serving::SetUp::Failed:
      log_.cannot_open_windows(error);
      c.header.reason = static_cast<uint8_t>(Reason::TransportFailed);
      set_up_failed_ = error.empty() ? "no window" : error;
      break;
  }
}

bool Commit::wait(RoundKind kind, uint64_t decision_hash, uint64_t steps) {
  const uint32_t gap = 1u << std::min<uint32_t>(wait_.reads++, 6);
  wait_.kind = kind;
  wait_.decision_hash = decision_hash;
  wait_.due_step = steps + gap - 1;
  return gap == 1;
}

}  // namespace magi::rewrite
