// magice-trace decisions: what the agreement rounds of each communicator decided, gather by
// gather and rank by rank, and whether the ranks decided alike. They must: a gather that leaves
// NCCL on one rank and stays on another hangs the job or corrupts its data, so any difference
// is reported and exits 1.
#include <algorithm>
#include <cinttypes>
#include <climits>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "base/sizes.h"
#include "tools/magice-trace/cli.h"
#include "tools/magice-trace/describe.h"
#include "tools/magice-trace/json_writer.h"
#include "tools/magice-trace/members.h"
#include "tools/magice-trace/rounds.h"
#include "tools/magice-trace/symbols.h"
#include "tools/magice-trace/verbs.h"

namespace magi::tool {
namespace {

using trace::AgreementRecord;
using trace::DecisionRecord;

constexpr std::string_view kUsage =
    "usage: magice-trace decisions [--all] [--json] FILE...\n"
    "  For each communicator and rank (from all files): the last agreement round it read, with\n"
    "  its mode and how many gathers move, and the route changes after it; then one line per\n"
    "  gather and rank, by position in the step: moved, would move (MAGI_DRY_RUN), or stays and\n"
    "  why. Checks that the ranks of each communicator read the same round and decided the same\n"
    "  verdict for every gather. Last, per communicator and rank, what it got: its all-gathers\n"
    "  (and bytes) served off NCCL, those that fell back to NCCL, and the first moved, as\n"
    "  collective #N like the library's line (call #N, its seq, where the file misses earlier\n"
    "  calls). A communicator kept on NCCL by its first collective's settings check (settings\n"
    "  that differ between ranks) says so, per rank.\n"
    "  --all   every round read, not only the last\n"
    "  --json  the same as JSON on stdout\n"
    "  Exit status: 0 the ranks agree, 1 they do not (\"ranks disagree on comm ...\"), 2 bad\n"
    "  usage or unreadable input.\n";

// What is printed together: one communicator (one of its rounds, under --all), every rank.
struct Block {
  const CommRounds* comm = nullptr;
  std::optional<uint32_t> round;  // --all: the round shown; else each rank's last
  std::vector<RankRound> ranks;
  std::vector<std::string> disagreements;
};

std::string round_text(const ReadRound* round) {
  return round == nullptr ? "none" : std::to_string(round->round);
}

// Ranks grouped by the round they show; disagreement when there is more than one group, and
// within each group wherever the verdicts differ.
void compare(Block& block) {
  std::map<std::optional<uint32_t>, std::vector<RankRound>> by_round;
  for (const RankRound& r : block.ranks) {
    by_round[r.round ? std::optional(r.round->round) : std::nullopt].push_back(r);
  }
  const std::string comm = short_id_text(block.comm->comm_id);
  if (by_round.size() > 1) {
    std::string line = "ranks disagree on comm " + comm;
    if (block.round) {
      line += " round " + std::to_string(*block.round) + ": ";
    } else {
      line += ": last round read is ";
    }
    // Rounds read first, highest first; ranks that read none (or not this one) last.
    bool first = true;
    for (auto it = by_round.rbegin(); it != by_round.rend(); ++it) {
      std::vector<int32_t> ranks;
      for (const RankRound& r : it->second) ranks.push_back(r.rank);
      line += first ? "" : "; ";
      first = false;
      if (block.round) {
        line += (it->first ? "read on " : "not on ") + ranks_text(ranks);
      } else {
        line += round_text(it->second.front().round) + " on " + ranks_text(ranks);
      }
    }
    block.disagreements.push_back(line);
  }
  for (const auto& [number, ranks] : by_round) {
    if (!number) continue;
    for (std::string& line : verdict_disagreements(block.comm->comm_id, ranks)) {
      block.disagreements.push_back(std::move(line));
    }
  }
}

std::vector<Block> blocks_of(const CommRounds& comm, bool all) {
  std::vector<Block> blocks;
  if (!all) {
    Block& block = blocks.emplace_back();
    block.comm = &comm;
    for (const RankRounds& r : comm.ranks) {
      block.ranks.push_back({r.rank, r.rounds.empty() ? nullptr : &r.rounds.back()});
    }
    compare(block);
    return blocks;
  }
  std::set<uint32_t> numbers;
  for (const RankRounds& r : comm.ranks) {
    for (const ReadRound& round : r.rounds) numbers.insert(round.round);
  }
  for (uint32_t number : numbers) {
    Block& block = blocks.emplace_back();
    block.comm = &comm;
    block.round = number;
    for (const RankRounds& r : comm.ranks) {
      const auto it = std::find_if(r.rounds.begin(), r.rounds.end(),
                                   [&](const ReadRound& round) { return round.round == number; });
      block.ranks.push_back({r.rank, it == r.rounds.end() ? nullptr : &*it});
    }
    compare(block);
  }
  return blocks;
}

std::string gathers_text(uint32_t moved, uint32_t gathers, bool dry_run) {
  return std::to_string(moved) + " of " + std::to_string(gathers) + " gathers " +
         (dry_run ? "would move" : "move");
}

// "round 2 propose: mode slot, 3 of 8 gathers move"
std::string round_summary(const ReadRound& round) {
  std::string text = "round " + std::to_string(round.round) + " propose: mode " +
                     std::string(trace::mode_name(round.mode())) + ", " +
                     gathers_text(round.moved(), round.gathers(), round.dry_run());
  if (round.reason() != trace::Reason::None) {
    text += " (" + std::string(trace::reason_name(round.reason())) + ")";
  }
  if (round.read == nullptr) text += " (from its decisions: the round's read record is missing)";
  return text;
}

std::string gathers_count_text(uint32_t n) {
  return std::to_string(n) + (n == 1 ? " gather" : " gathers");
}

// What the cost round decided, from its read (`moved`: the gathers that keep leaving NCCL) and
// the routes it ended (`before`: the last activation of the round, whose gathers were timed).
// "timed both ways: 1 gather back to NCCL (NCCL was faster for its bucket), 3 keep leaving it"
std::string cost_read_text(const AgreementRecord& read, const AgreementRecord* before) {
  const auto reason = static_cast<trace::Reason>(read.reason);
  if (reason == trace::Reason::AnchorInGroup)
    return "not timed (the cost round was issued inside an open group on some rank): the plan "
           "stands, " +
           gathers_count_text(read.moved) + " keep leaving NCCL";
  if (before == nullptr || before->moved < read.moved)
    return "timed both ways: " + std::to_string(read.moved) + " of " +
           std::to_string(read.gathers) + " gathers keep leaving NCCL, the other buckets were " +
           "faster on NCCL";
  const uint32_t back = before->moved - read.moved;
  std::string text = "timed both ways: ";
  text += back == before->moved && back > 1 ? "all " : "";
  text += gathers_count_text(back) + " back to NCCL (NCCL was faster for " +
          (back == 1 ? "its bucket)" : "their buckets)");
  if (read.moved != 0) text += ", " + std::to_string(read.moved) + " keep leaving it";
  return text;
}

// One line per route change of a round, each saying what holds from that collective on:
// "round 2 activated at collective #57: 3 of 8 gathers leave NCCL",
// "round 2 cost read at collective #70: timed both ways: 1 gather back to NCCL (NCCL was
//  faster for its bucket), 3 keep leaving it",
// "round 2 cost activated at collective #70: 3 of 4 gathers leave NCCL, 1 back on NCCL",
// "round 2 deactivated at collective #90: back to NCCL (the call deviated from the agreed step)",
// "round 2 publish read at collective #61: nothing leaves NCCL (the transport failed on some rank)"
// `before`: the round's last activation before this change, or null.
std::string route_change_text(const AgreementRecord& change, const AgreementRecord* before) {
  const auto event = static_cast<trace::RoundEvent>(change.event);
  const auto kind = static_cast<trace::RoundKind>(change.kind);
  const auto reason = static_cast<trace::Reason>(change.reason);
  std::string text = "round " + std::to_string(change.round) + " ";
  const bool cost = kind == trace::RoundKind::Cost;
  if (event == trace::RoundEvent::Read || (event == trace::RoundEvent::Activated && cost)) {
    text += std::string(trace::round_kind_name(kind)) + " ";
  }
  text += std::string(trace::round_event_name(event)) + " at collective #" +
          std::to_string(change.seq) + ": ";
  if (event == trace::RoundEvent::Read && cost) return text + cost_read_text(change, before);
  if (event == trace::RoundEvent::Activated) {
    const bool dry_run = kind == trace::RoundKind::Propose;
    text += std::to_string(change.moved) + " of " + std::to_string(change.gathers) +
            (dry_run ? " gathers would leave NCCL (MAGI_DRY_RUN: nothing moves)"
                     : " gathers leave NCCL");
    if (cost && before != nullptr && before->moved > change.moved)
      text += ", " + std::to_string(before->moved - change.moved) + " back on NCCL";
    return text;
  }
  if (event == trace::RoundEvent::Read) {
    text += reason == trace::Reason::SettingUp ? "nothing leaves NCCL yet" : "nothing leaves NCCL";
  } else {
    text += "back to NCCL";
  }
  if (reason != trace::Reason::None) text += " (" + std::string(trace::reason_name(reason)) + ")";
  return text;
}

// "moved", "would move", "stays: another rank refused it (rank 0)"
std::string verdict_text(const DecisionRecord& d) {
  const auto verdict = static_cast<trace::Verdict>(d.verdict);
  std::string text(trace::verdict_name(verdict));
  if (verdict != trace::Verdict::Stays) {
    if (d.machines > 1)
      text += " in two levels (NCCL between " + std::to_string(d.machines) +
              " machines on the sub-communicator of local index " + std::to_string(d.sub_comm) +
              ", the transport inside)";
    return text;
  }
  const auto reason = static_cast<trace::Reason>(d.reason);
  if (reason != trace::Reason::None) text += ": " + std::string(trace::reason_name(reason));
  if (d.refused_by >= 0) text += " (rank " + std::to_string(d.refused_by) + ")";
  return text;
}

// The decisions of a block by position, then rank, each with its index among its rank's gathers.
struct Row {
  uint32_t position;
  int32_t rank;
  size_t ordinal;
  const DecisionRecord* decision;
};
std::vector<Row> rows_of(const Block& block) {
  std::vector<Row> rows;
  for (const RankRound& r : block.ranks) {
    if (r.round == nullptr) continue;
    for (size_t i = 0; i < r.round->decisions.size(); ++i) {
      rows.push_back({r.round->decisions[i]->position, r.rank, i, r.round->decisions[i]});
    }
  }
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    return std::tie(a.position, a.rank) < std::tie(b.position, b.rank);
  });
  return rows;
}

