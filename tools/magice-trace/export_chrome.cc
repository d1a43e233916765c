// magice-trace export --chrome: Chrome trace-event JSON, which Perfetto and chrome://tracing open.
// One process per file, one thread row per communicator, one slice per call; files are placed
// on one time axis through each file's (monotonic, realtime) start pair.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "tools/magice-trace/cli.h"
#include "tools/magice-trace/describe.h"
#include "tools/magice-trace/json_writer.h"
#include "tools/magice-trace/members.h"
#include "tools/magice-trace/verbs.h"

namespace magi::tool {
namespace {

constexpr std::string_view kUsage =
    "usage: magice-trace export --chrome FILE... -o OUT.json\n"
    "  Writes Chrome trace-event JSON (open it in ui.perfetto.dev): one process per file, one\n"
    "  row per communicator, one slice per call, step events as instants. A call's args hold\n"
    "  its seq (call #N) and, for a collective, its collective index (collective #N).\n"
    "  --chrome      the output format (the only one so far)\n"
    "  -o OUT.json   where to write it (\"-\" for stdout)\n";

constexpr uint64_t kUnnumbered = UINT64_MAX;

// Nanoseconds since the earliest trace start, on the realtime clock all files share.
class Timeline {
 public:
  explicit Timeline(const std::vector<trace::Trace>& traces) {
    for (const trace::Trace& t : traces) {
      earliest_ = std::min(earliest_, t.header.start_realtime_ns);
    }
  }
  int64_t since_start(const trace::FileHeader& h, uint64_t monotonic_ns) const {
    // Signed: a clock step between files can put a record before the earliest start.
    return static_cast<int64_t>(monotonic_ns - h.start_monotonic_ns) +
           static_cast<int64_t>(h.start_realtime_ns - earliest_);
  }

 private:
  uint64_t earliest_ = UINT64_MAX;
};

class ChromeExport {
 public:
  ChromeExport(const std::vector<trace::Trace>& traces, JsonOutput& out)
      : traces_(traces), out_(out), timeline_(traces) {}

