#include "rewrite/contribution.h"

#include "base/base.h"
#include "base/sizes.h"

#include <algorithm>
#include <cstring>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace magi::rewrite {

size_t publish_round_bytes(size_t shards) {
  const size_t needed = sizeof(ContributionHeader) + 8 +
                        shards * (ce::SourceTable::kExportBytes + ce::SourceTable::kSourceBytes);
  size_t bytes = kContributionBytes;
  while (bytes < needed) bytes *= 2;
  return bytes;
}

void Contribution::serialize(std::span<uint8_t> out) const {
  std::fill(out.begin(), out.end(), uint8_t{0});
  std::memcpy(out.data(), &header, sizeof(header));
  if (!table.empty()) {
    std::memcpy(out.data() + sizeof(header), table.data(),
                std::min(table.size(), out.size() - sizeof(header)));
    return;
  }
  if (!costs.empty()) {
    const size_t n = std::min<size_t>(costs.size(), kMaxGathers);
    std::memcpy(out.data() + sizeof(header), costs.data(), n * sizeof(BucketCost));
    return;
  }
  const size_t n = std::min<size_t>(entries.size(), kMaxGathers);
  if (n > 0) std::memcpy(out.data() + sizeof(header), entries.data(), n * sizeof(GatherEntry));
}

bool Contribution::parse(std::span<const uint8_t> in, Contribution& out) {
  if (in.size() < kContributionBytes) return false;
  std::memcpy(&out.header, in.data(), sizeof(out.header));
  if (out.header.magic != kContributionMagic || out.header.version != kContributionVersion)
    return false;
  out.table.clear();
  if (out.header.kind == static_cast<uint8_t>(RoundKind::Publish) ||
      out.header.kind == static_cast<uint8_t>(RoundKind::Hello)) {
    out.entries.clear();
    out.costs.clear();
    if (out.header.table_bytes > in.size() - sizeof(out.header)) return false;
    const uint8_t* at = in.data() + sizeof(out.header);
    out.table.assign(at, at + out.header.table_bytes);
    return true;
  }
  const size_t n = std::min<size_t>(out.header.gathers, kMaxGathers);
  if (out.header.kind == static_cast<uint8_t>(RoundKind::Cost)) {
    out.costs.resize(n);
    if (n > 0)
      std::memcpy(out.costs.data(), in.data() + sizeof(out.header), n * sizeof(BucketCost));
    out.entries.clear();
    return true;
  }
  out.entries.resize(n);
  if (n > 0)
    std::memcpy(out.entries.data(), in.data() + sizeof(out.header), n * sizeof(GatherEntry));
  return true;
}

namespace {

// `all`: nranks contributions of one size (a publish's may be larger than kContributionBytes).
std::vector<Contribution> parse_all(std::span<const uint8_t> all, int nranks) {
  if (nranks <= 0 || all.size() % static_cast<size_t>(nranks) != 0) return {};
  const size_t each = all.size() / static_cast<size_t>(nranks);
  std::vector<Contribution> out(static_cast<size_t>(nranks));
  for (int r = 0; r < nranks; ++r) {
    if (!Contribution::parse(all.subspan(static_cast<size_t>(r) * each, each),
                             out[static_cast<size_t>(r)]))
      return {};
  }
  return out;
}

// Every rank's memory reachable from every other rank's of its machine: for GPUs either the same
// device (processes sharing one GPU) or peer access both ways. A communicator spanning machines
// gathers in two levels where its machines are even (rewrite/machines.h).
Reason locality_refusal(const std::vector<Contribution>& c, const Machines& machines) {
  if (machines.spans())
    if (const Reason r = machines.refusal(); r != Reason::None) return r;
  if (static_cast<ce::Backend>(c[0].header.backend) != ce::Backend::Cuda) return Reason::None;
  for (size_t i = 0; i < c.size(); ++i) {
    const Contribution& a = c[i];
    for (size_t j = 0; j < c.size(); ++j) {
      if (machines.spans() && machines.machine_of[i] != machines.machine_of[j]) continue;
      const Contribution& b = c[j];
      const int32_t d = b.header.device;
      if (a.header.device == d) continue;
      if (d < 0 || d >= 64 || a.header.device < 0 || !(a.header.peer_access_mask >> d & 1u))
        return Reason::PeerNotAccessible;
    }
  }
  return Reason::None;
}

Decision nothing_moves(Decision d, Reason why, const Contribution& mine) {
  d.reason = why;
  d.gathers.clear();
  for (const GatherEntry& e : mine.entries)
    d.gathers.push_back({e.position, e.bucket, false, why, -1});
  d.moved = 0;
  d.hash = 0;
  return d;
}

// Identical mode matches gathers by (call site, occurrence of that call site in the step). With
// equal call-site digests this is the position order; checked anyway, since the digest is a hash.
bool same_callsite_keys(const std::vector<Contribution>& c) {
  for (const Contribution& other : c) {
    if (other.entries.size() != c[0].entries.size()) return false;
    for (size_t g = 0; g < other.entries.size(); ++g)
      if (other.entries[g].callsite != c[0].entries[g].callsite) return false;
  }
  return true;
}

// Refine when every rank proposed the same longer step (period and phase): each proposal is a
// rank's own reading of its facts, so only unanimity makes it a shared fact.
Decision refinement(const std::vector<Contribution>& c, const Decision& d,
                    const Contribution& mine) {
  const uint32_t period = mine.header.refine_period;
  const uint32_t phase = mine.header.refine_phase;
  if (period == 0 || period == mine.header.period || period > kMaxPosition || phase >= period)
    return {};
  for (const Contribution& x : c)
    if (x.header.refine_period != period || x.header.refine_phase != phase) return {};
  Decision r = nothing_moves(d, Reason::StepRefined, mine);
  r.refine_period = period;
  r.refine_phase = phase;
  return r;
}

}  // namespace

