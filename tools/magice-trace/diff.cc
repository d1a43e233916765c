// magice-trace diff: lines up the collectives of every rank of each communicator and names the
// first place they part. Ranks that issue different collectives (or the same ones in a different
// order) hang or corrupt data in NCCL; this finds where, from the traces alone.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "tools/magice-trace/cli.h"
#include "tools/magice-trace/describe.h"
#include "tools/magice-trace/members.h"
#include "tools/magice-trace/symbols.h"
#include "tools/magice-trace/verbs.h"

namespace magi::tool {
namespace {

constexpr std::string_view kUsage =
    "usage: magice-trace diff [--shapes-only] FILE...\n"
    "  Compares the collectives of each communicator across the files (one per rank), by\n"
    "  collective index, collective #N as the logs number them (Send/Recv left out: they differ\n"
    "  between ranks by design). Reports per communicator whether the ranks agree, and shows\n"
    "  the calls around the first difference, each as #N and call #N (its seq, Send/Recv\n"
    "  counted).\n"
    "  A communicator whose ranks are not all among the files is reported as a difference.\n"
    "  --shapes-only  compare op, datatype, count, root and reduction only, not call sites\n"
    "  Exit status: 0 identical, 1 differences found, 2 bad usage or unreadable input.\n";

constexpr uint64_t kNone = UINT64_MAX;
constexpr uint64_t kContext = 3;  // calls shown on each side of a divergence

struct RankView {
  const trace::Trace* trace;
  const Member* member;
};

struct Comparison {
  uint64_t shapes_diverge = kNone;    // first index with different shapes or a missing call
  uint64_t callsites_differ = kNone;  // first index with equal shapes but different call sites
  uint64_t first() const { return std::min(shapes_diverge, callsites_differ); }
};

// Call sites of 0 (MAGI_CALLSITES=0 on that rank) are unknown and never count as different.
Comparison compare(const std::vector<RankView>& ranks, bool shapes_only) {
  Comparison result;
  size_t shortest = SIZE_MAX, longest = 0;
  for (const RankView& r : ranks) {
    shortest = std::min(shortest, r.member->collectives.size());
    longest = std::max(longest, r.member->collectives.size());
  }
  const auto& reference = ranks.front().member->collectives;
  for (uint64_t i = 0; i < shortest; ++i) {
    for (size_t k = 1; k < ranks.size(); ++k) {
      const trace::CallRecord& call = *ranks[k].member->collectives[i];
      if (call.shape != reference[i]->shape) {
        result.shapes_diverge = i;
        return result;
      }
      if (!shapes_only && result.callsites_differ == kNone && call.callsite != 0 &&
          reference[i]->callsite != 0 && call.callsite != reference[i]->callsite) {
        result.callsites_differ = i;
      }
    }
  }
  if (shortest != longest) result.shapes_diverge = shortest;
  return result;
}

std::string counts_text(const std::vector<RankView>& ranks) {
  bool equal = true;
  for (const RankView& r : ranks) {
    equal = equal && r.member->collectives.size() == ranks.front().member->collectives.size();
  }
  if (equal) {
    const size_t n = ranks.front().member->collectives.size();
    return std::to_string(n) + (n == 1 ? " collective" : " collectives") +
           (ranks.size() > 1 ? " each" : "");
  }
  std::string text;
  for (const RankView& r : ranks) {
    text += (text.empty() ? "" : "/") + std::to_string(r.member->collectives.size());
  }
  return text + " collectives";
}

// What the ranks are compared on at one index; a rank without a call there has none.
std::optional<uint64_t> compared_value(const RankView& r, uint64_t at, bool by_callsite) {
  const auto& calls = r.member->collectives;
  if (at >= calls.size()) return std::nullopt;
  return by_callsite ? calls[at]->callsite : calls[at]->shape;
}

// The value most ranks hold at `at`, when more than half agree: the others are the odd ones out.
std::optional<uint64_t> majority_value(const std::vector<RankView>& ranks, uint64_t at,
                                       bool by_callsite) {
  std::map<std::optional<uint64_t>, size_t> votes;
  for (const RankView& r : ranks) ++votes[compared_value(r, at, by_callsite)];
  for (const auto& [value, count] : votes) {
    if (value && 2 * count > ranks.size()) return value;
  }
  return std::nullopt;
}

// The context rows of one rank as printed (seq, shape, call site), to group ranks that look alike.
using ContextKey = std::vector<std::optional<std::tuple<uint64_t, uint64_t, uint64_t>>>;
ContextKey context_key(const RankView& r, uint64_t from, uint64_t to) {
  ContextKey key;
  const auto& calls = r.member->collectives;
  for (uint64_t i = from; i <= to; ++i) {
    if (i < calls.size()) {
      key.emplace_back(std::tuple(calls[i]->seq, calls[i]->shape, calls[i]->callsite));
    } else {
      key.emplace_back(std::nullopt);
    }
  }
  return key;
}

// One block per group of ranks whose calls around the divergence are alike, so a job of many
// ranks shows the odd ones out without repeating the agreeing ones.
void print_context(const std::vector<RankView>& ranks, uint64_t at, bool by_callsite) {
  const uint64_t from = at >= kContext ? at - kContext : 0;
  const std::optional<uint64_t> majority = majority_value(ranks, at, by_callsite);
  std::vector<std::vector<const RankView*>> groups;
  std::map<ContextKey, size_t> group_of;
  for (const RankView& r : ranks) {
    const auto [it, inserted] =
        group_of.try_emplace(context_key(r, from, at + kContext), groups.size());
    if (inserted) groups.emplace_back();
    groups[it->second].push_back(&r);
  }
  for (const std::vector<const RankView*>& group : groups) {
    const RankView& r = *group.front();
    if (group.size() == 1) {
      const std::string rank = r.member->rank < 0 ? "?" : std::to_string(r.member->rank);
      std::printf("  rank %s (%s)\n", rank.c_str(), r.trace->path.c_str());
    } else {
      std::string names;
      for (const RankView* member : group) {
        names += (names.empty() ? "" : ", ") +
                 (member->member->rank < 0 ? "?" : std::to_string(member->member->rank));
      }
      std::printf("  ranks %s\n", names.c_str());
    }
    const auto& calls = r.member->collectives;
    const bool odd_one = majority && compared_value(r, at, by_callsite) != majority;
    for (uint64_t i = from; i <= at + kContext; ++i) {
      if (i >= calls.size()) {  // only ever at or after the divergence: it is the shortest length
        if (i == at) {
          std::printf("  > #%-6" PRIu64 " (no call)%s\n", i, odd_one ? "  <-- differs" : "");
        }
        break;
      }
      const trace::CallRecord& call = *calls[i];
      const std::string frame = call_site_line(*r.trace, call);
      std::printf("  %c #%-6" PRIu64 " call #%-6" PRIu64 " %s callsite %-8s%s%s%s\n",
                  i == at ? '>' : ' ', i, call.seq, shape_text(call).c_str(),
                  callsite_label(call.callsite).c_str(), frame.empty() ? "" : "  ", frame.c_str(),
                  i == at && odd_one ? "  <-- differs" : "");
    }
  }
}

// The ranks below `nranks` that no file holds: the first few by number, then how many more.
std::string missing_ranks_text(const std::vector<RankView>& ranks, int32_t nranks,
                               size_t* missing_count) {
  std::set<int32_t> present;
  for (const RankView& r : ranks) {
    if (r.member->rank >= 0 && r.member->rank < nranks) present.insert(r.member->rank);
  }
  *missing_count = static_cast<size_t>(nranks) - present.size();
  constexpr size_t kNamed = 8;
  std::string text;
  size_t named = 0;
  for (int32_t rank = 0; rank < nranks && named < std::min(kNamed, *missing_count); ++rank) {
    if (present.contains(rank)) continue;
    text += (named++ == 0 ? "" : ", ") + std::to_string(rank);
  }
  if (*missing_count > named) text += " and " + std::to_string(*missing_count - named) + " more";
  return text;
}

// Returns true when the communicator's ranks differ in any way.
bool diff_communicator(uint64_t comm_id, std::vector<RankView> ranks, size_t files,
                       bool shapes_only) {
  std::stable_sort(ranks.begin(), ranks.end(), [](const RankView& a, const RankView& b) {
    return a.member->rank < b.member->rank;
  });
  std::string line = "comm " + short_id_text(comm_id) + ": ";
  bool differs = false;

  // Ranks that never joined: a communicator its other ranks created is one they will wait on.
  int32_t nranks = -1;
  for (const RankView& r : ranks) nranks = std::max(nranks, r.member->nranks);
  size_t missing = 0;
  const std::string missing_text = nranks > 0 ? missing_ranks_text(ranks, nranks, &missing) : "";
  if (nranks < 0 && ranks.size() < files) {
    line += "in " + std::to_string(ranks.size()) + " of " + std::to_string(files) +
            " files (its size is unknown), ";
  } else if (missing != 0) {
    line += std::to_string(ranks.size()) + " of " + std::to_string(nranks) +
            " ranks (no file has rank " + missing_text + "), ";
    differs = true;
  } else {
    line += std::to_string(ranks.size()) + (ranks.size() == 1 ? " rank, " : " ranks, ");
  }
  line += counts_text(ranks);

  const Comparison c = compare(ranks, shapes_only);
  if (c.callsites_differ < c.shapes_diverge) {
    line += ", call sites differ from collective #" + std::to_string(c.callsites_differ);
    if (c.shapes_diverge != kNone) {
      line += ", diverges at collective #" + std::to_string(c.shapes_diverge);
    }
  } else if (c.shapes_diverge != kNone) {
    line += ", diverges at collective #" + std::to_string(c.shapes_diverge);
  } else if (!differs) {
    line += ", identical";
  }
  std::printf("%s\n", line.c_str());
  if (c.first() != kNone) print_context(ranks, c.first(), c.first() == c.callsites_differ);
  return differs || c.first() != kNone;
}

}  // namespace

int diff_main(std::span<const std::string> args) {
  return run_verb(kUsage, args, [&] {
    bool shapes_only = false;
    std::vector<std::string> files;
    ArgCursor cursor(args);
    while (!cursor.done()) {
      if (cursor.flag("--shapes-only")) {
        shapes_only = true;
      } else {
        cursor.operand(files);
      }
    }
    if (files.empty()) throw UsageError("diff needs the trace files of the ranks to compare");
    const std::vector<trace::Trace> traces = load_traces(files);
    std::vector<std::vector<Member>> members;
    members.reserve(traces.size());
    for (const trace::Trace& t : traces) members.push_back(members_of(t));

    // Communicators in the order the first file holding each created it.
    std::vector<uint64_t> order;
    std::unordered_map<uint64_t, std::vector<RankView>> by_comm;
    for (size_t f = 0; f < traces.size(); ++f) {
      for (const Member& m : members[f]) {
        auto [it, inserted] = by_comm.try_emplace(m.comm_id);
        if (inserted) order.push_back(m.comm_id);
        it->second.push_back({&traces[f], &m});
      }
    }
    bool differs = false;
    for (uint64_t comm_id : order) {
      differs = diff_communicator(comm_id, by_comm[comm_id], files.size(), shapes_only) || differs;
    }
    if (order.empty()) std::printf("no communicators in these traces\n");
    return differs ? 1 : 0;
  });
}

}  // namespace magi::tool
