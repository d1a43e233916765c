// What the benchmarks share: opening a library and finding its functions, or saying why not and
// exiting (status 2) with the tool's name first.
#pragma once

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

namespace magi::bench {

inline void* must_open(const char* tool, const char* path, int flags) {
  void* handle = dlopen(path, flags);
  if (handle == nullptr) {
    std::fprintf(stderr, "%s: cannot open %s: %s\n", tool, path, dlerror());
    std::exit(2);
  }
  return handle;
}

template <class Fn>
Fn must_find(const char* tool, void* handle, const char* name) {
  void* f = dlsym(handle, name);
  if (f == nullptr) {
    std::fprintf(stderr, "%s: %s not found\n", tool, name);
    std::exit(2);
  }
  return reinterpret_cast<Fn>(f);
}

}  // namespace magi::bench
