#include "tools/magice-trace/rounds.h"

#include <algorithm>
#include <map>
#include <optional>
#include <utility>

#include "tools/magice-trace/members.h"

namespace magi::tool {
namespace {

using trace::AgreementRecord;
using trace::DecisionRecord;
using trace::RoundEvent;
using trace::RoundKind;
using trace::Verdict;

bool is(const AgreementRecord& r, RoundEvent event) {
  return r.event == static_cast<uint8_t>(event);
}

bool is_propose_read(const AgreementRecord& r) {
  return r.kind == static_cast<uint8_t>(RoundKind::Propose) && is(r, RoundEvent::Read);
}

// Routes changed, or the commit that would have changed them failed (publish or confirm read
// with a reason): without the latter, a round that never took effect would look silent.
bool is_route_change(const AgreementRecord& r) {
  const bool commit_failed = r.kind != static_cast<uint8_t>(RoundKind::Propose) &&
                             r.kind != static_cast<uint8_t>(RoundKind::Hello) &&
                             is(r, RoundEvent::Read) && r.reason != 0;
  return is(r, RoundEvent::Activated) || is(r, RoundEvent::Deactivated) || commit_failed;
}

struct Collected {
  std::vector<const AgreementRecord*> agreements;  // file order
  std::vector<const DecisionRecord*> decisions;
};

// The rounds one rank read, each with the route changes between its read and the next one's.
// Collective indices order the events: they grow along the communicator on every rank.
std::vector<ReadRound> read_rounds(const Collected& rank) {
  std::map<uint32_t, ReadRound> by_round;
  for (const AgreementRecord* r : rank.agreements) {
    if (!is_propose_read(*r)) continue;
    ReadRound& round = by_round[r->round];
    if (round.read == nullptr) round.read = r;
  }
  // A later record for a position supersedes an earlier one of the same round (the cost round
  // re-decides the gathers its propose moved).
  std::map<std::pair<uint32_t, uint32_t>, const DecisionRecord*> last;
  for (const DecisionRecord* d : rank.decisions) last[{d->round, d->position}] = d;
  for (const auto& [key, d] : last) by_round[key.first].decisions.push_back(d);

  // Where each round begins: its read, else (the read was lost) its earliest record of any kind.
  std::map<uint32_t, uint64_t> earliest;
  for (const AgreementRecord* r : rank.agreements) {
    auto [it, inserted] = earliest.try_emplace(r->round, r->seq);
    if (!inserted) it->second = std::min(it->second, r->seq);
  }
  std::vector<ReadRound> rounds;
  std::vector<uint64_t> starts;
  for (auto& [number, round] : by_round) {
    round.round = number;
    std::stable_sort(
        round.decisions.begin(), round.decisions.end(),
        [](const DecisionRecord* a, const DecisionRecord* b) { return a->position < b->position; });
    uint64_t start = starts.empty() ? 0 : starts.back();  // nothing known: with the one before
    if (round.read != nullptr) {
      start = round.read->seq;
    } else if (const auto it = earliest.find(number); it != earliest.end()) {
      start = it->second;
    }
    rounds.push_back(std::move(round));
    starts.push_back(start);
  }

  std::vector<const AgreementRecord*> changes;
  for (const AgreementRecord* r : rank.agreements) {
    if (is_route_change(*r)) changes.push_back(r);
  }
  std::stable_sort(
      changes.begin(), changes.end(),
      [](const AgreementRecord* a, const AgreementRecord* b) { return a->seq < b->seq; });
  for (const AgreementRecord* change : changes) {
    // The latest round read at or before the change; none when the change predates every read.
    std::optional<size_t> owner;
    for (size_t i = 0; i < rounds.size(); ++i) {
      if (starts[i] <= change->seq) owner = i;
    }
    if (owner) rounds[*owner].route_changes.push_back(change);
  }
  return rounds;
}

}  // namespace

trace::AgreementMode ReadRound::mode() const {
  if (read != nullptr) return static_cast<trace::AgreementMode>(read->mode);
  if (!decisions.empty()) return static_cast<trace::AgreementMode>(decisions.front()->mode);
  return trace::AgreementMode::None;
}

uint32_t ReadRound::gathers() const {
  return read != nullptr ? read->gathers : static_cast<uint32_t>(decisions.size());
}

uint32_t ReadRound::moved() const {
  if (read != nullptr) return read->moved;
  return static_cast<uint32_t>(
      std::count_if(decisions.begin(), decisions.end(), [](const DecisionRecord* d) {
        return d->verdict == static_cast<uint8_t>(Verdict::Moved) ||
               d->verdict == static_cast<uint8_t>(Verdict::WouldMove);
      }));
}

bool ReadRound::dry_run() const {
  return std::any_of(decisions.begin(), decisions.end(), [](const DecisionRecord* d) {
    return d->verdict == static_cast<uint8_t>(Verdict::WouldMove);
  });
}

trace::Reason ReadRound::reason() const {
  return read != nullptr ? static_cast<trace::Reason>(read->reason) : trace::Reason::None;
}

bool CommRounds::any_read() const {
  return std::any_of(ranks.begin(), ranks.end(),
                     [](const RankRounds& r) { return !r.rounds.empty(); });
}

std::vector<CommRounds> rounds_of(const std::vector<trace::Trace>& traces) {
  std::map<uint64_t, std::map<int32_t, Collected>> by_comm;
  for (const trace::Trace& t : traces) {
    // Ranks that joined but recorded no round are listed too: their silence is a difference.
    for (const Member& m : members_of(t)) by_comm[m.comm_id][m.rank];
    for (const AgreementRecord& r : t.agreements) {
      by_comm[r.comm_id][r.rank].agreements.push_back(&r);
    }
    for (const DecisionRecord& d : t.decisions) {
      by_comm[d.comm_id][d.rank].decisions.push_back(&d);
    }
  }
  std::vector<CommRounds> comms;
  comms.reserve(by_comm.size());
  for (const auto& [comm_id, ranks] : by_comm) {
    CommRounds& comm = comms.emplace_back();
    comm.comm_id = comm_id;
    for (const auto& [rank, collected] : ranks) {
      comm.any_agreement =
          comm.any_agreement || !collected.agreements.empty() || !collected.decisions.empty();
      RankRounds& r = comm.ranks.emplace_back(RankRounds{rank, read_rounds(collected)});
      for (const AgreementRecord* a : collected.agreements)
        if (a->kind == static_cast<uint8_t>(RoundKind::Hello) && is(*a, RoundEvent::Read) &&
            a->reason != 0)
          r.hello_refused = a;
    }
  }
  return comms;
}

std::string ranks_text(std::span<const int32_t> ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  }
  return text;
}

