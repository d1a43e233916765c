// What the tests that run the built programs share: where the build is, a temporary directory
// that removes itself, the files of one kind in a directory, and magice-trace run on arguments.
#pragma once

#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace magi::test {

inline std::string build_dir() {
  const char* dir = std::getenv("TEST_BUILD_DIR");
  return dir ? dir : std::filesystem::absolute("build").string();
}

struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/magice-test.XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path;
};

// The files of `dir` whose extension is `extension` (".flight"), sorted.
inline std::vector<std::string> files_in(const std::string& dir, const std::string& extension) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == extension) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Runs BUILD/magice-trace ARGS...; its stdout and stderr in `out`, its exit status returned (-1
// when it did not exit).
inline int run_magice_trace(const std::vector<std::string>& args, std::string* out) {
  std::string cmd = build_dir() + "/magice-trace";
  for (const auto& a : args) cmd += " '" + a + "'";
  cmd += " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  out->clear();
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace magi::test