Decision decide(std::span<const uint8_t> all, int nranks, int my_rank) {
  Decision d;
  const std::vector<Contribution> c = parse_all(all, nranks);
  if (c.empty() || my_rank < 0 || my_rank >= nranks) {
    d.mode = AgreementMode::Abort;
    d.reason = Reason::StepsDiffer;
    return d;
  }
  const Contribution& mine = c[static_cast<size_t>(my_rank)];
  d.bound = true;
  bool graph_slots_refused = false;
  for (const Contribution& x : c) {
    d.dry_run = d.dry_run || (x.header.flags & kDryRun) != 0;
    d.bound = d.bound && (x.header.flags & kStaticWeights) != 0;  // default mode unless all assert
    d.graph_slots = d.graph_slots || (x.header.flags & kWantsGraphSlots) != 0;
    graph_slots_refused = graph_slots_refused || (x.header.flags & kRefusesGraphSlots) != 0;
  }
  d.graph_slots = d.graph_slots && !graph_slots_refused;
  const bool graph_slots_allowed = !graph_slots_refused;

  // A round issued inside an open group on some rank is void, whatever else it says: that rank
  // decided so without reading it, and every rank must reach the same decision.
  for (const Contribution& x : c) {
    if (x.header.flags & kIssuedInGroup) return nothing_moves(d, Reason::AnchorInGroup, mine);
  }
  // Abort: the steps themselves differ, so no gather can be matched.
  for (const Contribution& x : c) {
    const ContributionHeader& h = x.header;
    if (h.kind != static_cast<uint8_t>(RoundKind::Propose) || h.round != mine.header.round ||
        h.nranks != nranks || h.step_digest != mine.header.step_digest ||
        h.period != mine.header.period || h.gathers != mine.header.gathers) {
      d.mode = AgreementMode::Abort;
      return nothing_moves(d, Reason::StepsDiffer, mine);
    }
  }
  // Refinement before the group checks: grouping that looks unstable step by step may be stable
  // over the longer step.
  if (const Decision r = refinement(c, d, mine); r.refine_period != 0) return r;
  if (mine.header.gathers > kMaxGathers) {
    d.mode = AgreementMode::Abort;
    return nothing_moves(d, Reason::TooManyGathers, mine);
  }
  for (const Contribution& x : c) {
    if (x.header.group_digest != mine.header.group_digest || (x.header.flags & kGroupsUnstable)) {
      d.mode = AgreementMode::Abort;
      for (const Contribution& y : c)
        d.retry_soon = d.retry_soon || (y.header.flags & kGroupsUnstable);
      return nothing_moves(d, Reason::GroupsDiffer, mine);
    }
  }

  bool identical = true;
  for (const Contribution& x : c)
    identical = identical && x.header.callsite_digest == mine.header.callsite_digest;
  d.mode = identical && same_callsite_keys(c) ? AgreementMode::Identical : AgreementMode::Slot;

  // Whole-communicator refusals: nothing moves, but the mode is still reported.
  for (const Contribution& x : c) {
    if (x.header.backend != mine.header.backend)
      return nothing_moves(d, Reason::BackendDiffers, mine);
  }
  {
    std::vector<uint64_t> hosts;
    for (const Contribution& x : c) hosts.push_back(x.header.host);
    d.machines = machines_of(hosts);
  }
  if (const Reason r = locality_refusal(c, d.machines); r != Reason::None)
    return nothing_moves(d, r, mine);

  // AND across ranks, gather by gather (matched by position: in identical mode the call-site
  // keys were checked to line up with it).
  const size_t n = mine.entries.size();
  d.gathers.resize(n);
  for (size_t g = 0; g < n; ++g) {
    GatherDecision& out = d.gathers[g];
    out.position = mine.entries[g].position;
    out.bucket = mine.entries[g].bucket;
    out.reason = static_cast<Reason>(mine.entries[g].reason);
    out.refused_by = -1;
    for (int r = 0; r < nranks; ++r) {
      const GatherEntry& e = c[static_cast<size_t>(r)].entries[g];
      if (e.position != out.position || e.bucket != out.bucket) {
        return nothing_moves(d, Reason::GroupsDiffer, mine);  // digests collided; be safe
      }
      if (r != my_rank && e.reason != static_cast<uint8_t>(Reason::None) && out.refused_by < 0)
        out.refused_by = r;
      if (e.reason == static_cast<uint8_t>(Reason::NotStable)) d.retry_soon = true;
    }
    if (out.reason == Reason::None && out.refused_by >= 0) out.reason = Reason::OtherRankRefused;
    out.moves = out.reason == Reason::None;
  }
  // A bucket moves whole or not at all.
  for (size_t g = 0; g < n; ++g) {
    if (d.gathers[g].moves) continue;
    for (GatherDecision& other : d.gathers) {
      if (other.bucket == d.gathers[g].bucket && other.moves) {
        other.moves = false;
        other.reason = Reason::BucketPartial;
      }
    }
  }

  // Static weights bind each shard once, from its send buffer as it is at the anchor: exact only
  // where that buffer holds its shard at every moment. A gather transient on any rank (buffer
  // reused between positions, or in place) would bind another layer's bytes there, so the whole
  // plan stages instead, as in the default mode, which is exact for any buffer reuse. Decided
  // from every rank's flags, so alike everywhere; the hash covers `bound`.
  if (d.bound) {
    for (size_t g = 0; g < n && d.transient_rank < 0; ++g) {
      if (!d.gathers[g].moves) continue;
      for (int r = 0; r < nranks; ++r) {
        const GatherEntry& e = c[static_cast<size_t>(r)].entries[g];
        if (e.flags & kEntryTransient) {
          d.transient_position = d.gathers[g].position;
          d.transient_rank = r;
          d.transient_flags = static_cast<uint8_t>(e.flags);
          break;
        }
      }
    }
    if (d.transient_rank >= 0) d.bound = false;
  }
  // Across machines nothing is bound in a window: each rank stages its machines' shards (which
  // static weights hold once they came, below). Graph slots unless some rank refuses them
  // (MAGI_GRAPH_SLOTS=never): a spanning communicator has no rounds at a capture (they need one
  // host: rewrite/capture_rounds.cc), so only a plan agreed on eager calls can move its captured
  // gathers, NCCL's part between machines recorded into the graph with the copies.
  if (d.machines.spans()) {
    d.static_across_machines = d.bound;
    d.bound = false;
    d.graph_slots = graph_slots_allowed;
  }
  // Static weights across machines: the other machines' shards of every moved gather are held
  // once they came, where every rank may hold them all (the least MAGI_BIND_MAX_MIB of any rank,
  // so alike everywhere; past it, they cross at every call as in the default mode).
  if (d.static_across_machines) {
    uint64_t held = 0;
    for (size_t g = 0; g < n; ++g)
      if (d.gathers[g].moves)
        held += held_room(mine.entries[g].count * datatype_bytes(mine.entries[g].dtype),
                          d.machines.count);
    uint64_t room = UINT64_MAX;
    for (const Contribution& x : c) room = std::min(room, x.header.hold_max_bytes);
    d.network_once = held != 0 && held <= room;
    d.held_bytes = d.network_once ? held : 0;
  }
  if (d.bound) d.graph_slots = false;  // a bound window's captured gathers need none

  recount(d, mine.header.step_digest);
  return d;
}

