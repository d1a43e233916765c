#include "base/host.h"

#include <limits.h>
#include <unistd.h>

#include <cstring>

#include "base/options.h"

namespace magi {
namespace {

struct HostNames {
  HostNames() {
    if (gethostname(full, sizeof(full) - 1) != 0) full[0] = '\0';
    std::memcpy(short_name, full, sizeof(short_name) - 1);
    if (char* dot = std::strchr(short_name, '.')) *dot = '\0';
  }
  char full[HOST_NAME_MAX + 1] = {};
  char short_name[64] = {};  // as file names and log lines have always had it: 63 at most
};

const HostNames& host_names() {
  static const HostNames names;
  return names;
}

}  // namespace

const char* host_name() noexcept { return host_names().full; }
const char* short_host_name() noexcept { return host_names().short_name; }

const char* machine_name() noexcept {
  const std::string& injected = Options::get().inject_host;
  return injected.empty() ? host_name() : injected.c_str();
}

}  // namespace magi
