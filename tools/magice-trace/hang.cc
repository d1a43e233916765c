// magice-trace hang: from the flight recorder files of a hung (or killed) job, which rank
// stopped where. Per communicator: how many collectives each rank issued, returned from (and
// completed on the GPU, where the recorder watched completion), the
// ranks behind and their last call, the first collective the ranks issued differently, and the
// ranks with no file. Ordinary traces are read too (their calls all returned: a trace records a
// call when it ends).
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "capture/flight_recorder.h"
#include "capture/trace_reader.h"
#include "tools/magice-trace/cli.h"
#include "tools/magice-trace/describe.h"
#include "tools/magice-trace/json_writer.h"
#include "tools/magice-trace/members.h"
#include "tools/magice-trace/symbols.h"
#include "tools/magice-trace/verbs.h"

namespace magi::tool {
namespace {

constexpr std::string_view kUsage =
    "usage: magice-trace hang [--json] [--no-symbols] FILE...\n"
    "  Reads flight recorder files (MAGI_FLIGHT_RECORDER=N writes magice.<host>.<pid>.flight,\n"
    "  which survive the process being killed) and trace files, one or more per rank, and says\n"
    "  per communicator which ranks are behind and where: how many collectives each rank\n"
    "  issued and returned from, each lagging rank's last call, the first collective the ranks\n"
    "  issued differently (op, datatype, count, root, reduction), the ranks still inside the\n"
    "  communicator's init, and the ranks none of the files holds. A verdict line per\n"
    "  communicator comes first (those with something to say before those without), details\n"
    "  after.\n"
    "  Files written with MAGI_FLIGHT_RECORDER_COMPLETION=1 also say how many collectives each\n"
    "  rank completed on its GPU (and which were not watched, and why: a CUDA graph, ...), and\n"
    "  when every rank issued the same: the rank whose GPU never reached a collective the\n"
    "  others wait in, or that all are inside one on the GPU.\n"
    "  Collectives are numbered from 0 per communicator, as diff numbers them; a recorder keeps\n"
    "  only each communicator's last N calls, so a difference older than that is not seen.\n"
    "  Each call named is followed by its call site: the Python line (MAGI_PY_CALLSITES; 2 for\n"
    "  PyTorch, which calls NCCL without the GIL), else the innermost frames outside libmagice,\n"
    "  NCCL and the C++/CUDA runtime, as function (file:line) when the binary is on this\n"
    "  machine, else module+0xoffset. The verdict names one site; the details list a few\n"
    "  frames. The files describe their own call sites, so a killed process's file is enough:\n"
    "  the all-gathers' with MAGI_CALLSITES=1 (the default), every call's with 2.\n"
    "  --json        one JSON object instead of text\n"
    "  --no-symbols  module+0xoffset frames, without reading the binaries\n"
    "  Exit status: 0 no hang seen, 1 a hang or a difference found, 2 bad usage or unreadable\n"
    "  input.\n";

struct Call {
  uint64_t seq = 0;
  uint64_t collective = 0;  // index + 1; 0 for Send/Recv
  uint64_t count = 0;
  uint64_t callsite = 0;
  uint64_t python = 0;                  // Python call-site fingerprint, 0 when none
  const trace::Trace* sites = nullptr;  // the descriptions of the file that holds the call
  int32_t root = -1;
  int32_t redop = -1;
  int32_t result = 0;
  uint8_t op = 0;
  uint8_t dtype = 0;
  bool returned = false;
  bool reached = false;    // its stream reached it (the ring watched completion)
  bool completed = false;  // its work finished on its stream
  uint8_t unwatched = 0;   // flight::UnwatchedReason when completion was on but not watched
};

struct RankCalls {
  std::string file;
  uint64_t pid = 0;
  std::string host;
  bool ended = false;    // finalized, destroyed, or alive at a normal exit
  bool aborted = false;  // aborted or revoked: what a watchdog does to a hung communicator
  uint8_t join = capture::flight::kJoined;  // a trace records joined communicators only
  uint64_t torn = 0;
  std::vector<Call> calls;                   // by seq
  uint64_t issued = 0;                       // collectives issued (index of the last + 1)
  uint64_t returned = 0;                     // collectives returned from
  std::map<uint64_t, const Call*> by_index;  // collective index -> call

