// An installed prefix needs nothing of the machine but its base: every library that an ELF file of
// the prefix names, and every library those name in turn, is found in the prefix where the loader
// would look for it, or is base (tools/install/libraries). Read from the files' dynamic sections,
// as the loader reads them; `make test` installs build/ into TEST_INSTALL_PREFIX first.
#include <elf.h>
#include <gtest/gtest.h>
#include <stdio.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "tests/support/tool_run.h"

namespace magi::install {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLibraryList = "tools/install/libraries";

// What the loader reads of one ELF file.
struct DynamicSection {
  std::vector<std::string> needed;
  std::string rpath;        // DT_RPATH: ignored by the loader when DT_RUNPATH is present
  std::string runpath;      // DT_RUNPATH
  std::string interpreter;  // PT_INTERP, executables only
};

bool is_elf(const std::string& path) {
  char magic[SELFMAG] = {};
  std::ifstream in(path, std::ios::binary);
  return in.read(magic, SELFMAG) && std::memcmp(magic, ELFMAG, SELFMAG) == 0;
}

// Reads `path`'s dynamic section through its program headers, as the loader does (section headers
// may be stripped). nullopt, with `*error` set, for anything but a well-formed x86-64 ELF file.
std::optional<DynamicSection> read_dynamic(const std::string& path, std::string* error) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  // Reads `size` bytes at `offset` into `to`: false when they lie past the end of the file.
  auto read = [&](uint64_t offset, uint64_t size, void* to) {
    if (offset > file_size || size > file_size - offset) return false;
    in.seekg(static_cast<std::streamoff>(offset));
    return static_cast<bool>(in.read(static_cast<char*>(to), static_cast<std::streamsize>(size)));
  };
  Elf64_Ehdr header;
  if (!read(0, sizeof(header), &header) || header.e_ident[EI_CLASS] != ELFCLASS64 ||
      header.e_ident[EI_DATA] != ELFDATA2LSB || header.e_machine != EM_X86_64 ||
      header.e_phentsize != sizeof(Elf64_Phdr)) {
    return *error = "not a 64-bit little-endian x86-64 ELF file", std::nullopt;
  }
  std::vector<Elf64_Phdr> segments(header.e_phnum);
  if (!read(header.e_phoff, segments.size() * sizeof(Elf64_Phdr), segments.data())) {
    return *error = "its program headers lie past the end of the file", std::nullopt;
  }
  DynamicSection out;
  std::vector<Elf64_Dyn> entries;
  for (const Elf64_Phdr& s : segments) {
    bool read_well = true;
    if (s.p_type == PT_INTERP) {
      std::string interpreter(s.p_filesz, '\0');
      read_well = read(s.p_offset, s.p_filesz, interpreter.data());
      out.interpreter = interpreter.c_str();
    } else if (s.p_type == PT_DYNAMIC) {
      entries.resize(s.p_filesz / sizeof(Elf64_Dyn));
      read_well = read(s.p_offset, entries.size() * sizeof(Elf64_Dyn), entries.data());
    }
    if (!read_well) return *error = "a segment lies past the end of the file", std::nullopt;
  }
  if (entries.empty()) return out;  // linked statically: needs nothing

  // DT_STRTAB is an address: the loadable segment that holds it gives its place in the file.
  std::optional<uint64_t> strtab_address;
  uint64_t strtab_size = 0;
  for (const Elf64_Dyn& d : entries) {
    if (d.d_tag == DT_STRTAB) strtab_address = d.d_un.d_ptr;
    if (d.d_tag == DT_STRSZ) strtab_size = d.d_un.d_val;
  }
  std::optional<uint64_t> strtab_offset;
  for (const Elf64_Phdr& s : segments) {
    if (strtab_address && s.p_type == PT_LOAD && *strtab_address >= s.p_vaddr &&
        *strtab_address - s.p_vaddr < s.p_filesz) {
      strtab_offset = s.p_offset + (*strtab_address - s.p_vaddr);
    }
  }
  std::string strtab(strtab_size, '\0');
  if (!strtab_offset || !read(*strtab_offset, strtab_size, strtab.data())) {
    return *error = "its dynamic string table is missing or lies outside the file", std::nullopt;
  }
  auto string_at = [&](uint64_t offset) {
    return offset < strtab.size() ? std::string(strtab.c_str() + offset) : std::string();
  };
  for (const Elf64_Dyn& d : entries) {
    if (d.d_tag == DT_NULL) break;
    if (d.d_tag == DT_NEEDED) out.needed.push_back(string_at(d.d_un.d_val));
    if (d.d_tag == DT_RPATH) out.rpath = string_at(d.d_un.d_val);
    if (d.d_tag == DT_RUNPATH) out.runpath = string_at(d.d_un.d_val);
  }
  return out;
}

