// libfull_disk.so: a disk that fills up, for tests. Preloaded before the shim, it lets writes to
// files whose name ends in ".trace" through until FULL_DISK_BYTES bytes in all, then fails them
// with ENOSPC, as a full file system does. Every other write passes untouched.
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <atomic>

namespace {

using WriteFn = ssize_t (*)(int, const void*, size_t);

bool is_trace(int fd) {
  char link[64];
  char path[4096];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, path, sizeof path - 1);
  if (n < 6) return false;
  path[n] = '\0';
  return strcmp(path + n - 6, ".trace") == 0;
}

std::atomic<long long> g_written{0};

}  // namespace

extern "C" __attribute__((visibility("default"))) ssize_t write(int fd, const void* buf,
                                                                size_t count) {
  static const WriteFn real = reinterpret_cast<WriteFn>(dlsym(RTLD_NEXT, "write"));
  static const long long limit = [] {
    const char* v = getenv("FULL_DISK_BYTES");
    return v != nullptr ? atoll(v) : 0;
  }();
  if (is_trace(fd)) {
    const long long room = limit - g_written.load();
    if (room <= 0) {
      errno = ENOSPC;
      return -1;
    }
    const size_t take = count < static_cast<size_t>(room) ? count : static_cast<size_t>(room);
    const ssize_t n = real(fd, buf, take);
    if (n > 0) g_written += n;
    return n;
  }
  return real(fd, buf, count);
}