// The Python call sites of a trace's all-gathers (MAGI_PY_CALLSITES=1), by what a decision
// names of its gather: in a Python program every gather has the same native call site (frames
// in libtorch), and only the Python line tells them apart.
class PythonSites {
 public:
  explicit PythonSites(const trace::Trace& t) : trace_(t) {
    if (t.py_calls.empty()) return;
    std::map<uint64_t, const trace::StepRecord*> steps;  // each communicator's last step found
    for (const trace::StepRecord& s : t.steps)
      if (s.event == static_cast<uint8_t>(trace::StepEvent::Found) && s.period != 0)
        steps[s.comm_id] = &s;
    std::vector<const trace::CallRecord*> calls;
    for (const trace::CallRecord& c : t.calls) calls.push_back(&c);
    std::sort(calls.begin(), calls.end(), [](auto* a, auto* b) {
      return std::tie(a->comm_id, a->rank, a->seq) < std::tie(b->comm_id, b->rank, b->seq);
    });
    std::map<std::pair<uint64_t, int32_t>, uint64_t> collectives;
    for (const trace::CallRecord* c : calls) {
      if (!trace::is_collective(static_cast<trace::Op>(c->op))) continue;
      const uint64_t index = collectives[{c->comm_id, c->rank}]++;
      if (c->op != static_cast<uint8_t>(trace::Op::AllGather)) continue;
      const auto python = t.py_calls.find({c->comm_id, c->seq, c->rank});
      const uint64_t site = python != t.py_calls.end() ? python->second : 0;
      const auto step = steps.find(c->comm_id);
      uint32_t position = kAnyPosition;
      if (step != steps.end() && index >= step->second->origin)
        position = static_cast<uint32_t>((index - step->second->origin) % step->second->period);
      Key key{c->comm_id, c->callsite, c->count, c->rank, c->dtype, position};
      sites_[key].insert(site);
      std::get<5>(key) = kAnyPosition;
      sites_[key].insert(site);
    }
  }

