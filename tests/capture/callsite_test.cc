// Call-site fingerprints: equal in two processes for the same code path, different for different
// paths, and module keys that follow a library through unload and reload.
//
// The fingerprint skips the frames of the module holding callsite_fingerprint, which in this
// program is the test program itself; so the call paths under test run through
// libcallsite_probe.so (tests/capture/callsite_probe_lib.cc), looked for in
// $TEST_BUILD_DIR/tests/support, else in support/ beside this program.
#include "capture/callsite.h"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/personality.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

extern char** environ;

namespace magi::capture {
namespace {

using ProbePath = uint64_t (*)(uint64_t (*)(void*), void*);
using ProbeAnchor = int (*)(int);

constexpr int kDepth = 16;  // MAGI_CALLSITE_DEPTH's default
constexpr const char* kChildOutputVariable = "CALLSITE_TEST_CHILD_OUT";

std::string self_path() {
  char path[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  return n > 0 ? std::string(path, static_cast<size_t>(n)) : std::string();
}

std::string probe_library_path() {
  if (const char* build = std::getenv("TEST_BUILD_DIR"); build != nullptr && *build != 0)
    return std::string(build) + "/tests/support/libcallsite_probe.so";
  const std::filesystem::path program = self_path();
  return (program.parent_path() / "support" / "libcallsite_probe.so").string();
}

// ---- the probe library ------------------------------------------------------------------------

class Probe {
 public:
  explicit Probe(std::string path) : path_(std::move(path)) {
    handle_ = dlopen(path_.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) {
      error_ = dlerror();
      return;
    }
    path_a_ = reinterpret_cast<ProbePath>(dlsym(handle_, "magi_probe_path_a"));
    path_b_ = reinterpret_cast<ProbePath>(dlsym(handle_, "magi_probe_path_b"));
    anchor_ = reinterpret_cast<ProbeAnchor>(dlsym(handle_, "magi_probe_anchor"));
    if (!path_a_ || !path_b_ || !anchor_) error_ = "a magi_probe_* symbol is missing";
  }
  ~Probe() { close(); }
  Probe(const Probe&) = delete;
  Probe& operator=(const Probe&) = delete;

  void close() {
    if (handle_ != nullptr) dlclose(handle_);
    handle_ = nullptr;
  }
  bool loaded() const { return handle_ != nullptr && error_.empty(); }
  const std::string& path() const { return path_; }
  const std::string& error() const { return error_; }
  ProbePath path_a() const { return path_a_; }
  ProbePath path_b() const { return path_b_; }
  uintptr_t anchor_address() const { return reinterpret_cast<uintptr_t>(anchor_); }

 private:
  std::string path_;
  void* handle_ = nullptr;
  std::string error_;
  ProbePath path_a_ = nullptr;
  ProbePath path_b_ = nullptr;
  ProbeAnchor anchor_ = nullptr;
};

testing::AssertionResult loaded(const Probe& probe) {
  if (probe.loaded()) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "cannot use " << probe.path() << ": " << probe.error()
                                     << " (is libcallsite_probe.so built?)";
}

struct Captured {
  int depth = kDepth;
  int count = 0;
  uint64_t fingerprint = 0;
  std::array<trace::Frame, 64> frames{};
};

// Called back from the probe library, as the shim is called from a host program.
uint64_t capture_here(void* context) {
  auto& captured = *static_cast<Captured*>(context);
  captured.fingerprint = callsite_fingerprint(captured.depth, captured.frames, &captured.count);
  return captured.fingerprint;
}

// One place in this program that enters the probe library, so calls made through it in a loop
// have identical stacks.
__attribute__((noinline)) Captured capture_through(ProbePath path, int depth = kDepth) {
  Captured captured;
  captured.depth = depth;
  path(capture_here, &captured);
  asm volatile("" ::: "memory");
  return captured;
}

// ---- copies of the probe library that are different modules -----------------------------------

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/magi-callsite-XXXXXX";
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

struct BuildIdNote {
  size_t header_at;  // file offset of the note's Elf64_Nhdr
  size_t id_at;
  size_t id_bytes;
};

// The GNU build-id note of an ELF file, found through its program headers as the loader sees it.
std::optional<BuildIdNote> find_build_id_note(const std::string& elf) {
  Elf64_Ehdr header;
  if (elf.size() < sizeof(header)) return std::nullopt;
  std::memcpy(&header, elf.data(), sizeof(header));
  for (size_t i = 0; i < header.e_phnum; ++i) {
    Elf64_Phdr segment;
    const size_t at = header.e_phoff + i * header.e_phentsize;
    if (at + sizeof(segment) > elf.size()) return std::nullopt;
    std::memcpy(&segment, elf.data() + at, sizeof(segment));
    if (segment.p_type != PT_NOTE || segment.p_offset + segment.p_filesz > elf.size()) continue;
    const size_t align = segment.p_align == 8 ? 8 : 4;
    const auto pad = [align](size_t bytes) { return (bytes + align - 1) & ~(align - 1); };
    const size_t end = segment.p_offset + segment.p_filesz;
    for (size_t note = segment.p_offset; note + sizeof(Elf64_Nhdr) <= end;) {
      Elf64_Nhdr nhdr;
      std::memcpy(&nhdr, elf.data() + note, sizeof(nhdr));
      const size_t name_at = note + sizeof(nhdr);
      const size_t id_at = name_at + pad(nhdr.n_namesz);
      if (nhdr.n_type == NT_GNU_BUILD_ID && nhdr.n_namesz == 4 &&
          std::memcmp(elf.data() + name_at, "GNU", 4) == 0)
        return BuildIdNote{note, id_at, nhdr.n_descsz};
      note = id_at + pad(nhdr.n_descsz);
    }
  }
  return std::nullopt;
}

enum class BuildIdEdit { Change, Remove };

// Writes a copy of the library at `from` whose build-id differs (Change) or is gone (Remove):
// the same code and size, but another module to the loader and to the module table.
testing::AssertionResult copy_with_build_id(const std::string& from, const std::string& to,
                                            BuildIdEdit edit) {
  std::optional<std::string> elf = read_file(from);
  if (!elf) return testing::AssertionFailure() << "cannot read " << from;
  const std::optional<BuildIdNote> note = find_build_id_note(*elf);
  if (!note) return testing::AssertionFailure() << from << " has no GNU build-id note";
  if (edit == BuildIdEdit::Change) {
    for (size_t i = 0; i < note->id_bytes; ++i) (*elf)[note->id_at + i] ^= 0x5a;
  } else {
    Elf64_Nhdr nhdr;
    std::memcpy(&nhdr, elf->data() + note->header_at, sizeof(nhdr));
    nhdr.n_type = 0x4d414749;  // a type no reader knows: the note stays, the build-id is gone
    std::memcpy(elf->data() + note->header_at, &nhdr, sizeof(nhdr));
  }
  std::ofstream out(to, std::ios::binary | std::ios::trunc);
  out.write(elf->data(), static_cast<std::streamsize>(elf->size()));
  out.close();
  if (!out) return testing::AssertionFailure() << "cannot write " << to;
  return testing::AssertionSuccess();
}

// ---- child processes --------------------------------------------------------------------------

// Runs this program again with only `test` selected and `assignment` added to the environment;
// a child that outlives `timeout` is killed and the test fails rather than hangs.
testing::AssertionResult run_self(const std::string& test, std::string assignment,
                                  const std::string& log_path, std::chrono::seconds timeout) {
  std::string program = "/proc/self/exe";
  std::string filter = "--gtest_filter=" + test;
  std::string disabled = "--gtest_also_run_disabled_tests";
  char* argv[] = {program.data(), filter.data(), disabled.data(), nullptr};
  std::vector<char*> envp;
  for (char** variable = environ; *variable != nullptr; ++variable) envp.push_back(*variable);
  envp.push_back(assignment.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, program.c_str(), &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) return testing::AssertionFailure() << "posix_spawn: " << std::strerror(spawned);

  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return testing::AssertionFailure()
             << test << " did not finish within " << timeout.count() << " s; its output:\n"
             << read_file(log_path).value_or("");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return testing::AssertionFailure() << test << " failed in the child; its output:\n"
                                       << read_file(log_path).value_or("");
  return testing::AssertionSuccess();
}

struct ChildReport {
  uint64_t path_a = 0;
  uint64_t path_b = 0;
  uint64_t probe_address = 0;    // where the child mapped the probe library's anchor
  uint64_t program_address = 0;  // where the child mapped this program's capture_here
};

bool aslr_enabled() {
  const std::string setting = read_file("/proc/sys/kernel/randomize_va_space").value_or("0");
  return setting.substr(0, 1) != "0" && (personality(0xffffffff) & ADDR_NO_RANDOMIZE) == 0;
}

// Run in a child by SameCodePathGivesTheSameFingerprintInTwoProcesses; a no-op anywhere else.
TEST(CallsiteChild, DISABLED_WritesFingerprintsWhenAsked) {
  const char* output = std::getenv(kChildOutputVariable);
  if (output == nullptr) GTEST_SKIP() << "runs only as a child of the two-process test";
  Probe probe(probe_library_path());
  ASSERT_TRUE(loaded(probe));
  const Captured a = capture_through(probe.path_a());
  const Captured b = capture_through(probe.path_b());
  std::ofstream out(output);
  out << std::hex << a.fingerprint << ' ' << b.fingerprint << ' ' << probe.anchor_address() << ' '
      << reinterpret_cast<uintptr_t>(&capture_here) << '\n';
  out.close();
  ASSERT_TRUE(out.good()) << "cannot write " << output;
}

// ---- tests ------------------------------------------------------------------------------------

TEST(Callsite, SameCodePathGivesTheSameFingerprintInTwoProcesses) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  std::array<ChildReport, 2> reports;
  for (size_t i = 0; i < reports.size(); ++i) {
    const std::string output = dir.path() + "/child" + std::to_string(i) + ".txt";
    const std::string log = dir.path() + "/child" + std::to_string(i) + ".log";
    ASSERT_TRUE(run_self("CallsiteChild.DISABLED_WritesFingerprintsWhenAsked",
                         std::string(kChildOutputVariable) + "=" + output, log,
                         std::chrono::seconds(60)));
    std::ifstream in(output);
    in >> std::hex >> reports[i].path_a >> reports[i].path_b >> reports[i].probe_address >>
        reports[i].program_address;
    ASSERT_TRUE(in) << "the child wrote no report";
  }
  EXPECT_EQ(reports[0].path_a, reports[1].path_a);
  EXPECT_EQ(reports[0].path_b, reports[1].path_b);
  EXPECT_NE(reports[0].path_a, reports[0].path_b);

  const bool moved = reports[0].probe_address != reports[1].probe_address &&
                     reports[0].program_address != reports[1].program_address;
  if (aslr_enabled())
    EXPECT_TRUE(moved) << "ASLR is on, yet the two children mapped the code at the same addresses";
  else
    RecordProperty("note", "ASLR is off here: both children ran at the same addresses");
}

TEST(Callsite, DifferentCallPathsGiveDifferentFingerprints) {
  Probe probe(probe_library_path());
  ASSERT_TRUE(loaded(probe));
  uint64_t through_a[2];
  uint64_t through_b[2];
  for (int round = 0; round < 2; ++round) {  // the second round is answered from the cache
    through_a[round] = capture_through(probe.path_a()).fingerprint;
    through_b[round] = capture_through(probe.path_b()).fingerprint;
  }
  EXPECT_NE(through_a[0], through_b[0]);
  EXPECT_EQ(through_a[0], through_a[1]);
  EXPECT_EQ(through_b[0], through_b[1]);
}

TEST(Callsite, FramesStartAtTheCallerOfTheLibraryAndHashToTheFingerprint) {
  Probe probe(probe_library_path());
  ASSERT_TRUE(loaded(probe));
  trace::Frame probe_module{};
  ASSERT_TRUE(normalize_address(probe.anchor_address(), probe_module));

  const Captured deep = capture_through(probe.path_a());
  ASSERT_GT(deep.count, 2);
  ASSERT_LE(deep.count, kDepth);
  // capture_here and callsite_fingerprint are in this program, the module skipped as "the
  // library"; the first frame kept is the probe function that called back.
  EXPECT_EQ(deep.frames[0].module, probe_module.module) << module_name(deep.frames[0].module);
  const size_t hashed_bytes = sizeof(trace::Frame) * static_cast<size_t>(deep.count);
  EXPECT_EQ(deep.fingerprint, XXH3_64bits(deep.frames.data(), hashed_bytes));

  const Captured shallow = capture_through(probe.path_a(), 2);
  ASSERT_EQ(shallow.count, 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(shallow.frames[i].module, deep.frames[i].module) << "frame " << i;
    EXPECT_EQ(shallow.frames[i].offset, deep.frames[i].offset) << "frame " << i;
  }
  EXPECT_NE(shallow.fingerprint, deep.fingerprint);

  // A short frames_out receives the first frames and the count it holds; the fingerprint still
  // covers `depth` frames.
  struct ShortOutput {
    std::array<trace::Frame, 3> frames{};
    int count = -1;
    uint64_t fingerprint = 0;
  } short_output;
  probe.path_a()(
      [](void* context) {
        auto& out = *static_cast<ShortOutput*>(context);
        out.fingerprint = callsite_fingerprint(kDepth, out.frames, &out.count);
        return out.fingerprint;
      },
      &short_output);
  EXPECT_EQ(short_output.count, 3);
  EXPECT_EQ(short_output.frames[0].module, probe_module.module);
}

TEST(Callsite, ReloadedLibraryKeepsItsModuleKeyAndOffset) {
  TempDir dir;
  const std::string original = probe_library_path();
  const std::string twin = dir.path() + "/libcallsite_probe_twin.so";
  ASSERT_TRUE(copy_with_build_id(original, twin, BuildIdEdit::Change));

  Probe first(original);
  ASSERT_TRUE(loaded(first));
  const uintptr_t first_address = first.anchor_address();
  trace::Frame before{};
  ASSERT_TRUE(normalize_address(first_address, before));
  EXPECT_EQ(module_name(before.module), "libcallsite_probe.so");

  first.close();
  ASSERT_EQ(dlopen(original.c_str(), RTLD_NOW | RTLD_NOLOAD), nullptr)
      << "dlclose left the probe library loaded";
  trace::Frame unloaded{1, 1};
  EXPECT_FALSE(normalize_address(first_address, unloaded)) << "an unloaded library still resolves";
  EXPECT_EQ(unloaded.module, 0u);
  EXPECT_EQ(module_name(before.module), "libcallsite_probe.so") << "a key once seen keeps its name";

  // The twin (same size) takes the place the probe left, so the probe comes back elsewhere.
  Probe filler(twin);
  ASSERT_TRUE(loaded(filler));
  Probe second(original);
  ASSERT_TRUE(loaded(second));
  ASSERT_NE(second.anchor_address(), first_address)
      << "the probe library came back at its old address; the reload proves nothing";
  trace::Frame after{};
  ASSERT_TRUE(normalize_address(second.anchor_address(), after));
  EXPECT_EQ(after.module, before.module);
  EXPECT_EQ(after.offset, before.offset);
}

TEST(Callsite, LibraryMappedWhereAnotherWasUnloadedGetsItsOwnKey) {
  TempDir dir;
  const std::string original = probe_library_path();
  const std::string twin = dir.path() + "/libcallsite_probe_twin.so";
  ASSERT_TRUE(copy_with_build_id(original, twin, BuildIdEdit::Change));

  // The same loop iteration code captures both times, so with both libraries at one address the
  // raw stacks are identical and only the module table can tell the two apart.
  const std::string paths[2] = {original, twin};
  uintptr_t anchors[2] = {0, 0};
  trace::Frame anchor_frames[2]{};
  Captured captured[2];
  for (int i = 0; i < 2; ++i) {
    Probe probe(paths[i]);
    ASSERT_TRUE(loaded(probe));
    anchors[i] = probe.anchor_address();
    ASSERT_TRUE(normalize_address(anchors[i], anchor_frames[i]));
    captured[i] = capture_through(probe.path_a());
  }
  ASSERT_EQ(anchors[1], anchors[0])
      << "the twin was not mapped where the probe had been, so the stale-key case did not arise";
  EXPECT_NE(anchor_frames[1].module, anchor_frames[0].module);
  EXPECT_EQ(anchor_frames[1].offset, anchor_frames[0].offset);
  EXPECT_EQ(module_name(anchor_frames[1].module), "libcallsite_probe_twin.so");

  ASSERT_EQ(captured[1].count, captured[0].count);
  EXPECT_EQ(captured[1].frames[0].module, anchor_frames[1].module);
  for (int i = 0; i < captured[0].count; ++i)
    EXPECT_EQ(captured[1].frames[i].offset, captured[0].frames[i].offset) << "frame " << i;
  EXPECT_NE(captured[1].fingerprint, captured[0].fingerprint);
}

TEST(Callsite, ModulesAreKeyedByBuildIdElseByFileName) {
  TempDir dir;
  const std::string original = probe_library_path();
  const std::string anonymous = dir.path() + "/libcallsite_probe_anonymous.so";
  ASSERT_TRUE(copy_with_build_id(original, anonymous, BuildIdEdit::Remove));
  const std::optional<std::string> elf = read_file(original);
  ASSERT_TRUE(elf.has_value());
  const std::optional<BuildIdNote> note = find_build_id_note(*elf);
  ASSERT_TRUE(note.has_value());

  Probe with_id(original);
  ASSERT_TRUE(loaded(with_id));
  trace::Frame frame{};
  ASSERT_TRUE(normalize_address(with_id.anchor_address(), frame));
  EXPECT_EQ(frame.module, XXH3_64bits(elf->data() + note->id_at, note->id_bytes));

  Probe without_id(anonymous);
  ASSERT_TRUE(loaded(without_id));
  ASSERT_TRUE(normalize_address(without_id.anchor_address(), frame));
  const std::string name = "libcallsite_probe_anonymous.so";
  EXPECT_EQ(frame.module, XXH3_64bits(name.data(), name.size()));
  EXPECT_EQ(module_name(frame.module), name);
}

TEST(Callsite, ProgramIsNamedAfterItsExecutable) {
  trace::Frame frame{};
  ASSERT_TRUE(normalize_address(reinterpret_cast<uintptr_t>(&capture_here), frame));
  EXPECT_EQ(module_name(frame.module), std::filesystem::path(self_path()).filename().string());
  EXPECT_EQ(module_name(0x5eed), "");
}

TEST(Callsite, AddressOutsideEveryModuleIsNotNormalised) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* anonymous = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(anonymous, MAP_FAILED);
  const uintptr_t address = reinterpret_cast<uintptr_t>(anonymous) + 16;
  trace::Frame frame{1, 1};
  EXPECT_FALSE(normalize_address(address, frame)) << "anonymous memory, as JIT code lives in";
  EXPECT_EQ(frame.module, 0u);
  EXPECT_EQ(frame.offset, 0u);
  munmap(anonymous, page);
  EXPECT_FALSE(normalize_address(address, frame)) << "unmapped memory";
  EXPECT_FALSE(normalize_address(16, frame)) << "the null page";
}

TEST(Callsite, ThreadsAgreeWhileOtherLibrariesLoadAndUnload) {
  TempDir dir;
  const std::string churn = dir.path() + "/libcallsite_probe_churn.so";
  ASSERT_TRUE(copy_with_build_id(probe_library_path(), churn, BuildIdEdit::Change));
  Probe probe(probe_library_path());
  ASSERT_TRUE(loaded(probe));

  // Under TSan the calls are made on this thread alone, beside the loader: libunwind's per-thread
  // cache, freed as a thread that unwound exits, crashes TSan's runtime, and this thread outlives
  // the suite.
#if defined(__SANITIZE_THREAD__)
  constexpr int kThreads = 1;
  constexpr bool kOnThisThread = true;
#else
  constexpr int kThreads = 4;
  constexpr bool kOnThisThread = false;
#endif
  constexpr int kCalls = 5000;
  std::atomic<bool> stop{false};
  std::atomic<int> reloads{0};
  std::thread loader([&] {
    while (!stop.load()) {
      if (void* handle = dlopen(churn.c_str(), RTLD_NOW | RTLD_LOCAL)) dlclose(handle);
      reloads.fetch_add(1);
    }
  });
  struct Seen {
    uint64_t a = 0;
    uint64_t b = 0;
    int disagreements = 0;
  };
  std::vector<Seen> seen(kThreads);
  const auto calls = [&](int t) {
    Seen& mine = seen[static_cast<size_t>(t)];
    for (int call = 0; call < kCalls; ++call) {
      const uint64_t a = capture_through(probe.path_a()).fingerprint;
      const uint64_t b = capture_through(probe.path_b()).fingerprint;
      if (call == 0) {
        mine.a = a;
        mine.b = b;
      }
      mine.disagreements += (a != mine.a) + (b != mine.b);
    }
  };
  std::vector<std::thread> callers;
  for (int t = 0; t < kThreads; ++t) {
    if (kOnThisThread) {
      calls(t);
    } else {
      callers.emplace_back(calls, t);
    }
  }
  for (std::thread& caller : callers) caller.join();
  stop.store(true);
  loader.join();

  EXPECT_GT(reloads.load(), 0);
  EXPECT_NE(seen[0].a, seen[0].b);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(seen[static_cast<size_t>(t)].disagreements, 0) << "thread " << t;
    EXPECT_EQ(seen[static_cast<size_t>(t)].a, seen[0].a) << "thread " << t;
    EXPECT_EQ(seen[static_cast<size_t>(t)].b, seen[0].b) << "thread " << t;
  }
}

// A sanity run of the warm path. Its time is printed for the record, never asserted: machines
// differ too much for a threshold to mean anything.
TEST(Callsite, WarmCallsFromOnePlaceStayEqual) {
  Probe probe(probe_library_path());
  ASSERT_TRUE(loaded(probe));
  struct Loop {
    int calls = 20000;
    uint64_t first = 0;
    int differing = 0;
  } loop;
  const auto started = std::chrono::steady_clock::now();
  probe.path_a()(
      [](void* context) {
        auto& state = *static_cast<Loop*>(context);
        trace::Frame frames[kDepth];
        int count = 0;
        state.first = callsite_fingerprint(kDepth, frames, &count);
        for (int i = 1; i < state.calls; ++i)
          state.differing += callsite_fingerprint(kDepth, frames, &count) != state.first;
        return state.first;
      },
      &loop);
  const std::chrono::duration<double, std::nano> elapsed =
      std::chrono::steady_clock::now() - started;
  EXPECT_EQ(loop.differing, 0);
  std::printf("[ timing   ] callsite_fingerprint, depth %d, warm: %.0f ns per call\n", kDepth,
              elapsed.count() / loop.calls);
}

}  // namespace
}  // namespace magi::capture