  uint8_t completion = capture::flight::kCompletionOff;  // how reached/completed were filled
  uint64_t completed = 0;                                // collectives completed on the GPU
  uint64_t reached = 0;                                  // collectives their stream reached
  // Collectives after the last completed one whose completion was not watched, by reason.
  std::map<uint8_t, uint64_t> unwatched_after;
};

struct Comm {
  int nranks = 0;
  std::map<int, RankCalls> ranks;
};

void add_flight(const capture::flight::FileView& view, const trace::Trace& sites,
                std::map<uint64_t, Comm>& comms) {
  for (const auto& ring : view.rings) {
    if (ring.header.rank < 0) continue;  // made out of sight: no rank to compare
    Comm& comm = comms[ring.header.comm_id];
    comm.nranks = std::max(comm.nranks, ring.header.nranks);
    RankCalls& r = comm.ranks[ring.header.rank];
    r.file = view.path;
    r.pid = view.header.pid;
    r.host = view.header.host;
    const auto how = static_cast<trace::CommEndKind>(ring.header.ended - 1);
    r.aborted = how == trace::CommEndKind::Abort || how == trace::CommEndKind::Revoke;
    r.ended = ring.header.ended != 0 && !r.aborted;
    r.join = ring.header.joined;
    r.torn += ring.torn;
    r.completion = ring.header.completion;
    for (const auto& rec : ring.records) {
      Call c;
      c.seq = rec.seq;
      c.collective = rec.collective;
      c.count = rec.count;
      c.callsite = rec.callsite;
      c.python = rec.python;
      c.sites = &sites;
      c.root = rec.root_or_peer;
      c.redop = rec.redop;
      c.result = rec.result;
      c.op = rec.op;
      c.dtype = rec.dtype;
      c.returned = rec.returned == rec.seq + 1;
      // A word counts only when it names this record's call (not one the slot held before).
      c.reached = rec.reached == rec.seq + 1;
      c.completed = rec.completed == rec.seq + 1;
      if ((rec.unwatched & capture::flight::kUnwatchedSeqMask) == rec.seq + 1)
        c.unwatched = static_cast<uint8_t>(rec.unwatched >> 56);
      r.calls.push_back(c);
    }
  }
}

void add_trace(const trace::Trace& t, std::map<uint64_t, Comm>& comms) {
  std::set<std::pair<uint64_t, int>> ended, aborted;
  for (const auto& e : t.comm_ends) {
    const auto how = static_cast<trace::CommEndKind>(e.how);
    const bool abort = how == trace::CommEndKind::Abort || how == trace::CommEndKind::Revoke;
    for (const auto& c : t.comms)
      if (c.comm_id == e.comm_id) (abort ? aborted : ended).insert({c.comm_id, c.rank});
  }
  for (const auto& c : t.comms) {
    if (c.rank < 0) continue;
    Comm& comm = comms[c.comm_id];
    comm.nranks = std::max(comm.nranks, c.nranks);
    RankCalls& r = comm.ranks[c.rank];
    r.file = t.path;
    r.pid = t.header.pid;
    r.host = t.header.host;
    r.ended = ended.count({c.comm_id, c.rank}) != 0;
    r.aborted = aborted.count({c.comm_id, c.rank}) != 0;
  }
  std::vector<const trace::CallRecord*> calls;
  for (const auto& call : t.calls) calls.push_back(&call);
  std::sort(calls.begin(), calls.end(), [](auto* a, auto* b) { return a->seq < b->seq; });
  std::map<std::pair<uint64_t, int>, uint64_t> collectives;
  for (const trace::CallRecord* call : calls) {
    auto it = comms.find(call->comm_id);
    if (it == comms.end() || call->rank < 0) continue;
    Call c;
    c.seq = call->seq;
    const bool collective = trace::is_collective(static_cast<trace::Op>(call->op));
    c.collective = collective ? ++collectives[{call->comm_id, call->rank}] : 0;
    c.count = call->count;
    c.callsite = call->callsite;
    const auto python = t.py_calls.find({call->comm_id, call->seq, call->rank});
    c.python = python != t.py_calls.end() ? python->second : 0;
    c.sites = &t;
    c.root = collective ? call->root_or_peer : -1;
    c.redop = call->redop;
    c.result = call->result;
    c.op = call->op;
    c.dtype = call->dtype;
    c.returned = true;
    it->second.ranks[call->rank].calls.push_back(c);
  }
}

bool is_flight_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[8] = {};
  in.read(magic, sizeof(magic));
  return in && std::memcmp(magic, capture::flight::kMagic, sizeof(magic)) == 0;
}

void index_calls(RankCalls& r) {
  std::sort(r.calls.begin(), r.calls.end(),
            [](const Call& a, const Call& b) { return a.seq < b.seq; });
  for (const Call& c : r.calls) {
    if (c.collective == 0) continue;
    r.by_index[c.collective - 1] = &c;
    r.issued = std::max(r.issued, c.collective);
    if (c.returned) r.returned = std::max(r.returned, c.collective);
    if (c.reached) r.reached = std::max(r.reached, c.collective);
    if (c.completed) r.completed = std::max(r.completed, c.collective);
  }
  for (const Call& c : r.calls)
    if (c.collective > r.completed && c.unwatched != 0) ++r.unwatched_after[c.unwatched];
}

std::string unwatched_text(uint8_t reason) {
  return std::string(capture::flight::unwatched_text(reason));
}

// ", then 4 not watched (4 captured into a CUDA graph)": what the completed count leaves out.
std::string unwatched_after_text(const RankCalls& r) {
  if (r.unwatched_after.empty()) return "";
  uint64_t total = 0;
  std::string why;
  for (const auto& [reason, n] : r.unwatched_after) {
    total += n;
    why += (why.empty() ? "" : ", ") + std::to_string(n) + " " + unwatched_text(reason);
  }
  return ", then " + std::to_string(total) + " not watched (" + why + ")";
}

using Shape = std::tuple<uint8_t, uint8_t, uint64_t, int32_t, int32_t>;
Shape shape_of(const Call& c) { return {c.op, c.dtype, c.count, c.root, c.redop}; }

std::string op_text(uint8_t op) { return std::string(trace::op_name(static_cast<trace::Op>(op))); }

// Modules whose frames say nothing about where the program made the call: ours, NCCL's, and the
// C++ and CUDA runtimes' (a call through std::function, say), by the file's name.
bool runtime_module(const trace::Trace& sites, uint64_t module) {
  static constexpr std::string_view kPrefixes[] = {
      "libmagice", "libnccl",  "libstdc++", "libc.so",    "libc-",
      "libgcc_s",  "ld-linux", "libcudart", "libcuda.so", "libpthread"};
  const auto path = sites.modules.find(module);
  if (path == sites.modules.end()) return false;
  const size_t slash = path->second.rfind('/');
  const std::string_view name =
      std::string_view(path->second).substr(slash == std::string::npos ? 0 : slash + 1);
  for (std::string_view prefix : kPrefixes)
    if (name.substr(0, prefix.size()) == prefix) return true;
  return false;
}

// A named frame without what makes it long and says little in a report: "(anonymous
// namespace)::" and the parameter list ("ns::Model::step(int) const (model.cc:12)" reads
// "ns::Model::step (model.cc:12)"). The location, after a space, stays.
std::string without_parameters(std::string line) {
  static constexpr std::string_view kInlined = " inlined in ";
  if (const size_t at = line.find(kInlined); at != std::string::npos)
    return without_parameters(line.substr(0, at)) + std::string(kInlined) +
           without_parameters(line.substr(at + kInlined.size()));
  static constexpr std::string_view kAnonymous = "(anonymous namespace)::";
  for (size_t at; (at = line.find(kAnonymous)) != std::string::npos;)
    line.erase(at, kAnonymous.size());
  for (size_t open = line.find('('); open != std::string::npos && open > 0;
       open = line.find('(', open + 1)) {
    if (line[open - 1] == ' ') return line;  // the location: no parameter list before it
    if (line.compare(0, open, "operator") == 0 || line.substr(0, open).ends_with("operator"))
      continue;  // operator()'s own parentheses
    int depth = 0;
    size_t close = open;
    for (; close < line.size(); ++close) {
      if (line[close] == '(') ++depth;
      if (line[close] == ')' && --depth == 0) break;
    }
    if (close == line.size()) return line;
    size_t end = close + 1;
    if (line.compare(end, 6, " const") == 0) end += 6;
    line.erase(open, end - open);
    return line;
  }
  return line;
}

// The call's site as lines a person reads, innermost first, at most `most`: its Python frames
// when it has them, else its native frames outside the runtimes (all of them, if none is).
std::vector<std::string> site_lines(const Call& c, size_t most) {
  std::vector<std::string> lines;
  if (c.sites == nullptr) return lines;
  const trace::Trace& sites = *c.sites;
  if (c.python != 0) {
    const auto frames = sites.py_callsites.find(c.python);
    if (frames != sites.py_callsites.end())
      for (const auto& f : frames->second)
        if (lines.size() < most) lines.push_back(python_frame_line(f));
    if (!lines.empty()) return lines;
  }
  const auto native = sites.callsites.find(c.callsite);
  if (c.callsite == 0 || native == sites.callsites.end()) return lines;
  const std::vector<trace::Frame>& frames = native->second.frames;
  size_t first = 0;
  while (first < frames.size() && runtime_module(sites, frames[first].module)) ++first;
  if (first == frames.size()) first = 0;
  for (size_t i = first; i < frames.size() && lines.size() < most; ++i)
    lines.push_back(without_parameters(frame_line(sites, frames[i])));
  return lines;
}

// "model.py:123 in forward", "FsdpModel::gather (fsdp.cc:42)", or the fingerprint's leading
// digits when the files do not describe it ("site 0b8f984b"); "" without a call site.
std::string site_text(const Call& c) {
  const std::vector<std::string> lines = site_lines(c, 1);
  if (!lines.empty()) return lines.front();
  return c.callsite != 0 ? "site " + callsite_label(c.callsite) : "";
}

constexpr size_t kDetailFrames = 4;

// "AllGather float32 x 1024" (+ " root 0" for rooted ones) + " at " its site.
std::string call_text(const Call& c) {
  std::string s = op_text(c.op) + " " + std::string(trace::dtype_name(c.dtype)) + " x " +
                  std::to_string(c.count);
  if (c.collective != 0 && c.root >= 0) s += " root " + std::to_string(c.root);
  if (c.collective == 0 && c.root >= 0) s += " peer " + std::to_string(c.root);
  if (const std::string site = site_text(c); !site.empty()) s += " at " + site;
  return s;
}

// "3", "0-2", "0-2,4,6-7".
std::string ranks_text(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!s.empty()) s += ",";
    s += std::to_string(ranks[i]);
    if (j > i) s += (j == i + 1 ? "," : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return s;
}

std::string ranks_word(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + ranks_text(ranks);
}

struct Finding {
  uint64_t comm_id = 0;
  bool hang = false;
  std::string verdict;
  std::vector<std::string> details;
  // For --json.
  std::vector<int> absent, behind, waiting, joining, join_failed;
  std::optional<uint64_t> missing_index, differ_index;
  std::optional<Call> missing;           // the collective the ranks behind never issued, as issued
  std::vector<int> not_reached, inside;  // on the GPU, at gpu_index
  std::optional<uint64_t> gpu_index;
};

// "rank 3's GPU" / "ranks 3,5's GPUs".
std::string gpus_word(const std::vector<int>& ranks) {
  return ranks_word(ranks) + (ranks.size() == 1 ? "'s GPU" : "'s GPUs");
}

// When the host side explains nothing (every rank issued the same collectives) and the rings
// watched completion with events: the first collective some rank has not completed, and where each
// rank's GPU stands with it. Empty when the GPUs show no stall there.
std::optional<std::string> gpu_verdict(const std::string& name, Comm& comm, Finding& f) {
  uint64_t first = UINT64_MAX, issued = UINT64_MAX;
  for (const auto& [rank, r] : comm.ranks) {
    first = std::min(first, r.completed);
    issued = std::min(issued, r.issued);
  }
  if (comm.ranks.empty() || first >= issued) return std::nullopt;
  std::vector<int> not_reached, inside, past;
  const Call* call = nullptr;
  for (const auto& [rank, r] : comm.ranks) {
    auto it = r.by_index.find(first);
    if (it == r.by_index.end()) return std::nullopt;  // older than a ring holds
    call = it->second;
    if (call->unwatched != 0) return std::nullopt;  // its GPU side is not known
    (call->completed ? past : call->reached ? inside : not_reached).push_back(rank);
  }
  const std::string what = " collective #" + std::to_string(first) + " (" + call_text(*call) + ")";
  std::string v;
  if (!not_reached.empty() && past.empty()) {
    v = name + ": " + gpus_word(not_reached) + " never reached" + what +
        ": work queued before it " +
        (not_reached.size() == 1 ? "on its stream has" : "on their streams has") + " not finished";
    if (!inside.empty()) v += "; " + ranks_word(inside) + " wait in it on the GPU";
  } else if (not_reached.empty() && past.empty()) {
    v = name + ": " + ranks_word(inside) + " are all inside" + what +
        " on the GPU: none completed it";
  } else {
    return std::nullopt;
  }
  f.gpu_index = first;
  f.not_reached = not_reached;
  f.inside = inside;
  return v;
}

Finding analyse(uint64_t comm_id, Comm& comm) {
  Finding f;
  f.comm_id = comm_id;
  const std::string name = "comm " + short_id_text(comm_id);
  for (auto& [rank, r] : comm.ranks) index_calls(r);
  for (int rank = 0; rank < comm.nranks; ++rank)
    if (!comm.ranks.count(rank)) f.absent.push_back(rank);

  uint64_t lead = 0;
  bool all_ended = true;
  for (const auto& [rank, r] : comm.ranks) {
    lead = std::max(lead, r.issued);
    all_ended = all_ended && r.ended;
  }
  // The first collective the ranks hold alike and issued differently.
  uint64_t from = 0, to = UINT64_MAX;
  for (const auto& [rank, r] : comm.ranks) {
    from = std::max(from, r.by_index.empty() ? 0 : r.by_index.begin()->first);
    to = std::min(to, r.issued);
  }
  for (uint64_t i = from; i < to && !f.differ_index; ++i) {
    std::map<Shape, std::vector<int>> shapes;
    bool complete = true;
    for (const auto& [rank, r] : comm.ranks) {
      auto it = r.by_index.find(i);
      if (it == r.by_index.end()) {
        complete = false;
        break;
      }
      shapes[shape_of(*it->second)].push_back(rank);
    }
    if (complete && shapes.size() > 1) f.differ_index = i;
  }

  for (const auto& [rank, r] : comm.ranks)
    if (r.issued < lead) f.behind.push_back(rank);

  std::vector<std::string> verdicts;
  for (const auto& [rank, r] : comm.ranks) {
    if (r.join == capture::flight::kJoining) f.joining.push_back(rank);
    if (r.join == capture::flight::kJoinFailed) f.join_failed.push_back(rank);
  }
  if (!f.joining.empty() || !f.join_failed.empty()) {
    // An init waits for every rank: the ranks still inside it wait for those that never came.
    std::vector<int> returned;
    for (const auto& [rank, r] : comm.ranks)
      if (r.join == capture::flight::kJoined) returned.push_back(rank);
    std::string v = name + ": ";
    if (!f.joining.empty()) {
      v += ranks_word(f.joining) + " wait in the communicator's init";
      if (!f.absent.empty())
        v += "; " + ranks_word(f.absent) + " never reached it (no file holds " +
             (f.absent.size() == 1 ? "it" : "them") + ")";
    }
    if (!f.join_failed.empty())
      v += std::string(f.joining.empty() ? "" : "; ") + ranks_word(f.join_failed) +
           (f.join_failed.size() == 1 ? " was" : " were") + " refused by the init (it failed)";
    if (!returned.empty()) v += "; " + ranks_word(returned) + " returned from it";
    verdicts.push_back(v);
  }
  if (f.differ_index) {
    const uint64_t i = *f.differ_index;
    std::map<Shape, std::vector<int>> shapes;
    std::map<Shape, const Call*> example;
    for (const auto& [rank, r] : comm.ranks) {
      const Call* c = r.by_index.at(i);
      shapes[shape_of(*c)].push_back(rank);
      example[shape_of(*c)] = c;
    }
    std::string parts;
    for (const auto& [shape, ranks] : shapes) {
      if (!parts.empty()) parts += "; ";
      parts += ranks_word(ranks) + " " + call_text(*example[shape]);
    }
    verdicts.push_back(name + ": the ranks issued different collectives at collective #" +
                       std::to_string(i) + ": " + parts);
  }
  if (!f.behind.empty()) {
    // The lowest stopping point first: that collective is the one the others wait in.
    uint64_t stop = UINT64_MAX;
    for (int rank : f.behind) stop = std::min(stop, comm.ranks[rank].issued);
    f.missing_index = stop;
    std::vector<int> stopped, waiting, beyond;
    const Call* missing = nullptr;
    for (const auto& [rank, r] : comm.ranks) {
      if (r.issued == stop) {
        stopped.push_back(rank);
        continue;
      }
      auto it = r.by_index.find(stop);
      if (it != r.by_index.end()) missing = it->second;
      if (r.issued == stop + 1 && !r.calls.empty() && !r.calls.back().returned)
        waiting.push_back(rank);
      else
        beyond.push_back(rank);
    }
    f.waiting = waiting;
    if (missing != nullptr) f.missing = *missing;
    std::string v = name + ": " + ranks_word(stopped) + " never issued collective #" +
                    std::to_string(stop) +
                    (missing != nullptr ? " (" + call_text(*missing) + ")" : "");
    if (!waiting.empty()) v += "; " + ranks_word(waiting) + " wait in it";
    if (!beyond.empty()) v += "; " + ranks_word(beyond) + " went past it";
    verdicts.push_back(v);
  }
  if (!f.absent.empty()) {
    verdicts.push_back(name + ": " + ranks_word(f.absent) + " of " + std::to_string(comm.nranks) +
                       " absent (no file holds them)");
  }
  // Only events tell the GPU apart from the host: completion at return says no more than
  // `returned` does.
  bool by_events = !comm.ranks.empty();
  for (const auto& [rank, r] : comm.ranks)
    by_events = by_events && r.completion == capture::flight::kCompletionEvents;
  if (verdicts.empty() && by_events && !all_ended) {
    if (auto v = gpu_verdict(name, comm, f)) verdicts.push_back(*v);
  }
  f.hang = !verdicts.empty() && !(all_ended && f.absent.empty() && !f.differ_index);
  if (verdicts.empty()) {
    std::vector<int> in_call;
    for (const auto& [rank, r] : comm.ranks)
      if (!r.calls.empty() && !r.calls.back().returned) in_call.push_back(rank);
    std::string v = name + ": no hang seen: " + std::to_string(comm.ranks.size()) +
                    (comm.ranks.size() == 1 ? " rank" : " ranks") + " issued " +
                    std::to_string(lead) + " collectives each";
    if (all_ended) v += ", ended";
    if (!in_call.empty()) v += "; " + ranks_word(in_call) + " inside their last call";
    verdicts.push_back(v);
  }
  f.verdict = verdicts.front();
  for (size_t i = 1; i < verdicts.size(); ++i) f.details.push_back(verdicts[i]);

  for (const auto& [rank, r] : comm.ranks) {
    std::string line = "  rank " + std::to_string(rank) + ": issued " + std::to_string(r.issued) +
                       ", returned from " + std::to_string(r.returned) +
                       (r.completion != capture::flight::kCompletionOff
                            ? ", completed " + std::to_string(r.completed)
                            : std::string()) +
                       " collectives" + unwatched_after_text(r);
    if (!r.calls.empty()) {
      const Call& last = r.calls.back();
      line += "; last call #" + std::to_string(last.seq) + " " + call_text(last) +
              (last.collective != 0 ? " (collective #" + std::to_string(last.collective - 1) + ")"
                                    : "") +
              (last.returned ? ", returned " + std::to_string(last.result) : ", not returned");
      if (r.completion != capture::flight::kCompletionOff)
        line += last.unwatched != 0 ? ", not watched (" + unwatched_text(last.unwatched) + ")"
                : last.completed    ? ", completed"
                : last.reached      ? ", reached, not completed"
                                    : ", not reached";
    }
    if (r.join == capture::flight::kJoining) line += "; inside the communicator's init";
    if (r.join == capture::flight::kJoinFailed) line += "; the communicator's init failed";
    if (r.ended) line += "; communicator ended";
    if (r.aborted) line += "; communicator aborted";
    if (r.torn != 0) line += "; " + std::to_string(r.torn) + " torn record(s) ignored";
    line += "  [pid " + std::to_string(r.pid) + " on " + r.host + "]";
    f.details.push_back(line);
    if (!r.calls.empty())
      for (const std::string& frame : site_lines(r.calls.back(), kDetailFrames))
        f.details.push_back("      " + frame);
  }
  return f;
}

// ,"site":...,"python":...,"frames":[...]: the call's site as text reads it, its Python line
// (null without one), and the frames the details list.
void append_site(std::string& out, const Call& c) {
  const std::string site = site_text(c);
  out += ",\"site\":" + (site.empty() ? std::string("null") : json_string(site));
  std::string python;
  if (c.sites != nullptr && c.python != 0) {
    const auto frames = c.sites->py_callsites.find(c.python);
    if (frames != c.sites->py_callsites.end() && !frames->second.empty())
      python = python_frame_line(frames->second.front());
  }
  out += ",\"python\":" + (python.empty() ? std::string("null") : json_string(python));
  out += ",\"frames\":[";
  const std::vector<std::string> frames = site_lines(c, kDetailFrames);
  for (size_t i = 0; i < frames.size(); ++i) out += (i ? "," : "") + json_string(frames[i]);
  out += "]";
}

void append_ranks(std::string& out, const std::vector<int>& ranks) {
  out += "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) out += ",";
    append_integer(out, ranks[i]);
  }
  out += "]";
}