  // The gather's Python line, or "" when its gathers had none or did not all have the same.
  std::string line(const DecisionRecord& d) const {
    Key key{d.comm_id, d.callsite, d.count, d.rank, d.dtype, d.position};
    auto found = sites_.find(key);
    if (found == sites_.end()) {
      std::get<5>(key) = kAnyPosition;
      found = sites_.find(key);
    }
    if (found == sites_.end() || found->second.size() != 1) return "";
    const auto frames = trace_.py_callsites.find(*found->second.begin());
    if (frames == trace_.py_callsites.end() || frames->second.empty()) return "";
    return python_frame_line(frames->second.front());
  }

 private:
  static constexpr uint32_t kAnyPosition = UINT32_MAX;
  using Key = std::tuple<uint64_t, uint64_t, uint64_t, int32_t, uint8_t, uint32_t>;
  const trace::Trace& trace_;
  std::map<Key, std::set<uint64_t>> sites_;
};

// The gather's call site as a line ("  at model.py:42 in forward" when the trace has its
// Python line, else "  at function (file.cc:12)"), from the trace holding it.
std::string callsite_text(const std::vector<trace::Trace>& traces, const DecisionRecord& d) {
  static std::map<const trace::Trace*, PythonSites> python;  // one run reads its files once
  for (const trace::Trace& t : traces) {
    const DecisionRecord* first = t.decisions.data();
    if (&d < first || &d >= first + t.decisions.size()) continue;
    const std::string line = python.try_emplace(&t, t).first->second.line(d);
    if (!line.empty()) return "  at " + line;
    const std::string frame = top_frame_text(t, d.callsite);
    return frame.empty() ? "" : "  at " + frame;
  }
  return "";
}