void recount(Decision& d, uint64_t step_digest) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, &step_digest, sizeof(step_digest));
  XXH3_64bits_update(&state, &d.mode, sizeof(d.mode));
  XXH3_64bits_update(&state, &d.bound, sizeof(d.bound));
  XXH3_64bits_update(&state, &d.graph_slots, sizeof(d.graph_slots));
  if (d.machines.spans()) {  // the topology served by: the same on every rank
    XXH3_64bits_update(&state, &d.network_once, sizeof(d.network_once));
    XXH3_64bits_update(&state, &d.machines.per_machine, sizeof(d.machines.per_machine));
    XXH3_64bits_update(&state, d.machines.rank_at.data(),
                       d.machines.rank_at.size() * sizeof(int32_t));
  }
  d.moved = 0;
  for (const GatherDecision& g : d.gathers) {
    if (!g.moves) continue;
    ++d.moved;
    XXH3_64bits_update(&state, &g.position, sizeof(g.position));
    XXH3_64bits_update(&state, &g.bucket, sizeof(g.bucket));
  }
  d.hash = d.moved != 0 ? XXH3_64bits_digest(&state) | 1u : 0;
}

Decision void_propose(const std::vector<GatherEntry>& entries) {
  Decision d;
  d.reason = Reason::AnchorInGroup;
  for (const GatherEntry& e : entries)
    d.gathers.push_back({e.position, e.bucket, false, Reason::AnchorInGroup, -1});
  return d;
}