std::string json_of(const std::vector<Finding>& findings, std::map<uint64_t, Comm>& comms) {
  std::string out = "{\"hang\":";
  bool any = false;
  for (const Finding& f : findings) any = any || f.hang;
  out += any ? "true" : "false";
  out += ",\"communicators\":[";
  for (size_t k = 0; k < findings.size(); ++k) {
    const Finding& f = findings[k];
    Comm& comm = comms[f.comm_id];
    if (k) out += ",";
    out += "{\"comm\":" + json_string(short_id_text(f.comm_id)) +
           ",\"nranks\":" + std::to_string(comm.nranks) +
           ",\"hang\":" + (f.hang ? "true" : "false") + ",\"verdict\":" + json_string(f.verdict);
    out += ",\"absent\":";
    append_ranks(out, f.absent);
    out += ",\"behind\":";
    append_ranks(out, f.behind);
    out += ",\"waiting\":";
    append_ranks(out, f.waiting);
    out += ",\"missing_collective\":" +
           (f.missing_index ? std::to_string(*f.missing_index) : std::string("null"));
    if (f.missing) {
      out += ",\"missing_call\":{\"op\":" + json_string(op_text(f.missing->op)) +
             ",\"dtype\":" + json_string(std::string(trace::dtype_name(f.missing->dtype))) +
             ",\"count\":" + std::to_string(f.missing->count);
      append_site(out, *f.missing);
      out += "}";
    }
    out += ",\"first_difference\":" +
           (f.differ_index ? std::to_string(*f.differ_index) : std::string("null"));
    out += ",\"joining\":";
    append_ranks(out, f.joining);
    out += ",\"join_failed\":";
    append_ranks(out, f.join_failed);
    out +=
        ",\"gpu_collective\":" + (f.gpu_index ? std::to_string(*f.gpu_index) : std::string("null"));
    out += ",\"not_reached\":";
    append_ranks(out, f.not_reached);
    out += ",\"inside_on_gpu\":";
    append_ranks(out, f.inside);
    out += ",\"ranks\":[";
    bool first = true;
    for (const auto& [rank, r] : comm.ranks) {
      if (!first) out += ",";
      first = false;
      out += "{\"rank\":" + std::to_string(rank) + ",\"issued\":" + std::to_string(r.issued) +
             ",\"returned\":" + std::to_string(r.returned);
      // Collectives reached and completed on the GPU: null where the ring did not watch.
      const bool watched = r.completion != capture::flight::kCompletionOff;
      out += std::string(",\"completion\":") +
             (r.completion == capture::flight::kCompletionEvents   ? "\"events\""
              : r.completion == capture::flight::kCompletionReturn ? "\"return\""
                                                                   : "null") +
             ",\"reached\":" + (watched ? std::to_string(r.reached) : std::string("null")) +
             ",\"completed\":" + (watched ? std::to_string(r.completed) : std::string("null"));
      if (watched) {
        uint64_t unwatched = 0;
        for (const auto& [reason, n] : r.unwatched_after) unwatched += n;
        out += ",\"unwatched_after\":" + std::to_string(unwatched);
      }
      out += std::string(",\"ended\":") + (r.ended ? "true" : "false") +
             ",\"aborted\":" + (r.aborted ? "true" : "false") + ",\"file\":" + json_string(r.file);
      if (!r.calls.empty()) {
        const Call& c = r.calls.back();
        out += ",\"last\":{\"seq\":" + std::to_string(c.seq) + ",\"collective\":" +
               (c.collective ? std::to_string(c.collective - 1) : std::string("null")) +
               ",\"op\":" + json_string(op_text(c.op)) +
               ",\"dtype\":" + json_string(std::string(trace::dtype_name(c.dtype))) +
               ",\"count\":" + std::to_string(c.count) +
               ",\"root_or_peer\":" + std::to_string(c.root) +
               ",\"callsite\":" + json_string(hex16(c.callsite)) +
               ",\"returned\":" + (c.returned ? "true" : "false");
        append_site(out, c);
        if (watched)
          out += std::string(",\"reached\":") + (c.reached ? "true" : "false") +
                 ",\"completed\":" + (c.completed ? "true" : "false") + ",\"unwatched\":" +
                 (c.unwatched != 0 ? json_string(unwatched_text(c.unwatched)) : "null");
        out += "}";
      }
      out += "}";
    }
    out += "]}";
  }
  out += "]}\n";
  return out;
}

}  // namespace