  void write() {
    out_.write("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    for (size_t pid = 0; pid < traces_.size(); ++pid) write_file(pid, traces_[pid]);
    out_.write("\n]}\n");
  }

 private:
  void event(std::string_view json) {
    out_.write(first_ ? "" : ",\n");
    out_.write(json);
    first_ = false;
  }

  std::string where(size_t pid, size_t tid) const {
    return ",\"pid\":" + std::to_string(pid) + ",\"tid\":" + std::to_string(tid);
  }

  void metadata(size_t pid, size_t tid, const char* kind, const std::string& name) {
    event("{\"name\":\"" + std::string(kind) + "\",\"ph\":\"M\"" + where(pid, tid) +
          ",\"args\":{\"name\":" + json_string(name) + "}}");
  }

  void write_file(size_t pid, const trace::Trace& t) {
    const std::vector<Member> members = members_of(t);
    const std::string host_pid = std::string(t.header.host) + ":" + std::to_string(t.header.pid);
    const std::string who = members.empty() || members.front().rank < 0
                                ? "file " + std::to_string(pid)
                                : "rank " + std::to_string(members.front().rank);
    metadata(pid, 0, "process_name", who + " (" + host_pid + ")");
    event("{\"name\":\"process_sort_index\",\"ph\":\"M\"" + where(pid, 0) +
          ",\"args\":{\"sort_index\":" + std::to_string(pid) + "}}");

    std::map<uint64_t, int> ranks_per_comm;
    for (const Member& m : members) ++ranks_per_comm[m.comm_id];
    for (size_t i = 0; i < members.size(); ++i) {
      const Member& m = members[i];
      const size_t tid = i + 1;
      std::string name = "comm " + short_id_text(m.comm_id);
      if (ranks_per_comm[m.comm_id] > 1) name += " rank " + std::to_string(m.rank);
      metadata(pid, tid, "thread_name", name);
      size_t collective = 0;  // of the next collective of m
      for (const trace::CallRecord* call : m.calls) {
        const bool numbered = collective < m.numbered && m.collectives[collective] == call;
        write_call(pid, tid, t, *call, numbered ? collective : kUnnumbered);
        if (numbered) ++collective;
      }
      if (m.comm != nullptr) {
        instant(
            pid, tid, t, m.comm->time_ns, "comm created",
            "\"rank\":" + std::to_string(m.comm->rank) +
                ",\"nranks\":" + std::to_string(m.comm->nranks) + ",\"origin\":" +
                json_string(trace::origin_name(static_cast<trace::CommOrigin>(m.comm->origin))));
      }
      if (m.end != nullptr) {
        instant(pid, tid, t, m.end->time_ns,
                "comm " + std::string(trace::end_name(static_cast<trace::CommEndKind>(m.end->how))),
                "\"calls\":" + std::to_string(m.end->calls));
      }
      write_steps(pid, tid, t, m);
    }
  }

  // The hot loop of a large export: one reused buffer, no printf. Op, datatype and reduction
  // names are this tool's own and need no escaping.
  // `collective`: the call's collective index, or kUnnumbered (Send/Recv, or not known).
  void write_call(size_t pid, size_t tid, const trace::Trace& t, const trace::CallRecord& c,
                  uint64_t collective) {
    const auto op = static_cast<trace::Op>(c.op);
    std::string& s = line_;
    s.assign("{\"name\":\"").append(trace::op_name(op)).append("\",\"ph\":\"X\",\"pid\":");
    append_integer(s, pid);
    s += ",\"tid\":";
    append_integer(s, tid);
    s += ",\"ts\":";
    append_micros(s, timeline_.since_start(t.header, c.time_ns));
    s += ",\"dur\":";
    append_micros(s, c.duration_ns);
    s.append(",\"args\":{\"op\":\"").append(trace::op_name(op));
    s.append("\",\"dtype\":\"").append(trace::dtype_name(c.dtype)).append("\",\"count\":");
    append_integer(s, c.count);
    s += ",\"seq\":";
    append_integer(s, c.seq);
    if (collective != kUnnumbered) {
      s += ",\"collective\":";
      append_integer(s, collective);
    }
    s.append(",\"callsite\":\"").append(callsite_label(c.callsite)).append("\"");
    if (c.root_or_peer >= 0) {
      s += trace::is_collective(op) ? ",\"root\":" : ",\"peer\":";
      append_integer(s, c.root_or_peer);
    }
    if (c.redop >= 0) s.append(",\"redop\":\"").append(trace::redop_name(c.redop)).append("\"");
    if (c.result != 0) {
      s += ",\"result\":";
      append_integer(s, c.result);
    }
    s += "}}";
    event(s);
  }

  void instant(size_t pid, size_t tid, const trace::Trace& t, uint64_t time_ns,
               const std::string& name, const std::string& args) {
    event("{\"name\":" + json_string(name) + ",\"ph\":\"i\",\"s\":\"t\"" + where(pid, tid) +
          ",\"ts\":" + micros(timeline_.since_start(t.header, time_ns)) + ",\"args\":{" + args +
          "}}");
  }

  // Step records carry a collective index, not a time: they are placed at that collective's
  // start (or at the last one, when the trace ends before it).
  void write_steps(size_t pid, size_t tid, const trace::Trace& t, const Member& m) {
    if (m.collectives.empty()) return;
    for (const trace::StepRecord& s : t.steps) {
      if (s.comm_id != m.comm_id) continue;
      const bool found = s.event == static_cast<uint8_t>(trace::StepEvent::Found);
      const auto at = std::min<uint64_t>(s.seq, m.collectives.size() - 1);
      instant(pid, tid, t, m.collectives[at]->time_ns, found ? "step found" : "step lost",
              "\"collective\":" + std::to_string(s.seq) + ",\"period\":" +
                  std::to_string(s.period) + ",\"origin\":" + std::to_string(s.origin) +
                  ",\"repeats\":" + std::to_string(s.repeats) + ",\"digest\":\"" + hex16(s.digest) +
                  "\"");
    }
  }

  static std::string micros(int64_t ns) {
    std::string text;
    append_micros(text, ns);
    return text;
  }

  const std::vector<trace::Trace>& traces_;
  JsonOutput& out_;
  std::string line_;
  Timeline timeline_;
  bool first_ = true;
};

}  // namespace

int export_main(std::span<const std::string> args) {
  return run_verb(kUsage, args, [&] {
    bool chrome = false;
    std::string output;
    std::vector<std::string> files;
    ArgCursor cursor(args);
    while (!cursor.done()) {
      if (cursor.flag("--chrome")) {
        chrome = true;
      } else if (auto path = cursor.value("-o")) {
        output = *path;
      } else {
        cursor.operand(files);
      }
    }
    if (!chrome) throw UsageError("export needs a format: --chrome");
    if (output.empty()) throw UsageError("export needs -o OUT.json");
    if (files.empty()) throw UsageError("export needs at least one trace file");
    const std::vector<trace::Trace> traces = load_traces(files);
    JsonOutput out(output);
    ChromeExport(traces, out).write();
    out.close();
    return 0;
  });
}

}  // namespace magi::tool
