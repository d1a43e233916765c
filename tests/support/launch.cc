#include "tests/support/launch.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace magi::support {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Removes the entries of `dir` whose names start with `prefix`, then `dir` itself if asked.
void remove_entries(const std::string& dir, const std::string& prefix, bool remove_dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name == "." || name == ".." || name.rfind(prefix, 0) != 0) continue;
      ::unlink((dir + "/" + name).c_str());
    }
    ::closedir(d);
  }
  if (remove_dir) ::rmdir(dir.c_str());
}

// The inherited environment with `overrides` applied (later ones win).
std::vector<std::string> environment_with(
    const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::vector<std::string> entries;
  for (char** e = environ; *e != nullptr; ++e) entries.emplace_back(*e);
  for (const auto& [key, value] : overrides) {
    const std::string prefix = key + "=";
    std::erase_if(entries, [&](const std::string& s) { return s.rfind(prefix, 0) == 0; });
    entries.push_back(prefix + value);
  }
  return entries;
}

std::vector<char*> pointers_to(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (auto& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

// Each rank's output so far, from the files the launch in `dir` redirected it to.
void read_output(const std::string& dir, LaunchResult& result) {
  for (size_t rank = 0; rank < result.ranks.size(); ++rank) {
    result.ranks[rank].stdout_text = read_file(dir + "/rank" + std::to_string(rank) + ".out");
    result.ranks[rank].stderr_text = read_file(dir + "/rank" + std::to_string(rank) + ".err");
  }
}

bool spec_sets(const LaunchSpec& spec, const std::string& key) {
  for (const auto& [k, v] : spec.env) {
    if (k == key) return true;
  }
  return std::getenv(key.c_str()) != nullptr;
}

}  // namespace

double timeout_scale() {
  const char* text = std::getenv("TEST_TIMEOUT_SCALE");
  if (text == nullptr) return 1;
  char* end = nullptr;
  const double scale = std::strtod(text, &end);
  return end != text && *end == '\0' && scale > 0 ? scale : 1;
}

bool LaunchResult::all_ok() const {
  if (timed_out || ranks.empty()) return false;
  for (const auto& r : ranks) {
    if (r.exit_code != 0 || r.signal != 0) return false;
  }
  return true;
}

std::string LaunchResult::summary() const {
  std::ostringstream out;
  out.precision(2);
  out << std::fixed;
  if (timed_out) {
    out << (hung ? "hung as provoked after " : "timed out after ") << wall_s << " s; killed ranks";
    const char* sep = " ";
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i].signal == SIGKILL) {
        out << sep << i;
        sep = ",";
      }
    }
    return out.str();
  }
  if (all_ok()) {
    out << ranks.size() << " ranks exited 0 in " << wall_s << " s";
    return out.str();
  }
  const char* sep = "";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i].signal != 0) {
      out << sep << "rank " << i << " killed by signal " << ranks[i].signal << " ("
          << ::strsignal(ranks[i].signal) << ")";
    } else if (ranks[i].exit_code != 0) {
      out << sep << "rank " << i << " exited " << ranks[i].exit_code;
    } else {
      continue;
    }
    sep = "; ";
  }
  out << " (" << wall_s << " s)";
  return out.str();
}