void print_block(const std::vector<trace::Trace>& traces, const Block& block) {
  const std::string comm = short_id_text(block.comm->comm_id);
  for (const RankRound& r : block.ranks) {
    const std::string who = "comm " + comm + " rank " + std::to_string(r.rank) + ": ";
    if (r.round == nullptr) {
      std::printf("%s%s\n", who.c_str(),
                  block.round ? ("round " + std::to_string(*block.round) + " not read").c_str()
                              : "no agreement round read");
      continue;
    }
    std::printf("%s%s\n", who.c_str(), round_summary(*r.round).c_str());
    const AgreementRecord* activation = nullptr;  // the routes in force before each change
    for (const AgreementRecord* change : r.round->route_changes) {
      std::printf("%s%s\n", who.c_str(), route_change_text(*change, activation).c_str());
      if (change->event == static_cast<uint8_t>(trace::RoundEvent::Activated)) activation = change;
      if (change->event == static_cast<uint8_t>(trace::RoundEvent::Deactivated))
        activation = nullptr;
    }
  }
  for (const Row& row : rows_of(block)) {
    const DecisionRecord& d = *row.decision;
    std::printf(
        "comm %s rank %d gather #%zu (pos %u, %s x %" PRIu64 ", bucket %u): %s%s\n", comm.c_str(),
        row.rank, row.ordinal, d.position, std::string(trace::dtype_name(d.dtype)).c_str(), d.count,
        static_cast<unsigned>(d.bucket), verdict_text(d).c_str(), callsite_text(traces, d).c_str());
  }
  for (const std::string& line : block.disagreements) std::printf("%s\n", line.c_str());
}

// What each rank of a communicator got: its all-gathers, those the transport served (moved),
// and those routed to it whose bucket fell back to NCCL, from the call records.
struct Coverage {
  uint64_t gathers = 0, bytes = 0, moved = 0, moved_bytes = 0, fell_back = 0;
  // The first moved call, by its collective index as the library's line names it; by its seq
  // ("call #N") where the file misses earlier calls and so that index.
  const trace::CallRecord* first_moved = nullptr;
  std::optional<uint64_t> first_moved_collective;
};
using CoverageMap = std::map<std::pair<uint64_t, int32_t>, Coverage>;  // (comm, rank)

