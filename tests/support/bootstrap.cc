#include "tests/support/bootstrap.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <thread>

namespace magi::support {
namespace {

constexpr auto kIdWait = std::chrono::seconds(60);

int int_from_env(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    throw std::runtime_error(std::string(name) + " is not set (run the program under magi-launch)");
  }
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  if (*end != '\0' || value < 0 || value > 1 << 20) {
    throw std::runtime_error(std::string(name) + "=" + text + " is not a rank count or index");
  }
  return static_cast<int>(value);
}

void publish_id(const std::string& path, const ncclUniqueId& id) {
  // Written whole under a temporary name, then renamed: a reader sees all of it or nothing.
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out.write(id.internal, sizeof id.internal);
    if (!out) throw std::runtime_error("cannot write " + temp + ": " + std::strerror(errno));
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error("cannot rename " + temp + " to " + path + ": " + std::strerror(errno));
  }
}

ncclUniqueId await_id(const std::string& path) {
  const auto deadline = std::chrono::steady_clock::now() + kIdWait;
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (bytes.size() != sizeof(ncclUniqueId)) {
        throw std::runtime_error(path + " holds " + std::to_string(bytes.size()) +
                                 " bytes, not an ncclUniqueId (" +
                                 std::to_string(sizeof(ncclUniqueId)) + ")");
      }
      ncclUniqueId id;
      std::memcpy(id.internal, bytes.data(), sizeof id.internal);
      return id;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("rank 0 did not publish the unique id in " + path + " within " +
                               std::to_string(kIdWait.count()) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace

Bootstrap bootstrap_from_env() {
  Bootstrap b;
  b.rank = int_from_env("STANDIN_RANK");
  b.nranks = int_from_env("STANDIN_NRANKS");
  if (b.nranks < 1 || b.rank >= b.nranks) {
    throw std::runtime_error("STANDIN_RANK=" + std::to_string(b.rank) +
                             " is not below STANDIN_NRANKS=" + std::to_string(b.nranks));
  }
  const char* file = std::getenv("STANDIN_ID_FILE");
  if (file == nullptr || *file == '\0') {
    throw std::runtime_error("STANDIN_ID_FILE is not set (run the program under magi-launch)");
  }
  if (b.rank == 0) {
    ncclResult_t result = ncclGetUniqueId(&b.id);
    if (result != ncclSuccess) {
      throw std::runtime_error(std::string("ncclGetUniqueId failed: ") +
                               ncclGetErrorString(result));
    }
    publish_id(file, b.id);
  } else {
    b.id = await_id(file);
  }
  return b;
}

}  // namespace magi::support