// The names tools/install/libraries gives as `base` (or `carried`): one name a line after it.
std::set<std::string> listed(const std::string& kind) {
  std::ifstream in(kLibraryList);
  std::set<std::string> names;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line.substr(0, line.find('#')));
    std::string first, name;
    if (words >> first >> name && first == kind) names.insert(name);
  }
  return names;
}

// Walks the ELF files of a prefix and what they need, following the loader's search: a library
// with no DT_RUNPATH is looked for in its own DT_RPATH, then in those of the objects that loaded
// it, up to the program (so a program's DT_RPATH serves its libraries' dependencies too); then in
// its DT_RUNPATH, which serves only its own; then on the system, where only base names may come
// from. LD_LIBRARY_PATH and the program that preloads the library are assumed to add nothing.
// The walk starts from the files no other file needs (the tool, the preloaded library): a file
// another one needs is loaded as its dependency, and judged where the loader meets it.
class PrefixWalk {
 public:
  PrefixWalk(std::string prefix, std::set<std::string> base)
      : prefix_(fs::path(prefix).lexically_normal()), base_(std::move(base)) {
    std::vector<std::string> files;
    for (const auto& e : fs::recursive_directory_iterator(prefix_)) {
      if (e.is_regular_file() && is_elf(e.path().string())) files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
    for (const std::string& f : files) visit(f, {});
    const std::set<std::string> needed_by_another = reached_;
    problems_.clear(), reached_.clear(), visited_.clear();
    for (const std::string& f : files)
      if (needed_by_another.count(f) == 0) roots_.push_back(f), visit(f, {});
    for (const std::string& f : files)  // reached before only through a cycle
      if (visited_.count(f) == 0) roots_.push_back(f), visit(f, {});
  }

  // The files the walk started from.
  const std::vector<std::string>& roots() const { return roots_; }
  const std::set<std::string>& problems() const { return problems_; }
  // The files of the prefix reached as some file's dependency.
  const std::set<std::string>& reached() const { return reached_; }

 private:
  struct Loaded {
    std::string path;
    DynamicSection dynamic;
  };

  std::string shown(const std::string& path) const {
    return fs::path(path).lexically_relative(prefix_).string();
  }

  // `paths` (':'-separated) of the object at `path` as directories; each must lie in the prefix.
  std::vector<std::string> directories(const std::string& path, const std::string& paths) {
    std::vector<std::string> out;
    if (paths.empty()) return out;
    const std::string origin = fs::path(path).parent_path().string();
    std::istringstream entries(paths);
    std::string entry;
    while (std::getline(entries, entry, ':')) {
      for (const char* token : {"${ORIGIN}", "$ORIGIN"}) {
        for (size_t at; (at = entry.find(token)) != std::string::npos;) {
          entry.replace(at, std::strlen(token), origin);
        }
      }
      const fs::path dir = fs::path(entry).lexically_normal();
      const std::string rel = dir.lexically_relative(prefix_).string();
      if (entry.find('$') != std::string::npos || dir.is_relative()) {
        problems_.insert(shown(path) + ": run path entry '" + entry +
                         "' is not a directory of the prefix (empty and relative entries mean "
                         "the working directory)");
      } else if (rel.empty() || rel.rfind("..", 0) == 0) {
        problems_.insert(shown(path) + ": run path " + dir.string() + " lies outside the prefix");
      } else {
        out.push_back(dir.string());
      }
    }
    return out;
  }

  // `loaders`: the objects that loaded this one, nearest first.
  void visit(const std::string& path, std::vector<Loaded> loaders) {
    for (const Loaded& l : loaders)
      if (l.path == path) return;  // a cycle: already being walked
    visited_.insert(path);
    std::string error;
    const std::optional<DynamicSection> dynamic = read_dynamic(path, &error);
    if (!dynamic) {
      problems_.insert(shown(path) + ": " + error);
      return;
    }
    const std::string interpreter = fs::path(dynamic->interpreter).filename().string();
    if (!dynamic->interpreter.empty() && base_.count(interpreter) == 0) {
      problems_.insert(shown(path) + ": its interpreter " + dynamic->interpreter + " is not base");
    }
    loaders.insert(loaders.begin(), Loaded{path, *dynamic});
    std::vector<std::string> search;
    if (dynamic->runpath.empty()) {
      for (const Loaded& l : loaders)
        if (l.dynamic.runpath.empty())
          for (const std::string& d : directories(l.path, l.dynamic.rpath)) search.push_back(d);
    }
    for (const std::string& d : directories(path, dynamic->runpath)) search.push_back(d);

    for (const std::string& name : dynamic->needed) {
      if (name.find('/') != std::string::npos) {
        problems_.insert(shown(path) + " names " + name + " by its path");
        continue;
      }
      const auto found = std::find_if(search.begin(), search.end(), [&](const std::string& d) {
        return fs::is_regular_file(d + "/" + name);
      });
      if (found != search.end()) {
        const std::string library = fs::path(*found + "/" + name).lexically_normal().string();
        reached_.insert(library);
        visit(library, loaders);
      } else if (base_.count(name) == 0) {
        std::string where;
        for (const std::string& d : search) where += " " + shown(d);
        problems_.insert(shown(path) + " needs " + name + ": neither in the prefix where it is " +
                         "looked for (" +
                         (where.empty() ? "no run path serves it" : where.substr(1)) +
                         ") nor base (" + kLibraryList + ")");
      }
    }
  }

  fs::path prefix_;
  std::set<std::string> base_;
  std::vector<std::string> roots_;
  std::set<std::string> problems_;
  std::set<std::string> reached_;
  std::set<std::string> visited_;
};

std::string joined(const std::set<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += "  " + l + "\n";
  return out;
}

bool any_names(const std::set<std::string>& problems, const std::string& file,
               const std::string& library) {
  return std::any_of(problems.begin(), problems.end(), [&](const std::string& p) {
    return p.rfind(file + " ", 0) == 0 && p.find(" " + library + ":") != std::string::npos;
  });
}

const char* installed_prefix() {
  const char* prefix = std::getenv("TEST_INSTALL_PREFIX");
  return prefix != nullptr && *prefix != 0 ? prefix : nullptr;
}

// Where an installed prefix keeps the carried libraries: not lib/, which may be on the system's
// search path (PREFIX=/usr/local), where they would stand in for the machine's own.
constexpr const char* kCarriedDir = "lib/magice";

// A prefix made of some of build/'s files, laid out as the install lays them out.
void place(const std::string& prefix, const std::string& built, const std::string& where) {
  fs::create_directories(prefix + "/" + where);
  fs::copy_file(magi::test::build_dir() + "/" + built, prefix + "/" + where + "/" + built);
}

// What the loader takes when `command` runs as ldd runs it (LD_TRACE_LOADED_OBJECTS=1), without
// LD_LIBRARY_PATH: each library name with the path it is taken from ("\tNAME => PATH (0x...)").
struct LoaderTrace {
  int status = -1;
  std::string shown;
  std::vector<std::pair<std::string, std::string>> taken;
};

LoaderTrace trace_loader(const std::string& command) {
  LoaderTrace out;
  FILE* p =
      popen(("env -u LD_LIBRARY_PATH LD_TRACE_LOADED_OBJECTS=1 " + command + " 2>&1").c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.shown.append(buf, n);
  out.status = pclose(p);
  std::istringstream lines(out.shown);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::string name, arrow, path;
    if (words >> name >> arrow >> path && arrow == "=>") out.taken.emplace_back(name, path);
  }
  return out;
}

bool same_file(const std::string& a, const std::string& b) {
  std::error_code error;
  return fs::equivalent(a, b, error);
}

TEST(Install, TheBaseAndCarriedListsAreReadable) {
  EXPECT_TRUE(listed("base").count("libc.so.6")) << kLibraryList << " lists no base libc.so.6";
  EXPECT_FALSE(listed("carried").empty()) << kLibraryList << " lists no carried library";
}

TEST(Install, EveryLibraryThePrefixNeedsIsInItOrBase) {
  const char* prefix = installed_prefix();
  if (prefix == nullptr) GTEST_SKIP() << "TEST_INSTALL_PREFIX is unset (make test sets it)";
  const PrefixWalk walk(prefix, listed("base"));
  const std::string at = std::string(prefix) + "/";
  ASSERT_NE(std::find(walk.roots().begin(), walk.roots().end(), at + "lib/libmagice.so"),
            walk.roots().end());
  ASSERT_NE(std::find(walk.roots().begin(), walk.roots().end(), at + "bin/magice-trace"),
            walk.roots().end());
  EXPECT_TRUE(walk.problems().empty()) << "in " << prefix << ":\n" << joined(walk.problems());
  // Every carried library is installed and needed: the list says what the binaries really need.
  for (const std::string& carried : listed("carried")) {
    EXPECT_TRUE(walk.reached().count(at + kCarriedDir + "/" + carried))
        << carried << " is carried but no installed file needs it (or it is not installed)";
  }
}

// The walk's reading of the loader, checked against the loader itself (as ldd asks it): every
// carried library comes from the prefix, also where the system has a copy of its own, and every
// other one is base.
TEST(Install, TheLoaderTakesTheCarriedLibrariesFromThePrefix) {
  const char* prefix = installed_prefix();
  if (prefix == nullptr) GTEST_SKIP() << "TEST_INSTALL_PREFIX is unset (make test sets it)";
  const std::string carried_dir = std::string(prefix) + "/" + kCarriedDir + "/";
  const std::string runs[] = {
      "'" + std::string(prefix) + "/bin/magice-trace'",
      "LD_PRELOAD='" + std::string(prefix) + "/lib/libmagice.so' /bin/true"};
  const std::set<std::string> carried = listed("carried");
  const std::set<std::string> base = listed("base");
  std::set<std::string> taken_from_prefix;
  for (const std::string& run : runs) {
    const LoaderTrace trace = trace_loader(run);
    ASSERT_EQ(trace.status, 0) << run << ":\n" << trace.shown;
    EXPECT_EQ(trace.shown.find("not found"), std::string::npos) << run << ":\n" << trace.shown;
    for (const auto& [name, path] : trace.taken) {
      const bool from_prefix = same_file(path, carried_dir + name);
      EXPECT_EQ(carried.count(name) > 0, from_prefix) << run << ": " << name << " from " << path;
      EXPECT_TRUE(from_prefix || base.count(name)) << run << ": " << name << " from " << path;
      if (from_prefix) taken_from_prefix.insert(name);
    }
  }
  EXPECT_EQ(taken_from_prefix, carried) << "the library and the tool load other libraries than "
                                        << kLibraryList << " says they carry";
}

// PREFIX/lib holds the library alone: the system's search path names lib/ (/usr/local/lib is in
// ld.so.conf), never its folders, so a carried library in lib/ itself would replace the
// machine's own in every program once ldconfig runs.
TEST(Install, TheCarriedLibrariesLieOffTheSearchPath) {
  const char* prefix = installed_prefix();
  if (prefix == nullptr) GTEST_SKIP() << "TEST_INSTALL_PREFIX is unset (make test sets it)";
  const std::string lib = std::string(prefix) + "/lib";
  std::set<std::string> files_in_lib;
  for (const auto& e : fs::directory_iterator(lib))
    if (!e.is_directory()) files_in_lib.insert(e.path().filename().string());
  EXPECT_EQ(files_in_lib, std::set<std::string>{"libmagice.so"}) << "in " << lib;
  for (const std::string& carried : listed("carried")) {
    EXPECT_TRUE(fs::is_regular_file(std::string(prefix) + "/" + kCarriedDir + "/" + carried))
        << carried << " is not installed in " << kCarriedDir;
  }
}

// A machine may have a libunwind.so.8 of its own in PREFIX/lib (/usr/local/lib, from a source
// build): the library's run path tries its private folder first and takes the carried copy.
TEST(Install, TheLibraryTakesItsCarriedLibunwindBeforeOneBesideIt) {
  magi::test::TempDir prefix;
  place(prefix.path, "libmagice.so", "lib");
  place(prefix.path, "libunwind.so.8", kCarriedDir);
  place(prefix.path, "libunwind.so.8", "lib");  // stands for the machine's own
  const std::string carried = prefix.path + "/" + kCarriedDir + "/libunwind.so.8";

  const PrefixWalk walk(prefix.path, listed("base"));
  EXPECT_TRUE(walk.reached().count(carried)) << joined(walk.reached());
  EXPECT_FALSE(walk.reached().count(prefix.path + "/lib/libunwind.so.8"));

  const std::string run = "LD_PRELOAD='" + prefix.path + "/lib/libmagice.so' /bin/true";
  const LoaderTrace trace = trace_loader(run);
  ASSERT_EQ(trace.status, 0) << run << ":\n" << trace.shown;
  const auto unwind = std::find_if(trace.taken.begin(), trace.taken.end(),
                                   [](const auto& t) { return t.first == "libunwind.so.8"; });
  ASSERT_NE(unwind, trace.taken.end()) << trace.shown;
  EXPECT_TRUE(same_file(unwind->second, carried)) << trace.shown;
}

TEST(Install, APrefixWithoutLibunwindIsReported) {
  magi::test::TempDir prefix;
  place(prefix.path, "libmagice.so", "lib");
  const PrefixWalk walk(prefix.path, listed("base"));
  EXPECT_TRUE(any_names(walk.problems(), "lib/libmagice.so", "libunwind.so.8"))
      << joined(walk.problems());
  place(prefix.path, "libunwind.so.8", kCarriedDir);
  EXPECT_FALSE(any_names(PrefixWalk(prefix.path, listed("base")).problems(), "lib/libmagice.so",
                         "libunwind.so.8"));
}

// libdw has no run path of its own: its libelf is found through the tool's DT_RPATH, and a
// library it needs that is missing is reported against libdw, base ones (libz, liblzma) never.
TEST(Install, ALibraryThatACarriedLibraryNeedsIsFollowedAndReported) {
  magi::test::TempDir prefix;
  place(prefix.path, "magice-trace", "bin");
  place(prefix.path, "libdw.so.1", kCarriedDir);
  place(prefix.path, "libelf.so.1", kCarriedDir);
  const std::set<std::string> problems = PrefixWalk(prefix.path, listed("base")).problems();
  EXPECT_TRUE(any_names(problems, "lib/magice/libdw.so.1", "libbz2.so.1.0")) << joined(problems);
  for (const char* found_or_base : {"libelf.so.1", "libz.so.1", "liblzma.so.5", "libc.so.6"}) {
    for (const char* file :
         {"bin/magice-trace", "lib/magice/libdw.so.1", "lib/magice/libelf.so.1"}) {
      EXPECT_FALSE(any_names(problems, file, found_or_base)) << joined(problems);
    }
  }
  // Alone, with no program whose run path serves it, libdw finds neither.
  fs::remove(prefix.path + "/bin/magice-trace");
  const std::set<std::string> alone = PrefixWalk(prefix.path, listed("base")).problems();
  EXPECT_TRUE(any_names(alone, "lib/magice/libdw.so.1", "libelf.so.1")) << joined(alone);
}

TEST(Install, ARunPathLeavingThePrefixIsReported) {
  // build/tests/magice-tests runs with $ORIGIN/..: placed in a prefix's bin/, that is the prefix;
  // placed at its top, the run path leaves it.
  magi::test::TempDir prefix;
  fs::copy_file(magi::test::build_dir() + "/tests/magice-tests", prefix.path + "/magice-tests");
  const std::set<std::string> problems = PrefixWalk(prefix.path, listed("base")).problems();
  EXPECT_TRUE(std::any_of(problems.begin(), problems.end(), [](const std::string& p) {
    return p.rfind("magice-tests: run path ", 0) == 0 && p.find("outside the prefix") != p.npos;
  })) << joined(problems);
}

}  // namespace
}  // namespace magi::install