CoverageMap coverage_of(const std::vector<trace::Trace>& traces) {
  CoverageMap out;
  for (const trace::Trace& t : traces) {
    for (const Member& m : members_of(t)) {
      for (size_t i = 0; i < m.collectives.size(); ++i) {
        const trace::CallRecord& call = *m.collectives[i];
        if (call.op != static_cast<uint8_t>(trace::Op::AllGather)) continue;
        Coverage& c = out[{call.comm_id, call.rank}];
        const uint64_t bytes = call.count * datatype_bytes(call.dtype);
        ++c.gathers;
        c.bytes += bytes;
        if (call.flags & trace::kCallMoved) {
          ++c.moved;
          c.moved_bytes += bytes;
          if (c.first_moved == nullptr) {
            c.first_moved = &call;
            if (i < m.numbered) c.first_moved_collective = i;
          }
        }
        if (call.flags & trace::kCallFellBack) ++c.fell_back;
      }
    }
  }
  return out;
}

// Where the communicator agreed on anything or moved anything (else "no agreement rounds" said
// it all).
void print_coverage(uint64_t comm_id, const CoverageMap& coverage, bool agreed) {
  bool any = agreed;
  for (auto it = coverage.lower_bound({comm_id, INT32_MIN});
       it != coverage.end() && it->first.first == comm_id; ++it)
    any = any || it->second.moved != 0 || it->second.fell_back != 0;
  if (!any) return;
  for (auto it = coverage.lower_bound({comm_id, INT32_MIN});
       it != coverage.end() && it->first.first == comm_id; ++it) {
    const Coverage& c = it->second;
    std::string first;
    if (c.first_moved_collective)
      first = "; the first at collective #" + std::to_string(*c.first_moved_collective);
    else if (c.first_moved != nullptr)
      first = "; the first at call #" + std::to_string(c.first_moved->seq);
    std::printf("comm %s rank %d: %" PRIu64 " of %" PRIu64 " all-gathers (%" PRIu64 " of %" PRIu64
                " bytes sent) served off NCCL, %" PRIu64 " fell back to NCCL%s\n",
                short_id_text(comm_id).c_str(), it->first.second, c.moved, c.gathers, c.moved_bytes,
                c.bytes, c.fell_back, first.c_str());
  }
}

void print_text(const std::vector<trace::Trace>& traces, const std::vector<CommRounds>& comms,
                const std::vector<std::vector<Block>>& blocks, const CoverageMap& coverage) {
  if (comms.empty()) std::printf("no communicators in these traces\n");
  for (size_t c = 0; c < comms.size(); ++c) {
    if (!comms[c].any_read()) {
      std::printf("comm %s: no agreement rounds%s\n", short_id_text(comms[c].comm_id).c_str(),
                  comms[c].any_agreement ? " read" : "");
    } else {
      for (const Block& block : blocks[c]) print_block(traces, block);
    }
    for (const RankRounds& r : comms[c].ranks)
      if (r.hello_refused != nullptr)
        std::printf("comm %s rank %d: %s\n", short_id_text(comms[c].comm_id).c_str(), r.rank,
                    route_change_text(*r.hello_refused, nullptr).c_str());
    print_coverage(comms[c].comm_id, coverage, comms[c].any_read());
  }
}

// ---- --json ----

std::string json_reason(uint8_t reason) {
  return reason == 0 ? "null" : json_string(trace::reason_name(static_cast<trace::Reason>(reason)));
}

