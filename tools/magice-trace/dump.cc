// magice-trace dump: every record of each file, as tables.
#include <cinttypes>
#include <cstdio>
#include <string>
#include <unordered_set>
#include <vector>

#include "tools/magice-trace/cli.h"
#include "tools/magice-trace/describe.h"
#include "tools/magice-trace/members.h"
#include "tools/magice-trace/symbols.h"
#include "tools/magice-trace/verbs.h"

namespace magi::tool {
namespace {

constexpr std::string_view kUsage =
    "usage: magice-trace dump [--comm ID] [--frames] FILE...\n"
    "  Prints each trace file as tables: its header, communicators, calls, step events,\n"
    "  agreement rounds, the decisions of each round, the memory of each plan's window\n"
    "  (static weights: bytes read in place and bytes copied), ends. A call that left NCCL\n"
    "  is marked \"moved\" (\"would move\" under MAGI_DRY_RUN); one routed off NCCL whose bucket\n"
    "  fell back to NCCL, \"fell back\". Each call shows both its numbers: call (its seq, "
    "counting\n"
    "  every call, Send/Recv too) and collective (collective #N of the logs and of the other\n"
    "  verbs; - for Send/Recv, ? when the file misses earlier calls of the communicator).\n"
    "  --comm ID   only the communicators whose id starts with ID: the 12 hex digits every log\n"
    "              line and every magice-trace output show (comm 3f2a0c1d9e7b), any leading\n"
    "              part of them, or the whole 16-digit id\n"
    "  --frames    also print each call site's frames once: function (file:line) where the\n"
    "              binary is on this machine, else module+0xoffset (--no-symbols: always)\n";

struct DumpOptions {
  CommFilter comms;
  bool frames = false;
  std::vector<std::string> files;
};

std::string flags_text(const trace::CallRecord& call) {
  std::string text;
  if (call.flags & trace::kCallInGroup) text += 'G';
  if (call.flags & trace::kCallCapturing) text += 'C';
  if (call.flags & trace::kCallCaptureUnknown) text += '?';
  return text.empty() ? "-" : text;
}

class Dumper {
 public:
  Dumper(const trace::Trace& trace, const DumpOptions& options) : t_(trace), o_(options) {}

  void print() {
    const trace::FileHeader& h = t_.header;
    std::printf("%s: host %s pid %" PRIu64 " program %s started %s\n", t_.path.c_str(), h.host,
                h.pid, h.program, wall_clock_text(h.start_realtime_ns).c_str());
    print_comms();
    print_calls();
    print_steps();
    print_agreements();
    print_decisions();
    print_windows();
    print_ends();
    if (o_.frames) print_frames();
    if (t_.dropped != 0) {
      std::printf("dropped: %" PRIu64 " records lost while the writer was behind\n", t_.dropped);
    }
    if (t_.unknown_records != 0) {
      std::printf("skipped: %" PRIu64 " records of types this tool does not know\n",
                  t_.unknown_records);
    }
  }

 private:
  bool wanted(uint64_t comm_id) const { return o_.comms.selects(comm_id); }

  void print_comms() const {
    std::printf("communicators\n  %-12s  %-9s  %-16s  %-12s  %s\n", "id", "rank", "origin",
                "parent", "device");
    for (const trace::CommRecord& c : t_.comms) {
      if (!wanted(c.comm_id)) continue;
      const std::string rank = std::to_string(c.rank) + "/" + std::to_string(c.nranks);
      std::printf("  %-12s  %-9s  %-16s  %-12s  %s\n", short_id_text(c.comm_id).c_str(),
                  rank.c_str(),
                  std::string(trace::origin_name(static_cast<trace::CommOrigin>(c.origin))).c_str(),
                  c.parent_id == 0 ? "-" : short_id_text(c.parent_id).c_str(),
                  c.cuda_device < 0 ? "-" : std::to_string(c.cuda_device).c_str());
    }
  }