int hang_main(std::span<const std::string> args) {
  return run_verb(kUsage, args, [&] {
    ArgCursor cursor(args);
    bool json = false;
    std::vector<std::string> files;
    while (!cursor.done()) {
      if (cursor.flag("--json")) {
        json = true;
        continue;
      }
      cursor.operand(files);
    }
    if (files.empty()) throw UsageError("no files");
    std::map<uint64_t, Comm> comms;
    std::deque<trace::Trace> held;  // what the calls' sites point into
    for (const std::string& file : files) {
      if (is_flight_file(file)) {
        const capture::flight::FileView view = capture::flight::read_file(file);
        trace::Trace& sites = held.emplace_back();
        sites.path = file;
        for (const std::string& segment : view.sites) {
          try {
            trace::parse_records(file, segment, sites);
          } catch (const trace::TraceFormatError& e) {
            std::fprintf(stderr, "magice-trace hang: call sites of %s: %s\n", file.c_str(),
                         e.what());
          }
        }
        add_flight(view, sites, comms);
      } else {
        add_trace(held.emplace_back(trace::read_trace(file)), comms);
      }
    }
    std::vector<Finding> findings;
    bool hang = false;
    for (auto& [id, comm] : comms) {
      findings.push_back(analyse(id, comm));
      hang = hang || findings.back().hang;
    }
    // The communicators with something to say first: a job holds many that are fine.
    std::stable_partition(findings.begin(), findings.end(),
                          [](const Finding& f) { return f.hang; });
    if (json) {
      const std::string text = json_of(findings, comms);
      std::fwrite(text.data(), 1, text.size(), stdout);
      return hang ? 1 : 0;
    }
    if (findings.empty()) std::printf("no communicators in these files\n");
    for (const Finding& f : findings) std::printf("%s\n", f.verdict.c_str());
    for (const Finding& f : findings) {
      std::printf("\ncomm %s:\n", short_id_text(f.comm_id).c_str());
      for (const std::string& d : f.details) std::printf("%s\n", d.c_str());
    }
    return hang ? 1 : 0;
  });
}

}  // namespace magi::tool