LaunchResult launch(const LaunchSpec& spec) {
  if (spec.nranks < 1 || spec.argv.empty()) {
    throw std::invalid_argument("launch: needs at least one rank and a program");
  }
  const char* tmp_root = std::getenv("TMPDIR");
  std::string dir = std::string(tmp_root && *tmp_root ? tmp_root : "/tmp") + "/magi-launch-XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) {
    throw std::runtime_error("launch: mkdtemp " + dir + ": " + std::strerror(errno));
  }
  // mkdtemp's suffix is alphanumeric and unique among live launches: a safe tag.
  const std::string tag = "L" + dir.substr(dir.size() - 6);
  const bool own_tag = !spec_sets(spec, "STANDIN_SHM_TAG");

  std::vector<std::string> argv_strings = spec.argv;
  std::vector<char*> argv = pointers_to(argv_strings);
  const auto start = std::chrono::steady_clock::now();

  std::vector<pid_t> pids(static_cast<size_t>(spec.nranks), -1);
  for (int rank = 0; rank < spec.nranks; ++rank) {
    // Everything the child needs is built before fork: after it, only async-signal-safe calls.
    std::vector<std::pair<std::string, std::string>> overrides = {
        {"STANDIN_RANK", std::to_string(rank)},
        {"STANDIN_NRANKS", std::to_string(spec.nranks)},
        {"STANDIN_ID_FILE", dir + "/unique-id"},
    };
    if (own_tag) overrides.push_back({"STANDIN_SHM_TAG", tag});
    overrides.insert(overrides.end(), spec.env.begin(), spec.env.end());
    if (static_cast<size_t>(rank) < spec.rank_env.size()) {
      const auto& mine = spec.rank_env[static_cast<size_t>(rank)];
      overrides.insert(overrides.end(), mine.begin(), mine.end());
    }
    std::vector<std::string> env_strings = environment_with(overrides);
    std::vector<char*> envp = pointers_to(env_strings);
    const std::string out_path = dir + "/rank" + std::to_string(rank) + ".out";
    const std::string err_path = dir + "/rank" + std::to_string(rank) + ".err";

    const pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t started : pids) {
        if (started > 0) ::kill(-started, SIGKILL);
      }
      throw std::runtime_error(std::string("launch: fork: ") + std::strerror(errno));
    }
    if (pid == 0) {
      ::setpgid(0, 0);
      if (spec.capture_output) {
        int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (out < 0 || err < 0) ::_exit(127);
        ::dup2(out, STDOUT_FILENO);
        ::dup2(err, STDERR_FILENO);
        ::close(out);
        ::close(err);
      }
      ::execvpe(argv[0], argv.data(), envp.data());
      static const char message[] = "magi-launch: cannot execute the program\n";
      ssize_t ignored = ::write(STDERR_FILENO, message, sizeof message - 1);
      (void)ignored;
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here, so the group exists before any kill below
    pids[static_cast<size_t>(rank)] = pid;
  }

  LaunchResult result;
  result.ranks.resize(pids.size());
  for (size_t rank = 0; rank < pids.size(); ++rank) result.ranks[rank].pid = pids[rank];
  if (own_tag) result.shm_tag = tag;
  std::vector<bool> finished(pids.size(), false);
  size_t remaining = pids.size();
  const double limit_s =
      spec.hang_expected && !spec.hung ? spec.timeout_s : spec.timeout_s * timeout_scale();
  const auto deadline = start + std::chrono::duration<double>(limit_s);
  auto next_look = start;
  auto record = [&](size_t rank, int status) {
    if (WIFEXITED(status)) {
      result.ranks[rank].exit_code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      result.ranks[rank].signal = WTERMSIG(status);
    }
    finished[rank] = true;
    --remaining;
  };
  while (remaining > 0) {
    for (size_t rank = 0; rank < pids.size(); ++rank) {
      int status = 0;
      if (!finished[rank] && ::waitpid(pids[rank], &status, WNOHANG) == pids[rank]) {
        record(rank, status);
      }
    }
    if (remaining == 0) break;
    const auto now = std::chrono::steady_clock::now();
    if (spec.hung && now >= next_look) {
      next_look = now + std::chrono::milliseconds(50);
      if (spec.capture_output) read_output(dir, result);  // what the ranks said so far
      result.hung = spec.hung(result);
    }
    if (result.hung || (limit_s > 0 && now > deadline)) {
      result.timed_out = true;
      for (pid_t pid : pids) ::kill(-pid, SIGKILL);  // whole groups: what the ranks started too
      for (size_t rank = 0; rank < pids.size(); ++rank) {
        int status = 0;
        if (!finished[rank] && ::waitpid(pids[rank], &status, 0) == pids[rank])
          record(rank, status);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  result.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  if (spec.capture_output) read_output(dir, result);
  remove_entries(dir, "", true);
  bool killed = result.timed_out;
  for (const auto& r : result.ranks) killed |= r.signal != 0;
  // A rank killed before every rank joined leaves its segment's name behind; remove what this
  // launch's tag names.
  if (killed && own_tag) remove_entries("/dev/shm", "magi-standin-" + tag + "-", false);
  return result;
}

}  // namespace magi::support
