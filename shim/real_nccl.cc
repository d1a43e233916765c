#include "shim/real_nccl.h"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "base/log.h"
#include "base/options.h"

namespace magi::shim {
namespace {

// The load base of this library: a symbol resolving here is ourselves, never the real NCCL.
const void* own_base() {
  static const void* base = [] {
    Dl_info info{};
    dladdr(reinterpret_cast<const void*>(&own_base), &info);
    return info.dli_fbase;
  }();
  return base;
}

bool is_ours(void* symbol) {
  Dl_info info{};
  return dladdr(symbol, &info) != 0 && info.dli_fbase == own_base();
}

// pnccl names first: they are NCCL's own aliases, so no interposer (us included) shadows them.
void* lookup(void* handle, const char* name) {
  for (const char* prefix : {"pnccl", "nccl"}) {
    const std::string symbol = std::string(prefix) + name;
    void* found = dlsym(handle, symbol.c_str());
    if (found != nullptr && !is_ours(found)) return found;
  }
  return nullptr;
}

// Fills `real` from `handle`; true if at least one function resolved.
bool bind_all(RealNccl& real, void* handle) {
  bool any = false;
  void* first = nullptr;
#define MAGI_BIND(ret, name, params)                \
  if (void* f = lookup(handle, #name)) {            \
    real.name = reinterpret_cast<ret(*) params>(f); \
    any = true;                                     \
    if (first == nullptr) first = f;                \
  }
  MAGI_NCCL_FUNCTIONS(MAGI_BIND)
#undef MAGI_BIND
  if (any) {
    Dl_info info{};
    if (dladdr(first, &info) != 0 && info.dli_fname != nullptr)
      snprintf(real.path, sizeof(real.path), "%s", info.dli_fname);
  }
  return any;
}

std::vector<std::string> loaded_nccl_candidates() {
  std::vector<std::string> paths;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        if (info->dlpi_name == nullptr || info->dlpi_name[0] == '\0') return 0;
        const char* slash = std::strrchr(info->dlpi_name, '/');
        const char* base = slash ? slash + 1 : info->dlpi_name;
        if (std::strncmp(base, "libnccl", 7) == 0)
          static_cast<std::vector<std::string>*>(out)->emplace_back(info->dlpi_name);
        return 0;
      },
      &paths);
  return paths;
}

RealNccl resolve() {
  RealNccl real;
  auto attempt = [&](void* handle, const char* how) {
    if (handle == nullptr || !bind_all(real, handle)) return false;
    real.found = true;
    real.how = how;
    return true;
  };
  if (attempt(dlopen("libnccl.so.2", RTLD_NOLOAD | RTLD_LAZY), "already loaded as libnccl.so.2"))
    return real;
  for (const std::string& path : loaded_nccl_candidates())
    if (attempt(dlopen(path.c_str(), RTLD_NOLOAD | RTLD_LAZY), "found among loaded libraries"))
      return real;
  if (attempt(RTLD_NEXT, "next in the global scope")) return real;
  if (const std::string& path = Options::get().nccl_library; !path.empty()) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr)
      MAGI_WARN(Init, "MAGI_NCCL_LIBRARY=%s could not be opened: %s", path.c_str(), dlerror());
    if (attempt(handle, "MAGI_NCCL_LIBRARY")) return real;
  }
  return real;
}

}  // namespace

const RealNccl& real_nccl() {
  static const RealNccl real = [] {
    RealNccl r = resolve();
    if (!r.found) {
      MAGI_WARN(Init,
                "no real NCCL found (not loaded as libnccl.so.2, none among loaded libraries, none "
                "after this library; set MAGI_NCCL_LIBRARY=/path/to/libnccl.so.2): every NCCL call "
                "returns ncclSystemError");
    } else {
      int version = 0;
      if (r.GetVersion != nullptr) r.GetVersion(&version);
      MAGI_INFO(Init, "real NCCL %d (%s): %s", version, r.how, r.path);
    }
    return r;
  }();
  return real;
}

ncclResult_t missing_function(const char* name) {
  if (!real_nccl().found) return ncclSystemError;  // already said once, at resolution
  // One line per missing function: a small fixed table of names already reported.
  static std::atomic<const char*> reported[64];
  for (auto& slot : reported) {
    const char* seen = slot.load(std::memory_order_acquire);
    if (seen == name) return ncclInvalidUsage;
    if (seen == nullptr) {
      if (slot.compare_exchange_strong(seen, name)) {
        MAGI_WARN(Shim,
                  "nccl%s: the real NCCL (%s) does not provide it; returning ncclInvalidUsage",
                  name, real_nccl().path);
        return ncclInvalidUsage;
      }
      if (seen == name) return ncclInvalidUsage;
    }
  }
  return ncclInvalidUsage;
}

}  // namespace magi::shim