std::vector<CostVerdict> decide_cost(std::span<const uint8_t> all, int nranks, size_t buckets) {
  std::vector<CostVerdict> out(buckets);
  const std::vector<Contribution> c = parse_all(all, nranks);
  if (c.empty()) return out;  // cannot compare: the agreed plan stands
  for (size_t b = 0; b < buckets; ++b) {
    CostVerdict& cost = out[b];
    cost.measured = true;
    for (const Contribution& x : c) {
      if (x.header.kind != static_cast<uint8_t>(RoundKind::Cost) || b >= x.costs.size() ||
          x.costs[b].moved_ns == 0 || x.costs[b].nccl_ns == 0) {
        cost = CostVerdict{};
        break;
      }
      cost.moved_ns = std::max(cost.moved_ns, x.costs[b].moved_ns);
      cost.nccl_ns = std::max(cost.nccl_ns, x.costs[b].nccl_ns);
    }
    cost.keep = !cost.measured || cost.moved_ns <= cost.nccl_ns;
  }
  return out;
}

CommitOutcome decide_commit(std::span<const uint8_t> all, int nranks, RoundKind kind,
                            uint64_t decision_hash) {
  CommitOutcome out;
  const std::vector<Contribution> c = parse_all(all, nranks);
  if (c.empty()) {
    out.reason = Reason::CommitRefused;
    return out;
  }
  for (const Contribution& x : c) {
    if (x.header.kind != static_cast<uint8_t>(kind) || x.header.decision_hash != decision_hash) {
      out.reason = Reason::CommitRefused;
      return out;
    }
    if (!(x.header.flags & kCanServe)) {
      // The first refusing rank's reason, where it gave one.
      out.reason = x.header.flags & kIssuedInGroup ? Reason::AnchorInGroup
                   : x.header.reason == static_cast<uint8_t>(Reason::BindingChanged)
                       ? Reason::BindingChanged
                       : Reason::TransportFailed;
      return out;
    }
  }
  {  // a publish or confirm of a rank still setting up: asked again (CommAgreement)
    for (const Contribution& x : c) {
      if (x.header.flags & kSettingUp) {
        out.pending = true;
        out.reason = Reason::SettingUp;
        return out;
      }
    }
  }
  if (kind == RoundKind::Publish) {
    for (const Contribution& x : c) {
      out.handles.push_back(x.header.handle);
      out.tables.emplace_back();
      out.sub_comm_ids.emplace_back();
      if (x.header.flags & kSubCommId) {
        out.sub_comm_ids.back() = x.table;
        continue;
      }
      if (x.table.empty()) continue;
      try {
        out.tables.back() = ce::SourceTable::parse(x.table);
      } catch (const Error&) {  // every rank parses the same bytes: all refuse alike
        out.handles.clear();
        out.tables.clear();
        out.reason = Reason::CommitRefused;
        return out;
      }
    }
  }
  out.agreed = true;
  return out;
}

}  // namespace magi::rewrite