std::vector<std::string> verdict_disagreements(uint64_t comm_id, std::span<const RankRound> ranks) {
  struct Held {
    std::vector<std::pair<int32_t, uint8_t>> verdicts;  // (rank, verdict), in rank order
    size_t ordinal = 0;  // the gather's index on the first rank that holds it
    uint32_t round = 0;
  };
  std::map<uint32_t, Held> by_position;
  std::vector<int32_t> compared;
  for (const RankRound& r : ranks) {
    if (r.round == nullptr) continue;
    compared.push_back(r.rank);
    for (size_t i = 0; i < r.round->decisions.size(); ++i) {
      const DecisionRecord& d = *r.round->decisions[i];
      auto [it, inserted] = by_position.try_emplace(d.position);
      if (inserted) {
        it->second.ordinal = i;
        it->second.round = d.round;
      }
      it->second.verdicts.emplace_back(r.rank, d.verdict);
    }
  }

  std::vector<std::string> lines;
  for (const auto& [position, held] : by_position) {
    // Ranks grouped by what they decided, in the order of their lowest rank.
    std::vector<std::pair<std::string, std::vector<int32_t>>> groups;
    bool some_leave_nccl = false;
    for (const auto& [rank, verdict] : held.verdicts) {
      some_leave_nccl = some_leave_nccl || verdict != static_cast<uint8_t>(Verdict::Stays);
      const std::string name(trace::verdict_name(static_cast<Verdict>(verdict)));
      const auto it = std::find_if(groups.begin(), groups.end(),
                                   [&](const auto& g) { return g.first == name; });
      if (it == groups.end()) {
        groups.push_back({name, {rank}});
      } else {
        it->second.push_back(rank);
      }
    }
    std::vector<int32_t> without;
    for (int32_t rank : compared) {
      const bool holds = std::any_of(held.verdicts.begin(), held.verdicts.end(),
                                     [&](const auto& v) { return v.first == rank; });
      if (!holds) without.push_back(rank);
    }
    if (groups.size() < 2 && (without.empty() || !some_leave_nccl)) continue;
    std::string line = "ranks disagree on comm " + short_id_text(comm_id) + " gather #" +
                       std::to_string(held.ordinal) + " (round " + std::to_string(held.round) +
                       ", pos " + std::to_string(position) + "): ";
    for (size_t i = 0; i < groups.size(); ++i) {
      line += (i == 0 ? "" : "; ") + groups[i].first + " on " + ranks_text(groups[i].second);
    }
    if (!without.empty()) line += "; no gather there on " + ranks_text(without);
    lines.push_back(std::move(line));
  }
  return lines;
}

}  // namespace magi::tool