void append_round(std::string& out, int32_t rank, const ReadRound& round) {
  out += "{\"rank\":" + std::to_string(rank) + ",\"round\":" + std::to_string(round.round) +
         ",\"mode\":" + json_string(trace::mode_name(round.mode())) +
         ",\"gathers\":" + std::to_string(round.gathers()) +
         ",\"moved\":" + std::to_string(round.moved()) +
         ",\"dry_run\":" + (round.dry_run() ? "true" : "false") +
         ",\"reason\":" + json_reason(static_cast<uint8_t>(round.reason())) +
         ",\"read_record\":" + (round.read != nullptr ? "true" : "false") + ",\"route_changes\":[";
  for (size_t i = 0; i < round.route_changes.size(); ++i) {
    const AgreementRecord& c = *round.route_changes[i];
    out += (i == 0 ? "" : ",");
    out +=
        "{\"round\":" + std::to_string(c.round) +
        ",\"kind\":" + json_string(trace::round_kind_name(static_cast<trace::RoundKind>(c.kind))) +
        ",\"event\":" +
        json_string(trace::round_event_name(static_cast<trace::RoundEvent>(c.event))) +
        ",\"collective\":" + std::to_string(c.seq) + ",\"moved\":" + std::to_string(c.moved) +
        ",\"gathers\":" + std::to_string(c.gathers) + ",\"reason\":" + json_reason(c.reason) + "}";
  }
  out += "],\"decisions\":[";
  for (size_t i = 0; i < round.decisions.size(); ++i) {
    const DecisionRecord& d = *round.decisions[i];
    out += (i == 0 ? "" : ",");
    out += "{\"gather\":" + std::to_string(i) + ",\"position\":" + std::to_string(d.position) +
           ",\"dtype\":" + json_string(trace::dtype_name(d.dtype)) +
           ",\"count\":" + std::to_string(d.count) + ",\"bucket\":" + std::to_string(d.bucket) +
           ",\"callsite\":" + json_string(hex16(d.callsite)) + ",\"verdict\":" +
           json_string(trace::verdict_name(static_cast<trace::Verdict>(d.verdict))) +
           ",\"reason\":" + json_reason(d.reason) +
           ",\"refused_by\":" + (d.refused_by < 0 ? "null" : std::to_string(d.refused_by)) +
           (d.machines > 1 ? ",\"machines\":" + std::to_string(d.machines) +
                                 ",\"sub_comm\":" + std::to_string(d.sub_comm)
                           : std::string()) +
           "}";
  }
  out += "]}";
}

void print_json(const std::vector<CommRounds>& comms, const std::vector<std::vector<Block>>& blocks,
                bool agree) {
  std::string out = "{\"communicators\":[";
  for (size_t c = 0; c < comms.size(); ++c) {
    out += (c == 0 ? "\n" : ",\n");
    out += "{\"comm\":" + json_string(short_id_text(comms[c].comm_id)) + ",\"rounds\":[";
    std::vector<std::string> disagreements;
    bool first = true;
    for (const Block& block : blocks[c]) {
      for (const RankRound& r : block.ranks) {
        if (r.round == nullptr) continue;
        out += first ? "" : ",";
        first = false;
        append_round(out, r.rank, *r.round);
      }
      disagreements.insert(disagreements.end(), block.disagreements.begin(),
                           block.disagreements.end());
    }
    out += "],\"hello_refused\":[";
    first = true;
    for (const RankRounds& r : comms[c].ranks) {
      if (r.hello_refused == nullptr) continue;
      out += first ? "" : ",";
      first = false;
      out += "{\"rank\":" + std::to_string(r.rank) +
             ",\"collective\":" + std::to_string(r.hello_refused->seq) +
             ",\"reason\":" + json_reason(r.hello_refused->reason) + "}";
    }
    out += "],\"disagreements\":[";
    for (size_t i = 0; i < disagreements.size(); ++i) {
      out += (i == 0 ? "" : ",") + json_string(disagreements[i]);
    }
    out += "]}";
  }
  out += std::string("\n],\"agree\":") + (agree ? "true" : "false") + "}\n";
  JsonOutput json("-");
  json.write(out);
  json.close();
}

}  // namespace

int decisions_main(std::span<const std::string> args) {
  return run_verb(kUsage, args, [&] {
    bool all = false, json = false;
    std::vector<std::string> files;
    ArgCursor cursor(args);
    while (!cursor.done()) {
      if (cursor.flag("--all")) {
        all = true;
      } else if (cursor.flag("--json")) {
        json = true;
      } else {
        cursor.operand(files);
      }
    }
    if (files.empty()) throw UsageError("decisions needs the trace files of the ranks");
    const std::vector<trace::Trace> traces = load_traces(files);
    const std::vector<CommRounds> comms = rounds_of(traces);
    std::vector<std::vector<Block>> blocks;
    bool agree = true;
    for (const CommRounds& comm : comms) {
      blocks.push_back(comm.any_read() ? blocks_of(comm, all) : std::vector<Block>{});
      for (const Block& block : blocks.back()) agree = agree && block.disagreements.empty();
    }
    if (json) {
      print_json(comms, blocks, agree);
    } else {
      print_text(traces, comms, blocks, coverage_of(traces));
    }
    return agree ? 0 : 1;
  });
}

}  // namespace magi::tool