  // Each call under both its numbers: "call" (seq) and "collective" (- for Send/Recv, ? where
  // the file misses earlier calls). The collective column comes after op so that scripts reading
  // comm, call and op by position keep working.
  void print_calls() {
    std::printf("calls\n  %-12s  %8s  %-13s %10s  %-8s %12s  %-9s %-5s %5s  %-5s  %-8s  %s\n",
                "comm", "call", "op", "collective", "dtype", "count", "root/peer", "redop", "depth",
                "flags", "callsite", "duration");
    const std::vector<Member> members = members_of(t_);
    const auto numbers = collective_numbers(members);
    for (const trace::CallRecord& c : t_.calls) {
      if (!wanted(c.comm_id)) continue;
      if (c.callsite != 0) used_callsites_.insert(c.callsite);
      const auto number = numbers.find(&c);
      std::string collective = trace::is_collective(static_cast<trace::Op>(c.op)) ? "?" : "-";
      if (number != numbers.end()) collective = std::to_string(number->second);
      std::printf("  %-12s  %8" PRIu64 "  %-13s %10s  %-8s %12" PRIu64
                  "  %-9s %-5s %5u  %-5s  %-8s  %s",
                  short_id_text(c.comm_id).c_str(), c.seq,
                  std::string(trace::op_name(static_cast<trace::Op>(c.op))).c_str(),
                  collective.c_str(), std::string(trace::dtype_name(c.dtype)).c_str(), c.count,
                  root_text(c.root_or_peer).c_str(), redop_text(c.redop).c_str(),
                  static_cast<unsigned>(c.group_depth), flags_text(c).c_str(),
                  callsite_label(c.callsite).c_str(), duration_text(c.duration_ns).c_str());
      if (c.result != 0) std::printf("  result %d", c.result);
      if (c.flags & trace::kCallMoved) std::printf("  moved");
      if (const std::string python = python_line(t_, c); !python.empty())
        std::printf("  %s", python.c_str());
      if (c.flags & trace::kCallWouldMove) std::printf("  would move");
      if (c.flags & trace::kCallFellBack) std::printf("  fell back");
      std::putchar('\n');
    }
  }

  void print_steps() const {
    if (t_.steps.empty()) return;
    std::printf("steps\n  %-12s  %-5s  %10s  %6s  %10s  %8s  %s\n", "comm", "event", "collective",
                "period", "from", "repeats", "digest");
    for (const trace::StepRecord& s : t_.steps) {
      if (!wanted(s.comm_id)) continue;
      const char* event = s.event == static_cast<uint8_t>(trace::StepEvent::Found)  ? "found"
                          : s.event == static_cast<uint8_t>(trace::StepEvent::Lost) ? "lost"
                                                                                    : "?";
      std::printf("  %-12s  %-5s  %10" PRIu64 "  %6u  %10" PRIu64 "  %8" PRIu64 "  %s\n",
                  short_id_text(s.comm_id).c_str(), event, s.seq, s.period, s.origin, s.repeats,
                  hex16(s.digest).c_str());
    }
  }

  void print_agreements() const {
    if (t_.agreements.empty()) return;
    std::printf(
        "agreement rounds\n"
        "  %-12s  %5s  %5s  %-8s  %-11s  %10s  %-9s  %7s  %6s  %-16s  %s\n",
        "comm", "rank", "round", "kind", "event", "collective", "mode", "moved", "period", "digest",
        "reason");
    for (const trace::AgreementRecord& a : t_.agreements) {
      if (!wanted(a.comm_id)) continue;
      const std::string moved = std::to_string(a.moved) + "/" + std::to_string(a.gathers);
      std::printf("  %-12s  %5d  %5u  %-8s  %-11s  %10" PRIu64 "  %-9s  %7s  %6u  %-16s  %s\n",
                  short_id_text(a.comm_id).c_str(), a.rank, a.round,
                  name(trace::round_kind_name(static_cast<trace::RoundKind>(a.kind))).c_str(),
                  name(trace::round_event_name(static_cast<trace::RoundEvent>(a.event))).c_str(),
                  a.seq, name(trace::mode_name(static_cast<trace::AgreementMode>(a.mode))).c_str(),
                  moved.c_str(), a.period, hex16(a.step_digest).c_str(),
                  reason_text(a.reason).c_str());
    }
  }

  void print_decisions() const {
    if (t_.decisions.empty()) return;
    std::printf("decisions\n  %-12s  %5s  %5s  %8s  %6s  %-8s %12s  %-8s  %-9s  %s\n", "comm",
                "rank", "round", "position", "bucket", "dtype", "count", "callsite", "mode",
                "verdict");
    for (const trace::DecisionRecord& d : t_.decisions) {
      if (!wanted(d.comm_id)) continue;
      std::string verdict(trace::verdict_name(static_cast<trace::Verdict>(d.verdict)));
      if (d.reason != 0) verdict += ": " + reason_text(d.reason);
      if (d.refused_by >= 0) verdict += " (rank " + std::to_string(d.refused_by) + ")";
      std::printf("  %-12s  %5d  %5u  %8u  %6u  %-8s %12" PRIu64 "  %-8s  %-9s  %s\n",
                  short_id_text(d.comm_id).c_str(), d.rank, d.round, d.position,
                  static_cast<unsigned>(d.bucket), name(trace::dtype_name(d.dtype)).c_str(),
                  d.count, callsite_label(d.callsite).c_str(),
                  name(trace::mode_name(static_cast<trace::AgreementMode>(d.mode))).c_str(),
                  verdict.c_str());
    }
  }

