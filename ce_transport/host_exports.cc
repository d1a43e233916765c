// The host backend's exports (exports.h): shared mappings of named files in /dev/shm, found in
// /proc/self/maps at plan time (never on the call path) and mapped by the peers by name.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include "base/base.h"
#include "ce_transport/exports.h"

namespace magi::ce::exports {
namespace {

constexpr char kSharedMemoryDir[] = "/dev/shm/";
constexpr size_t kNameBytes = 40;

// What the host backend puts in an ExportRecord's handle.
struct HostHandle {
  char name[kNameBytes];  // under /dev/shm, NUL-terminated
  uint64_t file_offset;   // of the mapping's start
  uint64_t inode;
  uint64_t device;
};
static_assert(sizeof(HostHandle) == sizeof(ExportRecord::handle));

struct Mapping {
  uintptr_t start = 0, end = 0;
  bool shared = false;
  uint64_t file_offset = 0;
  uint64_t device = 0;
  uint64_t inode = 0;
  std::string path;
};

// The line of /proc/self/maps holding `at`; false when none does.
bool find_mapping(uintptr_t at, Mapping& found) {
  FILE* maps = std::fopen("/proc/self/maps", "re");
  if (maps == nullptr) return false;
  char line[4096 + 256];
  bool hit = false;
  while (std::fgets(line, sizeof(line), maps) != nullptr) {
    uintptr_t start = 0, end = 0;
    char perms[8] = {};
    uint64_t offset = 0, inode = 0;
    unsigned major = 0, minor = 0;
    int path_at = 0;
    if (std::sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %7s %" SCNx64 " %x:%x %" SCNu64 " %n", &start,
                    &end, perms, &offset, &major, &minor, &inode, &path_at) < 7)
      continue;
    if (at < start || at >= end) continue;
    found.start = start;
    found.end = end;
    found.shared = perms[3] == 's';
    found.file_offset = offset;
    found.device = makedev(major, minor);
    found.inode = inode;
    found.path = line + path_at;
    while (!found.path.empty() && (found.path.back() == '\n' || found.path.back() == ' '))
      found.path.pop_back();
    hit = true;
    break;
  }
  std::fclose(maps);
  return hit;
}

}  // namespace

Exportable find_host_export(const void* ptr, size_t bytes) {
  Exportable e;
  const auto at = reinterpret_cast<uintptr_t>(ptr);
  Mapping m;
  if (!find_mapping(at, m)) {
    e.refusal = "not mapped";
    return e;
  }
  const std::string dir = kSharedMemoryDir;
  if (!m.shared || m.path.compare(0, dir.size(), dir) != 0 || m.inode == 0) {
    e.refusal = "not a shared mapping of a file in /dev/shm";
    return e;
  }
  if (m.path.find(" (deleted)") != std::string::npos) {
    e.refusal = "its file in /dev/shm was removed";
    return e;
  }
  const std::string name = m.path.substr(dir.size());
  if (name.empty() || name.size() >= kNameBytes || name.find('/') != std::string::npos) {
    e.refusal = "its file's name is not a short name in /dev/shm";
    return e;
  }
  if (at + bytes > m.end) {
    e.refusal = "the shard runs past its mapping";
    return e;
  }
  HostHandle handle{};
  std::memcpy(handle.name, name.data(), name.size());
  handle.file_offset = m.file_offset;
  handle.inode = m.inode;
  handle.device = m.device;
  std::memcpy(e.record.handle, &handle, sizeof(handle));
  e.record.bytes = m.end - m.start;
  e.base = m.start;
  e.identity = m.inode;
  e.ok = true;
  return e;
}

bool host_export_alive(uintptr_t base, uint64_t identity) {
  Mapping m;
  return find_mapping(base, m) && m.start == base && m.shared && m.inode == identity;
}

HostImport HostImport::open(const ExportRecord& record) {
  HostHandle handle{};
  std::memcpy(&handle, record.handle, sizeof(handle));
  if (strnlen(handle.name, kNameBytes) == kNameBytes || handle.name[0] == '\0' ||
      std::strchr(handle.name, '/') != nullptr)
    throw Error(ErrorKind::Usage, "an export names no file");
  const std::string path = std::string(kSharedMemoryDir) + handle.name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0)
    throw Error(ErrorKind::System, "opening a peer's export " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_ino) != handle.inode ||
      static_cast<uint64_t>(st.st_dev) != handle.device ||
      static_cast<uint64_t>(st.st_size) < handle.file_offset + record.bytes) {
    ::close(fd);
    throw Error(ErrorKind::Usage, "a peer's export " + path + " is not the file it exported");
  }
  void* base = mmap(nullptr, record.bytes, PROT_READ, MAP_SHARED, fd,
                    static_cast<off_t>(handle.file_offset));
  const int mapped_errno = errno;
  ::close(fd);
  if (base == MAP_FAILED)
    throw Error(ErrorKind::System,
                "mapping a peer's export " + path + ": " + std::strerror(mapped_errno));
  HostImport import;
  import.base_ = base;
  import.bytes_ = record.bytes;
  return import;
}

HostImport::HostImport(HostImport&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

HostImport& HostImport::operator=(HostImport&& other) noexcept {
  std::swap(base_, other.base_);
  std::swap(bytes_, other.bytes_);
  return *this;
}

HostImport::~HostImport() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

}  // namespace magi::ce::exports
