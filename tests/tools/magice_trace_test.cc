// magice-trace run as a program on trace files built byte by byte, as a user would run it.
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <nccl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/options.h"
#include "capture/callsite.h"
#include "capture/trace_reader.h"
#include "tests/support/has_line.h"
#include "tests/support/trace_builder.h"

namespace magi::trace {
namespace {

using testing::AgreementSpec;
using testing::CallSpec;
using testing::DecisionSpec;
using testing::make_agreement;
using testing::make_call;
using testing::make_comm;
using testing::make_decision;
using testing::make_file_header;
using testing::TraceBuilder;

// Shown as 3f2a0c1d9e7b and 7c00ffee1234: a communicator's low 48 bits, as the library logs it.
constexpr uint64_t kWorld = 0x5eed3f2a0c1d9e7bull;
constexpr uint64_t kHalf = 0x6a1f7c00ffee1234ull;
constexpr auto kTimeout = std::chrono::seconds(60);

struct ToolRun {
  int status = -1;  // exit status; -1 if killed or timed out
  std::string out;
  std::string err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Runs a program with its output in files, killed if it outlives kTimeout: a hang fails the test.
ToolRun run_program(const std::vector<std::string>& argv, const std::string& scratch) {
  const std::string out_path = scratch + "/stdout", err_path = scratch + "/stderr";
  const pid_t pid = fork();
  if (pid == 0) {
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (out < 0 || err < 0) _exit(126);
    dup2(out, 1);
    dup2(err, 2);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  ToolRun run;
  if (pid < 0) return run;
  const auto deadline = std::chrono::steady_clock::now() + kTimeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ADD_FAILURE() << argv[0] << " did not finish within " << kTimeout.count() << " s";
      return run;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (WIFEXITED(status)) run.status = WEXITSTATUS(status);
  run.out = slurp(out_path);
  run.err = slurp(err_path);
  return run;
}

std::string tool_path() {
  const char* dir = std::getenv("TEST_BUILD_DIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : "build") + "/magice-trace";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A training-like collective sequence: one setup broadcast, then `steps` repeats of a step of
// all-gathers and a reduce-scatter, each issued from its own call site.
std::vector<CallSpec> periodic_sequence(int steps) {
  std::vector<CallSpec> calls = {{Op::Broadcast, 7, 4096, 0, -1, 0xb0000001'00000000ull}};
  for (int s = 0; s < steps; ++s) {
    calls.push_back({Op::AllGather, 9, 1 << 20, -1, -1, 0xa0000001'00000000ull});
    calls.push_back({Op::AllGather, 9, 1 << 18, -1, -1, 0xa0000002'00000000ull});
    calls.push_back({Op::ReduceScatter, 7, 1 << 16, -1, ncclSum, 0xc0000003'00000000ull});
  }
  return calls;
}

class MagiceTrace : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/magice-trace-test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    ASSERT_EQ(access(tool_path().c_str(), X_OK), 0)
        << tool_path() << " is not built (set TEST_BUILD_DIR to the build directory)";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  ToolRun tool(std::vector<std::string> args) {
    args.insert(args.begin(), tool_path());
    return run_program(args, dir_);
  }

  // One rank's file: its world communicator and the given collectives, with a Send/Recv to
  // its neighbour in between that the other ranks do not mirror.
  std::string write_rank(int rank, int nranks, const std::vector<CallSpec>& calls,
                         uint64_t start_ns = 5'000'000'000ull) {
    TraceBuilder b(make_file_header(1000 + rank, "node" + std::to_string(rank / 2), "train",
                                    start_ns, 1'700'000'000'000'000'000ull + rank * 1000));
    b.comm(make_comm(kWorld, rank, nranks, CommOrigin::InitRank, 0, start_ns + 10));
    uint64_t seq = 0, time = start_ns + 1000;
    for (size_t i = 0; i < calls.size(); ++i) {
      if (i == 2) {
        const CallSpec p2p{rank % 2 == 0 ? Op::Send : Op::Recv, 7, 64, (rank + 1) % nranks};
        b.call(make_call(kWorld, rank, seq++, p2p, time += 500));
      }
      b.call(make_call(kWorld, rank, seq++, calls[i], time += 1000, 700));
    }
    const std::string path = dir_ + "/rank" + std::to_string(rank) + ".trace";
    b.write(path);
    return path;
  }

  std::vector<std::string> write_ranks(int nranks, const std::vector<CallSpec>& calls) {
    std::vector<std::string> paths;
    for (int r = 0; r < nranks; ++r) paths.push_back(write_rank(r, nranks, calls));
    return paths;
  }

  std::string dir_;
};

std::vector<std::string> with(std::vector<std::string> head, const std::vector<std::string>& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

TEST_F(MagiceTrace, HelpListsEveryVerb) {
  const ToolRun run = tool({"--help"});
  EXPECT_EQ(run.status, 0);
  for (const char* verb : {"dump", "skeleton", "diff", "export", "decisions"}) {
    EXPECT_TRUE(contains(run.out, verb)) << verb;
    const ToolRun help = tool({verb, "--help"});
    EXPECT_EQ(help.status, 0) << verb;
    EXPECT_TRUE(contains(help.out, std::string("magice-trace ") + verb)) << help.out;
  }
}

// The library's settings come from its option table: each once, its default in its unit.
TEST_F(MagiceTrace, HelpListsEverySettingOnceWithItsDefault) {
  const ToolRun run = tool({"--help"});
  EXPECT_EQ(run.status, 0);
  auto line_of = [&](const std::string& name) {
    const size_t at = run.out.find("  " + name + " ");
    if (at == std::string::npos || run.out.find("  " + name + " ", at + 1) != std::string::npos)
      return std::string();
    return run.out.substr(at, run.out.find('\n', at) - at);
  };
  for (const OptionSpec& option : option_table())
    EXPECT_TRUE(contains(line_of(option.name), option.doc)) << option.name << " in:\n" << run.out;
  EXPECT_TRUE(contains(line_of("MAGI_LOG"), " default WARN ")) << run.out;
  EXPECT_TRUE(contains(line_of("MAGI_TRACE_DIR"), " default \"\" ")) << run.out;
  EXPECT_TRUE(contains(line_of("MAGI_TRACE_BUFFER_KIB"), " default 1024 KiB ")) << run.out;
  EXPECT_TRUE(contains(line_of("MAGI_BIND_MAX_MIB"), " default 16384 MiB ")) << run.out;
  EXPECT_TRUE(contains(line_of("MAGI_VERIFY_EVERY"), " default 64 ")) << run.out;
}

TEST_F(MagiceTrace, UnknownVerbOrOptionPrintsUsageAndExitsTwo) {
  const ToolRun verb = tool({"frobnicate"});
  EXPECT_EQ(verb.status, 2);
  EXPECT_TRUE(contains(verb.err, "usage:")) << verb.err;
  EXPECT_TRUE(verb.out.empty());

  const std::string file = write_rank(0, 1, periodic_sequence(2));
  const ToolRun option = tool({"diff", "--no-such-option", file});
  EXPECT_EQ(option.status, 2);
  EXPECT_TRUE(contains(option.err, "--no-such-option")) << option.err;
  EXPECT_TRUE(contains(option.err, "usage: magice-trace diff")) << option.err;

  EXPECT_EQ(tool({"skeleton", "--max-step", "1", file}).status, 2) << "below the option's range";
  EXPECT_EQ(tool({"export", "--chrome", file}).status, 2) << "no -o";
  EXPECT_EQ(tool({"dump"}).status, 2) << "no file";
}

TEST_F(MagiceTrace, DiffOfIdenticalRanksExitsZero) {
  const auto files = write_ranks(4, periodic_sequence(20));
  const ToolRun run = tool(with({"diff"}, files));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  EXPECT_TRUE(contains(run.out, "comm 3f2a0c1d9e7b: 4 ranks, 61 collectives each, identical"))
      << run.out;
}

TEST_F(MagiceTrace, DiffNamesTheFirstCollectiveWhoseShapeDiffers) {
  constexpr size_t kDivergent = 57;
  auto files = write_ranks(4, periodic_sequence(30));
  std::vector<CallSpec> changed = periodic_sequence(30);
  changed[kDivergent].count += 1;  // one rank gathers a differently sized shard
  changed[kDivergent + 5].count += 1;
  files[2] = write_rank(2, 4, changed);

  const ToolRun run = tool(with({"diff"}, files));
  EXPECT_EQ(run.status, 1) << run.out << run.err;
  EXPECT_TRUE(contains(run.out, "diverges at collective #" + std::to_string(kDivergent)))
      << run.out;
  // The divergent row is marked, with three calls of context before it; the agreeing ranks
  // share one block and the odd one is singled out.
  EXPECT_TRUE(contains(run.out, "> #" + std::to_string(kDivergent))) << run.out;
  EXPECT_TRUE(contains(run.out, "  ranks 0, 1, 3\n")) << run.out;
  EXPECT_TRUE(contains(run.out, "  rank 2 (" + files[2] + ")\n")) << run.out;
  EXPECT_TRUE(contains(run.out, "<-- differs")) << run.out;
  EXPECT_TRUE(contains(run.out, "  #" + std::to_string(kDivergent - 3))) << run.out;
  EXPECT_TRUE(contains(run.out, std::to_string(changed[kDivergent].count))) << run.out;
}

TEST_F(MagiceTrace, DiffReportsCallSitesThatDifferWhenShapesAgree) {
  constexpr size_t kMoved = 12;
  auto files = write_ranks(2, periodic_sequence(10));
  std::vector<CallSpec> moved = periodic_sequence(10);
  for (size_t i = kMoved; i < moved.size(); ++i) moved[i].callsite ^= 0x0101010100000000ull;
  files[1] = write_rank(1, 2, moved);

  const ToolRun run = tool(with({"diff"}, files));
  EXPECT_EQ(run.status, 1) << run.out << run.err;
  EXPECT_TRUE(contains(run.out, "call sites differ from collective #" + std::to_string(kMoved)))
      << run.out;
  EXPECT_FALSE(contains(run.out, "diverges")) << run.out;
  // Its row: collective #12 is call #13, after the Send or Recv each rank issued.
  EXPECT_TRUE(contains(run.out, "  > #12     call #13     ReduceScatter ")) << run.out;

  const ToolRun shapes = tool(with({"diff", "--shapes-only"}, files));
  EXPECT_EQ(shapes.status, 0) << shapes.out;
  EXPECT_TRUE(contains(shapes.out, "identical")) << shapes.out;
}

TEST_F(MagiceTrace, DiffReportsARankThatStoppedEarly) {
  auto files = write_ranks(3, periodic_sequence(10));
  std::vector<CallSpec> shorter = periodic_sequence(10);
  shorter.resize(shorter.size() - 4);
  files[1] = write_rank(1, 3, shorter);

  const ToolRun run = tool(with({"diff"}, files));
  EXPECT_EQ(run.status, 1) << run.out << run.err;
  EXPECT_TRUE(contains(run.out, "diverges at collective #" + std::to_string(shorter.size())))
      << run.out;
  EXPECT_TRUE(contains(run.out, "(no call)")) << run.out;
}

TEST_F(MagiceTrace, DiffReportsACommunicatorMissingFromARank) {
  auto files = write_ranks(2, periodic_sequence(3));
  // Rank 0 also created a 2-rank communicator that rank 1 never joined.
  TraceBuilder b(make_file_header(1000, "node0", "train"));
  b.comm(make_comm(kWorld, 0, 2));
  for (uint64_t seq = 0; seq < 10; ++seq) {
    b.call(make_call(kWorld, 0, seq, periodic_sequence(3)[seq]));
  }
  b.comm(make_comm(kHalf, 0, 2, CommOrigin::Split, kWorld));
  b.call(make_call(kHalf, 0, 0, CallSpec{}));
  b.write(files[0]);

  const ToolRun run = tool(with({"diff"}, files));
  EXPECT_EQ(run.status, 1) << run.out << run.err;
  EXPECT_TRUE(contains(run.out, "comm 3f2a0c1d9e7b: 2 ranks, 10 collectives each, identical"))
      << run.out;
  EXPECT_TRUE(contains(run.out, "comm 7c00ffee1234: 1 of 2 ranks (no file has rank 1)")) << run.out;
}

TEST_F(MagiceTrace, SkeletonFindsThePrologueAndTheRepeatingStep) {
  const std::string file = write_rank(1, 4, periodic_sequence(12));
  const ToolRun run = tool({"skeleton", file});
  EXPECT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(contains(run.out,
                       "comm 3f2a0c1d9e7b rank 1/4: prologue 1 call; "
                       "step of 3 calls × 12 repeats (collectives #1–#36)"))
      << run.out;
  // The step's calls, one per line.
  EXPECT_TRUE(contains(run.out, "AllGather     bfloat16      1048576")) << run.out;
  EXPECT_TRUE(contains(run.out, "ReduceScatter float32         65536  root -   redop sum"))
      << run.out;
}

TEST_F(MagiceTrace, SkeletonHonoursMaxStep) {
  const std::string file = write_rank(0, 2, periodic_sequence(12));
  const ToolRun run = tool({"skeleton", "--max-step", "2", file});
  EXPECT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(contains(run.out, "no repeating step")) << run.out;
}

TEST_F(MagiceTrace, DumpListsEveryCallAndFiltersByCommunicator) {
  TraceBuilder b(make_file_header(4242, "node9", "serve"));
  b.comm(make_comm(kWorld, 0, 2)).comm(make_comm(kHalf, 0, 1, CommOrigin::Split, kWorld));
  const Frame frames[] = {{0x1234'0000'0000'0000ull, 0x1a2b}, {0, 0}};
  b.callsite(0xa0000001'00000000ull, frames)
      .module(0x1234'0000'0000'0000ull, "/opt/lib/libtrain.so");
  b.call(make_call(kWorld, 0, 0, {Op::AllGather, 9, 111, -1, -1, 0xa0000001'00000000ull}));
  b.call(make_call(kHalf, 0, 0, {Op::AllReduce, 7, 222, -1, ncclMax, 0xa0000001'00000000ull}));
  b.call(make_call(kWorld, 0, 1, {Op::Send, 7, 333, 1, -1, 0}));
  b.comm_end({kWorld, 9000, 2, static_cast<uint8_t>(CommEndKind::Destroy), {}});
  const std::string file = dir_ + "/dump.trace";
  b.write(file);

  const ToolRun all = tool({"dump", file});
  EXPECT_EQ(all.status, 0) << all.err;
  EXPECT_TRUE(contains(all.out, "host node9 pid 4242 program serve")) << all.out;
  for (const char* count : {" 111 ", " 222 ", " 333 "}) {
    EXPECT_TRUE(contains(all.out, count)) << count;
  }
  EXPECT_TRUE(contains(all.out, "Destroy")) << all.out;
  EXPECT_TRUE(contains(all.out, "max")) << all.out;

  const ToolRun half = tool({"dump", "--comm", "7c00", "--frames", file});
  EXPECT_EQ(half.status, 0) << half.err;
  EXPECT_TRUE(contains(half.out, " 222 ")) << half.out;
  EXPECT_FALSE(contains(half.out, " 111 ")) << half.out;
  EXPECT_FALSE(contains(half.out, " 333 ")) << half.out;
  EXPECT_TRUE(contains(half.out, "libtrain.so+0x1a2b")) << half.out;
}

// `--comm` takes the id as logs and every output show it (the low 48 bits), any leading part of
// it, or the whole 64-bit id; digits of the id that are never shown select nothing.
TEST_F(MagiceTrace, DumpCommTakesTheIdAsShownOrWhole) {
  TraceBuilder b(make_file_header(4242, "node9", "serve"));
  b.comm(make_comm(kWorld, 0, 2)).comm(make_comm(kHalf, 0, 1, CommOrigin::Split, kWorld));
  b.call(make_call(kWorld, 0, 0, {Op::AllGather, 9, 111, -1, -1, 0}));
  b.call(make_call(kHalf, 0, 0, {Op::AllReduce, 7, 222, -1, ncclMax, 0}));
  const std::string file = dir_ + "/ids.trace";
  b.write(file);

  const ToolRun all = tool({"dump", file});
  EXPECT_EQ(all.status, 0) << all.err;
  // The split's row names it and its parent the same way.
  EXPECT_TRUE(test::has_line(all.out, "^  7c00ffee1234  .* Split +3f2a0c1d9e7b ")) << all.out;

  for (const char* id : {"7c00ffee1234", "7C00F", "0x7c00ffee1234", "6a1f7c00ffee1234"}) {
    const ToolRun half = tool({"dump", "--comm", id, file});
    EXPECT_EQ(half.status, 0) << id << ": " << half.err;
    EXPECT_TRUE(contains(half.out, " 222 ")) << id << ": " << half.out;
    EXPECT_FALSE(contains(half.out, " 111 ")) << id << ": " << half.out;
  }
  for (const char* id : {"6a1f", "6a1f7c00ffee", "5eed3f2a0c1d9e7c"}) {
    const ToolRun none = tool({"dump", "--comm", id, file});
    EXPECT_EQ(none.status, 0) << id << ": " << none.err;
    EXPECT_FALSE(contains(none.out, " 222 ")) << id << ": " << none.out;
    EXPECT_FALSE(contains(none.out, " 111 ")) << id << ": " << none.out;
  }
  for (const char* id : {"6a1f7c00ffee1", "7c00g", ""}) {
    const ToolRun bad = tool({"dump", "--comm", id, file});
    EXPECT_EQ(bad.status, 2) << id << ": " << bad.out;
    EXPECT_TRUE(contains(bad.err, "--comm wants")) << id << ": " << bad.err;
  }
}

TEST_F(MagiceTrace, ExportWritesChromeJsonThatParses) {
  auto files = write_ranks(2, periodic_sequence(4));
  // A host name with quotes, a control character and bytes that are not UTF-8 must not break it.
  TraceBuilder odd(make_file_header(7, "we\"ird\n\xff\xfe", "prog\\x"));
  odd.comm(make_comm(kWorld, 1, 2)).call(make_call(kWorld, 1, 0, CallSpec{}, 5'000'002'000ull));
  odd.step({kWorld, 0, 0, 0xd16e57, 2, 3, static_cast<uint8_t>(StepEvent::Found), {}});
  odd.write(files[1]);
  const std::string out = dir_ + "/trace.json";

  const ToolRun run = tool(with({"export", "--chrome", "-o", out}, files));
  ASSERT_EQ(run.status, 0) << run.err;
  // 14 calls on rank 0 (13 collectives and a Send) and 1 in the odd file, each a complete
  // event; the step an instant.
  const std::string check =
      "import json,sys\n"
      "d=json.load(open(sys.argv[1]))\n"
      "e=d['traceEvents']\n"
      "x=[v for v in e if v['ph']=='X']\n"
      "assert len(x)==15, len(x)\n"
      "assert all(v['ts']>=0 and v['dur']>0 and 'seq' in v['args'] for v in x)\n"
      "assert {v['pid'] for v in x}=={0,1}\n"
      "names=[v['args']['name'] for v in e if v['name']=='process_name']\n"
      "assert names[0]=='rank 0 (node0:1000)', names\n"
      "assert any(v['ph']=='i' and v['name']=='step found' for v in e)\n";
  if (access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "python3 is needed to check the JSON";
  const ToolRun parsed = run_program({"python3", "-c", check, out}, dir_);
  EXPECT_EQ(parsed.status, 0) << parsed.err << slurp(out).substr(0, 2000);
}

TEST_F(MagiceTrace, MalformedInputNamesFileAndOffsetAndExitsTwo) {
  const auto files = write_ranks(2, periodic_sequence(3));
  std::string bytes = slurp(files[1]);
  const size_t cut = bytes.size() - 8;  // inside the last call record
  bytes.resize(cut);
  std::ofstream(files[1], std::ios::binary | std::ios::trunc) << bytes;
  const size_t last_record = cut + 8 - (8 + sizeof(CallRecord));

  const std::string out = dir_ + "/never.json";
  for (const std::vector<std::string>& args :
       {with({"dump"}, files), with({"skeleton"}, files), with({"diff"}, files),
        with({"export", "--chrome", "-o", out}, files), with({"decisions"}, files)}) {
    SCOPED_TRACE(args[0]);
    const ToolRun run = tool(args);
    EXPECT_EQ(run.status, 2);
    const std::string where = std::to_string(last_record);
    EXPECT_TRUE(contains(run.err, "magice-trace: " + files[1] + ": offset " + where +
                                      ": truncated record at offset " + where))
        << run.err;
  }
  const ToolRun absent = tool({"diff", files[0], dir_ + "/absent.trace"});
  EXPECT_EQ(absent.status, 2);
  EXPECT_TRUE(contains(absent.err, dir_ + "/absent.trace")) << absent.err;
}

// ---- decisions ----

// One propose round as a rank records it: issued, read three collectives later, then one
// decision per gather.
struct RoundPlan {
  uint32_t round = 1;
  uint64_t read_at = 0;  // collective index of the read
  AgreementMode mode = AgreementMode::Identical;
  std::vector<DecisionSpec> gathers;
  Reason reason = Reason::None;
};

void add_round(TraceBuilder& b, uint64_t comm, int32_t rank, const RoundPlan& plan) {
  const auto gathers = static_cast<uint32_t>(plan.gathers.size());
  uint32_t moved = 0;
  for (const DecisionSpec& g : plan.gathers) moved += g.verdict != Verdict::Stays ? 1 : 0;
  b.agreement(make_agreement(comm, rank,
                             {plan.round, RoundKind::Propose, RoundEvent::Issued, plan.read_at - 3,
                              AgreementMode::None, gathers, 0}));
  b.agreement(make_agreement(comm, rank,
                             {plan.round, RoundKind::Propose, RoundEvent::Read, plan.read_at,
                              plan.mode, gathers, moved, plan.reason}));
  for (const DecisionSpec& g : plan.gathers) {
    b.decision(make_decision(comm, rank, plan.round, plan.mode, g));
  }
}

AgreementRecord route_change(uint64_t comm, int32_t rank, uint32_t round, RoundEvent event,
                             uint64_t at, Reason reason = Reason::None) {
  return make_agreement(comm, rank,
                        {round, RoundKind::Confirm, event, at, AgreementMode::Slot, 3, 2, reason});
}

// The step's three gathers as rank `rank` decides them in round 1 and 2: the middle one holds
// host memory on rank 0, so every other rank stays because rank 0 refused it.
std::vector<DecisionSpec> step_gathers(int32_t rank, Verdict moving = Verdict::Moved) {
  const DecisionSpec refused =
      rank == 0 ? DecisionSpec{3, Verdict::Stays, Reason::HostMemory, -1, 1}
                : DecisionSpec{3, Verdict::Stays, Reason::OtherRankRefused, 0, 1};
  return {{1, moving, Reason::None, -1, 0, 9, 1 << 20, 0xa1},
          refused,
          {5, moving, Reason::None, -1, 2, 9, 1 << 18, 0xa2}};
}

class MagiceTraceDecisions : public MagiceTrace {
 protected:
  // A rank that agreed twice: round 1 (identical) was activated and then deactivated by a
  // deviation; round 2 (slot) was activated. `last` rounds are written (0: only the comm).
  std::string write_agreeing_rank(int32_t rank, int32_t nranks, uint32_t last = 2,
                                  std::vector<DecisionSpec> round2 = {}) {
    if (round2.empty()) round2 = step_gathers(rank);
    TraceBuilder b(make_file_header(1000 + rank, "node0", "infer"));
    b.comm(make_comm(kWorld, rank, nranks));
    b.call(make_call(kWorld, rank, 0, CallSpec{}));
    if (last >= 1) {
      add_round(b, kWorld, rank, {1, 10, AgreementMode::Identical, step_gathers(rank)});
      b.agreement(route_change(kWorld, rank, 1, RoundEvent::Activated, 20));
      b.agreement(route_change(kWorld, rank, 1, RoundEvent::Deactivated, 40, Reason::Deviated));
    }
    if (last >= 2) {
      add_round(b, kWorld, rank, {2, 50, AgreementMode::Slot, round2});
      b.agreement(route_change(kWorld, rank, 2, RoundEvent::Activated, 60));
    }
    const std::string path = dir_ + "/agree" + std::to_string(rank) + ".trace";
    b.write(path);
    return path;
  }

  std::vector<std::string> write_agreeing_ranks(int32_t nranks) {
    std::vector<std::string> files;
    for (int32_t r = 0; r < nranks; ++r) files.push_back(write_agreeing_rank(r, nranks));
    return files;
  }
};

// In a Python program every gather has the same native call site; the decision names its
// gather's Python line, told apart by its position in the step.
TEST_F(MagiceTraceDecisions, NameEachGathersPythonLine) {
  TraceBuilder b(make_file_header(4242, "node0", "train"));
  b.comm(make_comm(kWorld, 0, 1));
  b.py_callsite(0xa0, {{"/home/u/model.py", "layer_a", 10}})
      .py_callsite(0xb0, {{"/home/u/model.py", "layer_b", 20}});
  for (uint64_t seq = 0; seq < 4; ++seq) {
    b.call(make_call(kWorld, 0, seq, {Op::AllGather, 9, 1 << 20, -1, -1, 0xa1}));
    b.py_call({kWorld, seq, seq % 2 == 0 ? 0xa0u : 0xb0u, 0, 0});
  }
  b.step({kWorld, 3, 0, 0xd16e57, 2, 2, static_cast<uint8_t>(StepEvent::Found), {}});
  add_round(b, kWorld, 0,
            {1,
             10,
             AgreementMode::Identical,
             {{0, Verdict::Moved, Reason::None, -1, 0, 9, 1 << 20, 0xa1},
              {1, Verdict::Moved, Reason::None, -1, 1, 9, 1 << 20, 0xa1}}});
  const std::string file = dir_ + "/py-decisions.trace";
  b.write(file);
  const ToolRun run = tool({"decisions", file});
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  EXPECT_TRUE(contains(run.out,
                       "(pos 0, bfloat16 x 1048576, bucket 0): moved  at "
                       "/home/u/model.py:10 in layer_a\n"))
      << run.out;
  EXPECT_TRUE(contains(run.out,
                       "(pos 1, bfloat16 x 1048576, bucket 1): moved  at "
                       "/home/u/model.py:20 in layer_b\n"))
      << run.out;
}

TEST_F(MagiceTraceDecisions, PrintsTheLastRoundOfEveryRankGatherByGather) {
  const ToolRun run = tool(with({"decisions"}, write_agreeing_ranks(3)));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  const std::string c = "comm 3f2a0c1d9e7b ";
  std::string expected;
  for (int r = 0; r < 3; ++r) {
    const std::string who = c + "rank " + std::to_string(r) + ": ";
    expected += who + "round 2 propose: mode slot, 2 of 3 gathers move\n";
    expected += who + "round 2 activated at collective #60: 2 of 3 gathers leave NCCL\n";
  }
  for (int r = 0; r < 3; ++r) {
    expected += c + "rank " + std::to_string(r) +
                " gather #0 (pos 1, bfloat16 x 1048576, bucket 0): moved\n";
  }
  expected += c + "rank 0 gather #1 (pos 3, float32 x 1024, bucket 1): stays: host memory\n";
  for (int r = 1; r < 3; ++r) {
    expected += c + "rank " + std::to_string(r) +
                " gather #1 (pos 3, float32 x 1024, bucket 1): stays: another rank refused it "
                "(rank 0)\n";
  }
  for (int r = 0; r < 3; ++r) {
    expected += c + "rank " + std::to_string(r) +
                " gather #2 (pos 5, bfloat16 x 262144, bucket 2): moved\n";
  }
  EXPECT_EQ(run.out, expected);
  EXPECT_TRUE(run.err.empty()) << run.err;
}

// A plan spanning machines: each rank's moved gather names the two levels and its
// sub-communicator (its local index); a communicator whose machines are uneven says why it stays.
TEST_F(MagiceTraceDecisions, NameTheTwoLevelsAndEachRanksSubCommunicator) {
  std::vector<std::string> files;
  for (int32_t rank = 0; rank < 4; ++rank) {
    TraceBuilder b(make_file_header(2000 + rank, rank < 2 ? "node0" : "node1", "train"));
    b.comm(make_comm(kWorld, rank, 4));
    b.call(make_call(kWorld, rank, 0, CallSpec{}));
    b.agreement(make_agreement(
        kWorld, rank,
        {1, RoundKind::Propose, RoundEvent::Read, 10, AgreementMode::Identical, 2, 1}));
    DecisionRecord moved =
        make_decision(kWorld, rank, 1, AgreementMode::Identical, {1, Verdict::Moved});
    moved.machines = 2;
    moved.sub_comm = static_cast<uint8_t>(rank % 2);
    b.decision(moved);
    b.decision(make_decision(kWorld, rank, 1, AgreementMode::Identical,
                             {3, Verdict::Stays, Reason::MachinesUneven, -1, 1}));
    files.push_back(dir_ + "/machines" + std::to_string(rank) + ".trace");
    b.write(files.back());
  }
  const ToolRun run = tool(with({"decisions"}, files));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(contains(run.out, "rank " + std::to_string(rank) +
                                      " gather #0 (pos 1, float32 x 1024, bucket 0): moved in two "
                                      "levels (NCCL between 2 machines on the sub-communicator of "
                                      "local index " +
                                      std::to_string(rank % 2) + ", the transport inside)\n"))
        << run.out;
    EXPECT_TRUE(contains(run.out, "rank " + std::to_string(rank) +
                                      " gather #1 (pos 3, float32 x 1024, bucket 1): stays: the "
                                      "ranks span machines holding different numbers of them"))
        << run.out;
  }
  const ToolRun json = tool(with({"decisions", "--json"}, files));
  EXPECT_EQ(json.status, 0) << json.out << json.err;
  EXPECT_TRUE(contains(json.out, "\"refused_by\":null,\"machines\":2,\"sub_comm\":1}")) << json.out;
  EXPECT_FALSE(contains(json.out, "\"machines\":0")) << json.out;  // said only where it spans
}

TEST_F(MagiceTraceDecisions, AllPrintsEveryRoundWithItsRouteChanges) {
  const ToolRun run = tool(with({"decisions", "--all"}, write_agreeing_ranks(2)));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  const std::string c = "comm 3f2a0c1d9e7b rank 1";
  const std::vector<std::string> in_order = {
      c + ": round 1 propose: mode identical, 2 of 3 gathers move\n",
      c + ": round 1 activated at collective #20: 2 of 3 gathers leave NCCL\n",
      c + ": round 1 deactivated at collective #40: back to NCCL (the call deviated from the "
          "agreed step)\n",
      c + " gather #2 (pos 5, bfloat16 x 262144, bucket 2): moved\n",
      c + ": round 2 propose: mode slot, 2 of 3 gathers move\n",
      c + ": round 2 activated at collective #60: 2 of 3 gathers leave NCCL\n",
      c + " gather #2 (pos 5, bfloat16 x 262144, bucket 2): moved\n",
  };
  size_t at = 0;
  for (const std::string& line : in_order) {
    const size_t found = run.out.find(line, at);
    ASSERT_NE(found, std::string::npos) << "missing, or out of order: " << line << run.out;
    at = found + line.size();
  }
  // Without --all only round 2 is shown, so the deactivation of round 1 is not.
  const ToolRun last = tool(with({"decisions"}, write_agreeing_ranks(2)));
  EXPECT_EQ(last.status, 0) << last.out;
  EXPECT_FALSE(contains(last.out, "round 1")) << last.out;
  EXPECT_FALSE(contains(last.out, "deactivated")) << last.out;
}

TEST_F(MagiceTraceDecisions, RanksWithDifferentVerdictsExitOne) {
  auto files = write_agreeing_ranks(3);
  std::vector<DecisionSpec> odd = step_gathers(2);
  odd[2].verdict = Verdict::Stays;  // rank 2 keeps on NCCL what ranks 0 and 1 move
  odd[2].reason = Reason::NotStable;
  files[2] = write_agreeing_rank(2, 3, 2, odd);

  const ToolRun run = tool(with({"decisions"}, files));
  EXPECT_EQ(run.status, 1) << run.out << run.err;
  EXPECT_TRUE(contains(run.out,
                       "ranks disagree on comm 3f2a0c1d9e7b gather #2 (round 2, pos 5): moved on "
                       "ranks 0, 1; stays on rank 2\n"))
      << run.out;
  EXPECT_FALSE(contains(run.out, "gather #0 (round")) << "gathers that agree are not reported";
  EXPECT_TRUE(contains(run.out,
                       "rank 2 gather #2 (pos 5, bfloat16 x 262144, bucket 2): stays: "
                       "not stable for MAGI_WARMUP_STEPS steps"))
      << run.out;
}

TEST_F(MagiceTraceDecisions, AGatherOnlySomeRanksHaveDisagreesOnlyIfItLeavesNccl) {
  auto files = write_agreeing_ranks(2);
  // Rank 1 has an extra gather at position 7 that stays: harmless, the ranks' routes match.
  std::vector<DecisionSpec> extra = step_gathers(1);
  extra.push_back({7, Verdict::Stays, Reason::ShardTooSmall, -1, 3});
  files[1] = write_agreeing_rank(1, 2, 2, extra);
  const ToolRun harmless = tool(with({"decisions"}, files));
  EXPECT_EQ(harmless.status, 0) << harmless.out;
  EXPECT_TRUE(contains(harmless.out,
                       "rank 1 gather #3 (pos 7, float32 x 1024, bucket 3): stays: "
                       "shard below MAGI_SYMM_MIN_SHARD_MIB\n"))
      << harmless.out;

  // The same extra gather moving on rank 1 alone would leave rank 0 waiting in NCCL.
  extra.back() = {7, Verdict::Moved, Reason::None, -1, 3};
  files[1] = write_agreeing_rank(1, 2, 2, extra);
  const ToolRun moving = tool(with({"decisions"}, files));
  EXPECT_EQ(moving.status, 1) << moving.out;
  EXPECT_TRUE(contains(moving.out,
                       "ranks disagree on comm 3f2a0c1d9e7b gather #3 (round 2, pos 7): moved on "
                       "rank 1; no gather there on rank 0\n"))
      << moving.out;
}

TEST_F(MagiceTraceDecisions, RanksThatReadDifferentRoundsExitOne) {
  auto files = write_agreeing_ranks(3);
  files[2] = write_agreeing_rank(2, 3, 1);  // rank 2's trace ends before round 2 was read
  const ToolRun run = tool(with({"decisions"}, files));
  EXPECT_EQ(run.status, 1) << run.out << run.err;
  EXPECT_TRUE(contains(run.out, "comm 3f2a0c1d9e7b rank 2: round 1 propose: mode identical"))
      << run.out;
  EXPECT_TRUE(contains(run.out,
                       "ranks disagree on comm 3f2a0c1d9e7b: last round read is 2 on ranks 0, 1; "
                       "1 on rank 2\n"))
      << run.out;

  const ToolRun all = tool(with({"decisions", "--all"}, files));
  EXPECT_EQ(all.status, 1) << all.out;
  EXPECT_TRUE(contains(all.out, "comm 3f2a0c1d9e7b rank 2: round 2 not read\n")) << all.out;
  EXPECT_TRUE(contains(all.out,
                       "ranks disagree on comm 3f2a0c1d9e7b round 2: read on ranks 0, "
                       "1; not on rank 2\n"))
      << all.out;
  EXPECT_FALSE(contains(all.out, "round 1: ")) << "round 1 was read alike on every rank";
}

TEST_F(MagiceTraceDecisions, ACommitThatFailedIsShownAfterItsRound) {
  std::vector<std::string> files;
  for (int32_t r = 0; r < 2; ++r) {
    TraceBuilder b(make_file_header(1000 + r, "node0", "infer"));
    b.comm(make_comm(kWorld, r, 2));
    add_round(b, kWorld, r, {1, 10, AgreementMode::Identical, step_gathers(r)});
    b.agreement(make_agreement(kWorld, r, {1, RoundKind::Publish, RoundEvent::Issued, 10}));
    b.agreement(make_agreement(kWorld, r,
                               {1, RoundKind::Publish, RoundEvent::Read, 13,
                                AgreementMode::Identical, 3, 0, Reason::TransportFailed}));
    files.push_back(dir_ + "/commit" + std::to_string(r) + ".trace");
    b.write(files.back());
  }
  const ToolRun run = tool(with({"decisions"}, files));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  EXPECT_TRUE(contains(run.out,
                       "comm 3f2a0c1d9e7b rank 1: round 1 propose: mode identical, 2 of 3 gathers "
                       "move\n"
                       "comm 3f2a0c1d9e7b rank 1: round 1 publish read at collective #13: nothing "
                       "leaves NCCL (the transport failed on some rank)\n"))
      << run.out;
  EXPECT_FALSE(contains(run.out, "activated")) << run.out;
}

// The cost round after a trial of both routes: its lines say what it did to the routes the
// activation set, so that the two read alike (not "nothing leaves NCCL" and then "3 of 4 gathers
// leave NCCL" at the same collective). `kept`: the gathers that keep moving, of 4 moved.
std::string write_cost_round(const std::string& dir, int32_t rank, uint32_t kept,
                             Reason reason = Reason::NcclFaster) {
  TraceBuilder b(make_file_header(1000 + rank, "node0", "infer"));
  b.comm(make_comm(kWorld, rank, 2));
  std::vector<DecisionSpec> gathers;
  for (uint16_t g = 0; g < 4; ++g) gathers.push_back({g, Verdict::Moved, Reason::None, -1, g});
  add_round(b, kWorld, rank, {1, 10, AgreementMode::Identical, gathers});
  b.agreement(make_agreement(
      kWorld, rank,
      {1, RoundKind::Confirm, RoundEvent::Activated, 20, AgreementMode::Identical, 4, 4}));
  b.agreement(make_agreement(kWorld, rank, {1, RoundKind::Cost, RoundEvent::Issued, 66}));
  b.agreement(make_agreement(
      kWorld, rank,
      {1, RoundKind::Cost, RoundEvent::Read, 70, AgreementMode::Identical, 4, kept, reason}));
  if (reason == Reason::NcclFaster) {
    // The cost round re-decides its gathers: those after the kept ones stay, NCCL being faster.
    for (uint16_t g = static_cast<uint16_t>(kept); g < 4; ++g)
      b.decision(make_decision(kWorld, rank, 1, AgreementMode::Identical,
                               {g, Verdict::Stays, Reason::NcclFaster, -1, g}));
    b.agreement(make_agreement(kWorld, rank,
                               {1, kept == 0 ? RoundKind::Propose : RoundKind::Cost,
                                kept == 0 ? RoundEvent::Deactivated : RoundEvent::Activated, 70,
                                AgreementMode::Identical, 4, kept, Reason::NcclFaster}));
  }
  const std::string path = dir + "/cost" + std::to_string(rank) + ".trace";
  b.write(path);
  return path;
}

TEST_F(MagiceTraceDecisions, TheCostRoundSaysWhatWentBackToNcclAndWhatKeptMoving) {
  const std::vector<std::string> files = {write_cost_round(dir_, 0, 3),
                                          write_cost_round(dir_, 1, 3)};
  const ToolRun run = tool(with({"decisions"}, files));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  const std::string c = "comm 3f2a0c1d9e7b rank 1: round 1 ";
  EXPECT_TRUE(
      contains(run.out, c + "activated at collective #20: 4 of 4 gathers leave NCCL\n" + c +
                            "cost read at collective #70: timed both ways: 1 gather back to NCCL "
                            "(NCCL was faster for its bucket), 3 keep leaving it\n" +
                            c +
                            "cost activated at collective #70: 3 of 4 gathers leave NCCL, 1 "
                            "back on NCCL\n"))
      << run.out;
  EXPECT_TRUE(contains(run.out,
                       "rank 1 gather #3 (pos 3, float32 x 1024, bucket 3): stays: NCCL was "
                       "faster for its bucket (timed both ways)\n"))
      << run.out;
  EXPECT_FALSE(contains(run.out, "nothing leaves NCCL")) << run.out;
  const ToolRun json = tool(with({"decisions", "--json"}, files));
  EXPECT_TRUE(contains(json.out,
                       "{\"round\":1,\"kind\":\"cost\",\"event\":\"read\","
                       "\"collective\":70,\"moved\":3,\"gathers\":4,"))
      << json.out;
}

TEST_F(MagiceTraceDecisions, TheCostRoundThatKeepsNothingSendsEveryGatherBack) {
  const ToolRun run =
      tool(with({"decisions"}, {write_cost_round(dir_, 0, 0), write_cost_round(dir_, 1, 0)}));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  const std::string c = "comm 3f2a0c1d9e7b rank 0: round 1 ";
  EXPECT_TRUE(
      contains(run.out, c +
                            "cost read at collective #70: timed both ways: all 4 gathers back to "
                            "NCCL (NCCL was faster for their buckets)\n" +
                            c +
                            "deactivated at collective #70: back to NCCL (NCCL was faster "
                            "for its bucket (timed both ways))\n"))
      << run.out;
  EXPECT_FALSE(contains(run.out, "keep leaving")) << run.out;
}

TEST_F(MagiceTraceDecisions, ACostRoundLeftUntimedSaysThePlanStands) {
  const ToolRun run =
      tool(with({"decisions"}, {write_cost_round(dir_, 0, 4, Reason::AnchorInGroup),
                                write_cost_round(dir_, 1, 4, Reason::AnchorInGroup)}));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  EXPECT_TRUE(contains(run.out,
                       "comm 3f2a0c1d9e7b rank 0: round 1 cost read at collective #70: not timed "
                       "(the cost round was issued inside an open group on some rank): the plan "
                       "stands, 4 gathers keep leaving NCCL\n"))
      << run.out;
  EXPECT_FALSE(contains(run.out, "nothing leaves NCCL")) << run.out;
}

// A communicator kept on NCCL by its settings check: no round read, and each rank that read the
// hello says why; the rank that never read it (MAGI_TRANSPORT=nccl) is no disagreement.
TEST_F(MagiceTraceDecisions, SettingsThatDifferAreShownPerRank) {
  std::vector<std::string> files;
  for (int32_t r = 0; r < 3; ++r) {
    TraceBuilder b(make_file_header(1000 + r, "node0", "infer"));
    b.comm(make_comm(kWorld, r, 3));
    b.call(make_call(kWorld, r, 0, CallSpec{}));
    b.agreement(make_agreement(kWorld, r, {0, RoundKind::Hello, RoundEvent::Issued, 0}));
    if (r != 1)
      b.agreement(make_agreement(kWorld, r,
                                 {0, RoundKind::Hello, RoundEvent::Read, 9, AgreementMode::None, 0,
                                  0, Reason::SettingsDiffer}));
    files.push_back(dir_ + "/hello" + std::to_string(r) + ".trace");
    b.write(files.back());
  }
  const ToolRun run = tool(with({"decisions"}, files));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  for (const int r : {0, 2})
    EXPECT_TRUE(contains(run.out, "comm 3f2a0c1d9e7b rank " + std::to_string(r) +
                                      ": round 0 hello read at collective #9: nothing leaves "
                                      "NCCL (the ranks' schedule settings differ"))
        << run.out;
  EXPECT_FALSE(contains(run.out, "rank 1: round 0")) << run.out;
  const ToolRun json = tool(with({"decisions", "--json"}, files));
  EXPECT_EQ(json.status, 0) << json.out << json.err;
  EXPECT_TRUE(contains(json.out, "\"hello_refused\":[{\"rank\":0,\"collective\":9,")) << json.out;
}

TEST_F(MagiceTraceDecisions, DryRunRoundsSayWouldMove) {
  std::vector<std::string> files;
  for (int32_t r = 0; r < 2; ++r) {
    files.push_back(write_agreeing_rank(r, 2, 2, step_gathers(r, Verdict::WouldMove)));
  }
  const ToolRun run = tool(with({"decisions"}, files));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  EXPECT_TRUE(contains(run.out, "rank 0: round 2 propose: mode slot, 2 of 3 gathers would move\n"))
      << run.out;
  EXPECT_TRUE(contains(run.out,
                       "rank 1 gather #0 (pos 1, bfloat16 x 1048576, bucket 0): would "
                       "move\n"))
      << run.out;
}

TEST_F(MagiceTraceDecisions, TracesWithoutAgreementSayNoRoundsPerCommunicator) {
  auto files = write_ranks(2, periodic_sequence(3));
  TraceBuilder b(make_file_header(1000, "node0", "train"));
  b.comm(make_comm(kWorld, 0, 2)).comm(make_comm(kHalf, 0, 1, CommOrigin::Split, kWorld));
  b.call(make_call(kHalf, 0, 0, CallSpec{}));
  b.write(files[0]);
  const ToolRun run = tool(with({"decisions"}, files));
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  EXPECT_EQ(run.out,
            "comm 3f2a0c1d9e7b: no agreement rounds\n"
            "comm 7c00ffee1234: no agreement rounds\n");

  const ToolRun all = tool(with({"decisions", "--all"}, files));
  EXPECT_EQ(all.status, 0) << all.out;
  EXPECT_EQ(all.out, run.out);
}

TEST_F(MagiceTraceDecisions, JsonHoldsTheSameRoundsAndParses) {
  auto files = write_agreeing_ranks(2);
  std::vector<DecisionSpec> odd = step_gathers(1);
  odd[0].verdict = Verdict::Stays;
  files[1] = write_agreeing_rank(1, 2, 2, odd);
  const ToolRun run = tool(with({"decisions", "--json"}, files));
  EXPECT_EQ(run.status, 1) << run.out << run.err;
  const std::string json = dir_ + "/decisions.json";
  std::ofstream(json) << run.out;
  const std::string check =
      "import json,sys\n"
      "d=json.load(open(sys.argv[1]))\n"
      "assert d['agree'] is False\n"
      "[c]=d['communicators']\n"
      "assert c['comm']=='3f2a0c1d9e7b', c['comm']\n"
      "r=[(x['rank'],x['round'],x['mode']) for x in c['rounds']]\n"
      "assert r==[(0,2,'slot'),(1,2,'slot')], r\n"
      "g=c['rounds'][1]['decisions']\n"
      "assert [x['verdict'] for x in g]==['stays','stays','moved'], g\n"
      "assert g[1]['refused_by']==0 and g[1]['reason']=='another rank refused it', g[1]\n"
      "assert c['rounds'][0]['route_changes'][0]['event']=='activated'\n"
      "assert len(c['disagreements'])==1 and 'gather #0' in c['disagreements'][0]\n";
  if (access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "python3 is needed to check the JSON";
  const ToolRun parsed = run_program({"python3", "-c", check, json}, dir_);
  EXPECT_EQ(parsed.status, 0) << parsed.err << run.out;
}

TEST_F(MagiceTraceDecisions, DumpShowsAgreementRecordsAndMovedCalls) {
  TraceBuilder b(make_file_header(4242, "node9", "serve"));
  b.comm(make_comm(kWorld, 0, 2));
  CallRecord moved = make_call(kWorld, 0, 0, {Op::AllGather, 9, 111, -1, -1, 0});
  moved.flags = kCallMoved;
  CallRecord dry = make_call(kWorld, 0, 1, {Op::AllGather, 9, 222, -1, -1, 0});
  dry.flags = kCallWouldMove;
  b.call(moved).call(dry).call(make_call(kWorld, 0, 2, {Op::AllReduce, 7, 333, -1, 0, 0}));
  add_round(b, kWorld, 0,
            {4,
             30,
             AgreementMode::Abort,
             {{2, Verdict::Stays, Reason::StepsDiffer}},
             Reason::StepsDiffer});
  const std::string file = dir_ + "/dump.trace";
  b.write(file);

  const ToolRun run = tool({"dump", file});
  EXPECT_EQ(run.status, 0) << run.err;
  std::istringstream lines(run.out);
  std::string line, calls[3];
  while (std::getline(lines, line)) {
    for (int i = 0; i < 3; ++i) {
      if (contains(line, " " + std::to_string(111 * (i + 1)) + " ")) calls[i] = line;
    }
  }
  EXPECT_TRUE(calls[0].ends_with("  moved")) << calls[0];
  EXPECT_TRUE(calls[1].ends_with("  would move")) << calls[1];
  EXPECT_FALSE(contains(calls[2], "move")) << calls[2];
  // One line per record: the issue and the read of round 4, and its one decision.
  EXPECT_TRUE(contains(run.out, "propose   issued")) << run.out;
  EXPECT_TRUE(contains(run.out, "propose   read  ")) << run.out;
  EXPECT_TRUE(contains(run.out, "abort")) << run.out;
  EXPECT_TRUE(contains(run.out, "abort: the ranks' steps differ")) << run.out;
  EXPECT_TRUE(contains(run.out, "stays: abort: the ranks' steps differ")) << run.out;

  const ToolRun decisions = tool({"decisions", file});
  EXPECT_EQ(decisions.status, 0) << decisions.out;
  EXPECT_TRUE(contains(decisions.out,
                       "comm 3f2a0c1d9e7b rank 0: round 4 propose: mode abort, 0 of 1 gathers "
                       "move (abort: the ranks' steps differ)\n"))
      << decisions.out;
}

TEST_F(MagiceTraceDecisions, DumpShowsWhatEachPlansWindowTook) {
  TraceBuilder b(make_file_header(4242, "node9", "serve"));
  b.comm(make_comm(kWorld, 1, 4));
  WindowRecord w{};
  w.comm_id = kWorld;
  w.seq = 57;
  w.window_bytes = 2097152;
  w.bound_bytes = 4096;
  w.exported_bytes = 12288;
  w.round = 3;
  w.rank = 1;
  w.bound_shards = 1;
  w.exported_shards = 3;
  w.exported_allocations = 2;
  w.peer_mappings = 6;
  w.mode = static_cast<uint8_t>(AgreementMode::Identical);
  b.window(w);
  WindowRefusalRecord why{};
  why.comm_id = kWorld;
  why.bytes = 4096;
  why.first = 2;
  why.round = 3;
  why.rank = 1;
  why.shards = 1;
  b.window_refusal(why, "memory from a pool");
  const std::string file = dir_ + "/windows.trace";
  b.write(file);

  const ToolRun run = tool({"dump", file});
  EXPECT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(contains(run.out, "windows\n")) << run.out;
  // One row: rank, round, collective, mode, window bytes, exported (shards in allocations),
  // bound (shards), mappings.
  std::istringstream lines(run.out);
  std::string line, row;
  while (std::getline(lines, line))
    if (contains(line, "2097152")) row = line;
  for (const char* field : {" 1 ", " 3 ", " 57 ", "identical", "12288 (3 in 2)", "4096 (1)", " 6"})
    EXPECT_TRUE(contains(row, field)) << field << " missing from: " << row;
  // And why the bound shard was copied, counted by reason.
  EXPECT_TRUE(contains(run.out,
                       "bound 1 shards (4096 bytes; the first: gather 2 of the plan): "
                       "memory from a pool\n"))
      << run.out;
}

TEST_F(MagiceTraceDecisions, SaysPerRankHowManyGathersLeftNcclAndHowManyFellBack) {
  TraceBuilder b(make_file_header(4242, "node9", "serve"));
  b.comm(make_comm(kWorld, 1, 2));
  // 4 all-gathers of 8 float32 (32 bytes each): #3 and #5 moved, #4 fell back; one all-reduce.
  for (uint64_t seq = 2; seq < 6; ++seq) {
    CallRecord call = make_call(kWorld, 1, seq, {Op::AllGather, 7, 8, -1, -1, 0});
    if (seq == 3 || seq == 5) call.flags = kCallMoved;
    if (seq == 4) call.flags = kCallFellBack;
    b.call(call);
  }
  b.call(make_call(kWorld, 1, 6, {Op::AllReduce, 7, 8, -1, 0, 0}));
  const std::string file = dir_ + "/coverage.trace";
  b.write(file);
  const ToolRun run = tool({"decisions", file});
  EXPECT_EQ(run.status, 0) << run.err;
  // The file starts at call #2: how many collectives came before is unknown, so the first moved
  // is named by its seq, and dump shows its collective index as unknown.
  EXPECT_TRUE(contains(run.out,
                       "comm 3f2a0c1d9e7b rank 1: 2 of 4 all-gathers (64 of 128 bytes sent) "
                       "served off NCCL, 1 fell back to NCCL; the first at call #3\n"))
      << run.out;
  const ToolRun dump = tool({"dump", file});
  EXPECT_EQ(dump.status, 0) << dump.err;
  EXPECT_TRUE(contains(dump.out, "  fell back\n")) << dump.out;
  EXPECT_TRUE(contains(dump.out, "  moved\n")) << dump.out;
  EXPECT_TRUE(contains(dump.out, "  3f2a0c1d9e7b         3  AllGather              ?  float32"))
      << dump.out;
}

// A call's seq counts Send and Recv, its collective index does not: the first moved gather is
// "collective #N" by the index, as the library's end-of-communicator line names it, and dump
// and export show both numbers of every call.
TEST_F(MagiceTraceDecisions, NamesTheFirstMovedGatherByItsCollectiveIndexNotItsSeq) {
  TraceBuilder b(make_file_header(4242, "node9", "serve"));
  b.comm(make_comm(kWorld, 0, 2));
  b.call(make_call(kWorld, 0, 0, {Op::AllReduce, 7, 8, -1, 0, 0}));
  b.call(make_call(kWorld, 0, 1, {Op::Send, 7, 8, 1, -1, 0}));
  b.call(make_call(kWorld, 0, 2, {Op::Recv, 7, 8, 1, -1, 0}));
  for (uint64_t seq = 3; seq < 6; ++seq) {
    CallRecord call = make_call(kWorld, 0, seq, {Op::AllGather, 7, 8, -1, -1, 0});
    if (seq >= 4) call.flags = kCallMoved;
    b.call(call);
  }
  const std::string file = dir_ + "/numbers.trace";
  b.write(file);

  const ToolRun run = tool({"decisions", file});
  EXPECT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(
      contains(run.out, "served off NCCL, 0 fell back to NCCL; the first at collective #2\n"))
      << run.out;

  const ToolRun dump = tool({"dump", file});
  EXPECT_EQ(dump.status, 0) << dump.err;
  EXPECT_TRUE(contains(dump.out, "  comm              call  op            collective  dtype"))
      << dump.out;
  EXPECT_TRUE(contains(dump.out, "  3f2a0c1d9e7b         1  Send                   -  float32"))
      << dump.out;
  EXPECT_TRUE(contains(dump.out, "  3f2a0c1d9e7b         4  AllGather              2  float32"))
      << dump.out;

  const ToolRun json = tool({"export", "--chrome", file, "-o", "-"});
  EXPECT_EQ(json.status, 0) << json.err;
  EXPECT_TRUE(contains(json.out, "\"seq\":4,\"collective\":2,")) << json.out;
  EXPECT_TRUE(contains(json.out, "\"seq\":1,\"callsite\"")) << json.out;
}

TEST_F(MagiceTraceDecisions, TruncatedDecisionRecordExitsTwo) {
  const std::string file = write_agreeing_rank(0, 1);
  std::string bytes = slurp(file);
  bytes.resize(bytes.size() - 8);  // the last record: round 2's activation
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  const ToolRun run = tool({"decisions", file});
  EXPECT_EQ(run.status, 2);
  EXPECT_TRUE(contains(run.err, file + ": offset ")) << run.err;
  EXPECT_TRUE(contains(run.err, "truncated record")) << run.err;
}

// ---- call sites a person can read (tools/magice-trace/symbols.h) ------------------------------

std::string build_dir() {
  const char* dir = std::getenv("TEST_BUILD_DIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : "build");
}

uint64_t record_frames(void* context) {
  auto* frames = static_cast<std::vector<Frame>*>(context);
  frames->resize(16);
  int count = 0;
  const uint64_t key = capture::callsite_fingerprint(16, *frames, &count);
  frames->resize(static_cast<size_t>(count));
  return key;
}

// The frames of a real call made through libcallsite_probe.so (built with -g), as the library
// records them, in a trace that names their modules as the library does.
class SymbolizedFrames : public MagiceTrace {
 protected:
  void SetUp() override {
    MagiceTrace::SetUp();
    const std::string probe = build_dir() + "/tests/support/libcallsite_probe.so";
    handle_ = dlopen(probe.c_str(), RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(handle_, nullptr) << dlerror();
    using ProbePath = uint64_t (*)(uint64_t(*)(void*), void*);
    auto path_a = reinterpret_cast<ProbePath>(dlsym(handle_, "magi_probe_path_a"));
    ASSERT_NE(path_a, nullptr);
    callsite_ = path_a(record_frames, &frames_);
    ASSERT_GE(frames_.size(), 2u);
  }
  void TearDown() override {
    if (handle_ != nullptr) dlclose(handle_);
    MagiceTrace::TearDown();
  }

  // `rename` replaces the probe library's recorded path, `build_id` its recorded build-id.
  std::string write(const std::string& rename = "", const std::string* build_id = nullptr) {
    TraceBuilder b(make_file_header(4242, "node0", "train"));
    b.comm(make_comm(kWorld, 0, 1));
    b.callsite(callsite_, frames_);
    for (size_t i = 0; i < frames_.size(); ++i) {
      const capture::ModuleIdentity identity = capture::module_identity(frames_[i].module);
      const bool probe = i == 0;
      b.module(frames_[i].module, probe && !rename.empty() ? rename : identity.path,
               probe && build_id != nullptr ? *build_id : identity.build_id);
      if (probe) probe_build_id_ = identity.build_id;
    }
    b.call(make_call(kWorld, 0, 0, {Op::AllGather, 9, 111, -1, -1, callsite_}));
    const std::string file = dir_ + "/frames.trace";
    b.write(file);
    return file;
  }

  void* handle_ = nullptr;
  std::vector<Frame> frames_;
  uint64_t callsite_ = 0;
  std::string probe_build_id_;
};

TEST_F(SymbolizedFrames, NameFunctionFileAndLineWhereTheBinaryIsHere) {
  const ToolRun run = tool({"dump", "--frames", write()});
  ASSERT_EQ(run.status, 0) << run.err;
  // The call in magi_probe_path_a (tests/capture/callsite_probe_lib.cc, line 23), then the test
  // program's own frame, demangled.
  EXPECT_TRUE(contains(run.out, "magi_probe_path_a (callsite_probe_lib.cc:23)")) << run.out;
  EXPECT_TRUE(contains(run.out, "SymbolizedFrames::SetUp() (magice_trace_test.cc:")) << run.out;
  EXPECT_FALSE(contains(run.out, "libcallsite_probe.so+0x")) << run.out;
}

TEST_F(SymbolizedFrames, NoSymbolsPrintsModuleAndOffset) {
  const ToolRun run = tool({"dump", "--no-symbols", "--frames", write()});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(contains(run.out, "libcallsite_probe.so+0x")) << run.out;
  EXPECT_FALSE(contains(run.out, "magi_probe_path_a")) << run.out;
}

TEST_F(SymbolizedFrames, FallBackWhenTheBinaryIsAbsentOrAnotherBuild) {
  const ToolRun absent = tool({"dump", "--frames", write("/nonexistent/lib/libgone.so")});
  ASSERT_EQ(absent.status, 0) << absent.err;
  EXPECT_TRUE(contains(absent.out, "libgone.so+0x")) << absent.out;
  EXPECT_FALSE(contains(absent.out, "magi_probe_path_a")) << absent.out;

  ASSERT_FALSE(probe_build_id_.empty()) << "the probe library is linked with a build-id";
  const std::string other(probe_build_id_.size(), '\x5a');
  const ToolRun rebuilt = tool({"dump", "--frames", write("", &other)});
  ASSERT_EQ(rebuilt.status, 0) << rebuilt.err;
  EXPECT_TRUE(contains(rebuilt.out, "libcallsite_probe.so+0x")) << rebuilt.out;
  EXPECT_FALSE(contains(rebuilt.out, "magi_probe_path_a")) << rebuilt.out;
}

TEST_F(MagiceTrace, DiffAndDumpShowPythonCallSites) {
  TraceBuilder b(make_file_header(4242, "node0", "train"));
  b.comm(make_comm(kWorld, 0, 1));
  b.call(make_call(kWorld, 0, 0, {Op::AllGather, 9, 111, -1, -1, 0}));
  const std::string file = dir_ + "/py.trace";
  b.py_callsite(0xfeed, {{"/home/u/model.py", "forward", 42}, {"/home/u/train.py", "step", 7}})
      .py_call({kWorld, 0, 0xfeed, 0, 0});
  b.write(file);
  const ToolRun run = tool({"dump", "--frames", file});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(contains(run.out, "/home/u/model.py:42 in forward")) << run.out;
  EXPECT_TRUE(contains(run.out, "/home/u/train.py:7 in step")) << run.out;
}

// MAGI_PY_CALLSITES in a real interpreter: a program calls NCCL through ctypes, once holding the
// GIL (PyDLL) and once with it released (CDLL, as PyTorch's bindings do).
class PythonCallSites : public MagiceTrace {
 protected:
  void SetUp() override {
    MagiceTrace::SetUp();
    // A sanitizer build of the library needs its runtime loaded first, and the interpreter is
    // not built with it: these run in the plain build only.
    if (const char* first = std::getenv("TEST_PRELOAD_FIRST"); first != nullptr && *first != '\0')
      GTEST_SKIP() << "the interpreter is not built with the sanitizer";
    if (run_program({"python3", "-c", "import ctypes"}, dir_).status != 0)
      GTEST_SKIP() << "python3 with ctypes is not on this machine";
    script_ = dir_ + "/issue.py";
    std::ofstream(script_) << R"(import ctypes, sys
held = ctypes.PyDLL(sys.argv[1])
released = ctypes.CDLL(sys.argv[1])
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
uid = UniqueId()
assert ctypes.PyDLL(sys.argv[2]).ncclGetUniqueId(ctypes.byref(uid)) == 0
comm = ctypes.c_void_p()
assert held.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
send, recv = (ctypes.c_float * 64)(), (ctypes.c_float * 64)()
def with_gil():
    return held.ncclAllReduce(send, recv, ctypes.c_size_t(64), 7, 0, comm, None)
def without_gil():
    return released.ncclAllReduce(send, recv, ctypes.c_size_t(64), 7, 0, comm, None)
assert with_gil() == 0
assert without_gil() == 0
assert held.ncclCommDestroy(comm) == 0
)";
  }

  // Runs the program with MAGI_PY_CALLSITES=`mode`; its trace, and its two all-reduces.
  std::string run(const std::string& mode) {
    const std::string traces = dir_ + "/traces" + mode;
    const std::string standin = build_dir() + "/tests/support/libnccl.so.2";
    const ToolRun python = run_program({"env", "MAGI_PY_CALLSITES=" + mode,
                                        "MAGI_TRACE_DIR=" + traces, "MAGI_NCCL_LIBRARY=" + standin,
                                        "python3", script_, build_dir() + "/libmagice.so", standin},
                                       dir_);
    EXPECT_EQ(python.status, 0) << python.err;
    err_ = python.err;
    std::vector<std::string> files;
    for (const auto& entry : std::filesystem::directory_iterator(traces))
      files.push_back(entry.path().string());
    EXPECT_EQ(files.size(), 1u);
    trace_ = read_trace(files.at(0));
    reduces_.clear();
    for (const CallRecord& c : trace_.calls)
      if (c.op == static_cast<uint8_t>(Op::AllReduce)) reduces_.push_back(&c);
    EXPECT_EQ(reduces_.size(), 2u);
    return files.at(0);
  }

  const std::vector<PyFrameText>* frames_of(const CallRecord& c) const {
    const auto site = trace_.py_calls.find({c.comm_id, c.seq, c.rank});
    return site == trace_.py_calls.end() ? nullptr : &trace_.py_callsites.at(site->second);
  }

  std::string script_;
  std::string err_;  // the program's stderr: the library's log lines
  Trace trace_;
  std::vector<const CallRecord*> reduces_;
};

TEST_F(PythonCallSites, CallsMadeHoldingTheGilCarryTheirPythonLine) {
  const std::string file = run("1");
  ASSERT_EQ(reduces_.size(), 2u);
  const std::vector<PyFrameText>* frames = frames_of(*reduces_[0]);
  ASSERT_NE(frames, nullptr) << "the call made holding the GIL";
  EXPECT_EQ(frames_of(*reduces_[1]), nullptr) << "the call made without the GIL";
  // Which the user is told, once: with PyTorch every collective is such a call.
  const std::string warning = "MAGI_PY_CALLSITES=1: a Python thread calls NCCL without holding";
  EXPECT_TRUE(contains(err_, warning)) << err_;
  EXPECT_EQ(err_.find(warning), err_.rfind(warning)) << err_;
  ASSERT_EQ(frames->size(), 2u);  // with_gil, then the module's code that called it
  EXPECT_EQ((*frames)[0].file, script_);
  EXPECT_EQ((*frames)[0].function, "with_gil");
  EXPECT_EQ((*frames)[0].line, 12);
  EXPECT_EQ((*frames)[1].function, "<module>");
  EXPECT_EQ((*frames)[1].line, 15);

  const ToolRun dump = tool({"dump", file});
  ASSERT_EQ(dump.status, 0) << dump.err;
  EXPECT_TRUE(contains(dump.out, script_ + ":12 in with_gil")) << dump.out;
}

// No trace, the recorder alone, and a process killed after its call: `hang` names the Python
// line from the recorder file.
TEST_F(PythonCallSites, TheRecorderAloneKeepsThePythonLineForHang) {
  const std::string script = dir_ + "/killed.py";
  std::ofstream(script) << R"(import ctypes, os, signal, sys
held = ctypes.PyDLL(sys.argv[1])
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
uid = UniqueId()
assert ctypes.PyDLL(sys.argv[2]).ncclGetUniqueId(ctypes.byref(uid)) == 0
comm = ctypes.c_void_p()
assert held.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
send, recv = (ctypes.c_float * 64)(), (ctypes.c_float * 64)()
def forward():
    return held.ncclAllGather(send, recv, ctypes.c_size_t(64), 7, comm, None)
assert forward() == 0
os.kill(os.getpid(), signal.SIGKILL)
)";
  const std::string recorder = dir_ + "/recorder";
  const std::string standin = build_dir() + "/tests/support/libnccl.so.2";
  const ToolRun python =
      run_program({"env", "-u", "MAGI_TRACE_DIR", "MAGI_PY_CALLSITES=1", "MAGI_FLIGHT_RECORDER=16",
                   "MAGI_FLIGHT_RECORDER_DIR=" + recorder, "MAGI_NCCL_LIBRARY=" + standin,
                   "python3", script, build_dir() + "/libmagice.so", standin},
                  dir_);
  EXPECT_EQ(python.status, -1) << "killed by its own SIGKILL\n" << python.err;
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(recorder))
    files.push_back(entry.path().string());
  ASSERT_EQ(files.size(), 1u);
  ASSERT_TRUE(files[0].ends_with(".flight")) << files[0];

  const ToolRun hang = tool({"hang", files[0]});
  EXPECT_EQ(hang.status, 0) << hang.err;
  EXPECT_TRUE(contains(hang.out, "last call #0 AllGather float32 x 64 at " + script +
                                     ":11 in forward (collective #0)"))
      << hang.out;
  EXPECT_TRUE(contains(hang.out, "\n      " + script + ":12 in <module>\n")) << hang.out;
  const ToolRun json = tool({"hang", "--json", files[0]});
  EXPECT_TRUE(contains(json.out, "\"python\":\"" + script + ":11 in forward\"")) << json.out;
}

TEST_F(PythonCallSites, TakingTheGilReadsCallsMadeWithoutIt) {
  run("2");
  ASSERT_EQ(reduces_.size(), 2u);
  ASSERT_NE(frames_of(*reduces_[0]), nullptr);
  const std::vector<PyFrameText>* released = frames_of(*reduces_[1]);
  ASSERT_NE(released, nullptr) << "MAGI_PY_CALLSITES=2 takes the GIL the caller released";
  EXPECT_EQ(released->at(0).function, "without_gil");
  EXPECT_EQ(released->at(0).line, 14);
}

}  // namespace
}  // namespace magi::trace