  // What each plan's window took, and what it reads in place (static weights).
  void print_windows() const {
    if (t_.windows.empty()) return;
    std::printf("windows\n  %-12s  %5s  %5s  %10s  %-9s  %12s  %22s  %18s  %8s\n", "comm", "rank",
                "round", "collective", "mode", "window bytes", "exported bytes (shards)",
                "bound bytes (shards)", "mappings");
    for (const trace::WindowRecord& w : t_.windows) {
      if (!wanted(w.comm_id)) continue;
      const std::string exported = std::to_string(w.exported_bytes) + " (" +
                                   std::to_string(w.exported_shards) + " in " +
                                   std::to_string(w.exported_allocations) + ")";
      const std::string bound =
          std::to_string(w.bound_bytes) + " (" + std::to_string(w.bound_shards) + ")";
      std::printf("  %-12s  %5d  %5u  %10" PRIu64 "  %-9s  %12" PRIu64 "  %22s  %18s  %8u\n",
                  short_id_text(w.comm_id).c_str(), w.rank, w.round, w.seq,
                  name(trace::mode_name(static_cast<trace::AgreementMode>(w.mode))).c_str(),
                  w.window_bytes, exported.c_str(), bound.c_str(), w.peer_mappings);
    }
    // Every reason shards were copied instead of read in place, with how many.
    for (const trace::Trace::WindowRefusal& r : t_.window_refusals) {
      if (!wanted(r.record.comm_id)) continue;
      std::printf("  %-12s  %5d  %5u  bound %u shards (%" PRIu64
                  " bytes; the first: gather %lld of the plan): %s\n",
                  short_id_text(r.record.comm_id).c_str(), r.record.rank, r.record.round,
                  r.record.shards, r.record.bytes, static_cast<long long>(r.record.first),
                  r.why.c_str());
    }
  }

  static std::string name(std::string_view text) { return std::string(text); }
  static std::string reason_text(uint8_t reason) {
    return reason == 0 ? "-" : name(trace::reason_name(static_cast<trace::Reason>(reason)));
  }

  void print_ends() const {
    if (t_.comm_ends.empty()) return;
    std::printf("ends\n  %-12s  %-12s  %s\n", "comm", "how", "calls");
    for (const trace::CommEndRecord& e : t_.comm_ends) {
      if (!wanted(e.comm_id)) continue;
      std::printf("  %-12s  %-12s  %" PRIu64 "\n", short_id_text(e.comm_id).c_str(),
                  std::string(trace::end_name(static_cast<trace::CommEndKind>(e.how))).c_str(),
                  e.calls);
    }
  }

  // Each call site once, in the order the calls first used it.
  void print_frames() const {
    std::printf("call sites\n");
    std::unordered_set<uint64_t> printed;
    for (const trace::CallRecord& c : t_.calls) {
      if (c.callsite == 0 || !used_callsites_.contains(c.callsite) ||
          !printed.insert(c.callsite).second) {
        continue;
      }
      std::printf("  %s %s\n", callsite_label(c.callsite).c_str(), hex16(c.callsite).c_str());
      const auto it = t_.callsites.find(c.callsite);
      if (it == t_.callsites.end()) {
        std::printf("      (no frames recorded)\n");
        continue;
      }
      for (const trace::Frame& f : it->second.frames) {
        std::printf("      %s\n", frame_line(t_, f).c_str());
      }
    }
    printed.clear();
    for (const auto& [key, py] : t_.py_calls) {
      const auto& [comm_id, seq, rank] = key;
      const auto frames = t_.py_callsites.find(py);
      if (!wanted(comm_id) || frames == t_.py_callsites.end() || !printed.insert(py).second)
        continue;
      if (printed.size() == 1) std::printf("python call sites\n");
      std::printf("  %s %s\n", callsite_label(py).c_str(), hex16(py).c_str());
      for (const trace::PyFrameText& f : frames->second)
        std::printf("      %s\n", python_frame_line(f).c_str());
    }
  }

  const trace::Trace& t_;
  const DumpOptions& o_;
  std::unordered_set<uint64_t> used_callsites_;
};

}  // namespace

int dump_main(std::span<const std::string> args) {
  return run_verb(kUsage, args, [&] {
    DumpOptions options;
    ArgCursor cursor(args);
    while (!cursor.done()) {
      if (cursor.flag("--frames")) {
        options.frames = true;
      } else if (auto id = cursor.value("--comm")) {
        options.comms = CommFilter(*id);
      } else {
        cursor.operand(options.files);
      }
    }
    if (options.files.empty()) throw UsageError("dump needs at least one trace file");
    // One file at a time: a dump of many large traces never holds more than one in memory.
    for (size_t i = 0; i < options.files.size(); ++i) {
      const trace::Trace t = trace::read_trace(options.files[i]);
      if (i != 0) std::putchar('\n');
      Dumper(t, options).print();
    }
    return 0;
  });
}

}  // namespace magi::tool
