// The host backend's exports (exports.h): shared mappings of named files in /dev/shm, found in
// /proc/self/maps at plan time (never on the call path) and mapped by the peers by name.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/base.h"
#include "ce_transport/exports.h"

namespace magi::ce::exports {
namespace {

constexpr char kSharedMemoryDir[] = "/dev/shm/";
constexpr char kMemfdPrefix[] = "/memfd:";
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

// One line of /proc/self/maps; false when it does not parse.
bool parse_mapping(const char* line, Mapping& m) {
  uintptr_t start = 0, end = 0;
  char perms[8] = {};
  uint64_t offset = 0, inode = 0;
  unsigned major = 0, minor = 0;
  int path_at = 0;
  if (std::sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %7s %" SCNx64 " %x:%x %" SCNu64 " %n", &start,
                  &end, perms, &offset, &major, &minor, &inode, &path_at) < 7)
    return false;
  m.start = start;
  m.end = end;
  m.shared = perms[3] == 's';
  m.file_offset = offset;
  m.device = makedev(major, minor);
  m.inode = inode;
  m.path = line + path_at;
  while (!m.path.empty() && (m.path.back() == '\n' || m.path.back() == ' ')) m.path.pop_back();
  return true;
}

// Calls `visit` with each mapping of /proc/self/maps until it returns false.
template <typename Visit>
void for_each_mapping(Visit&& visit) {
  FILE* maps = std::fopen("/proc/self/maps", "re");
  if (maps == nullptr) return;
  char line[4096 + 256];
  Mapping m;
  while (std::fgets(line, sizeof(line), maps) != nullptr)
    if (parse_mapping(line, m) && !visit(m)) break;
  std::fclose(maps);
}

// The line of /proc/self/maps holding `at`; false when none does.
bool find_mapping(uintptr_t at, Mapping& found) {
  bool hit = false;
  for_each_mapping([&](const Mapping& m) {
    if (at < m.start || at >= m.end) return true;
    found = m;
    hit = true;
    return false;
  });
  return hit;
}

}  // namespace

namespace {

// What `mapping` (the one holding ptr; null: none does) makes of the shard at ptr.
Exportable export_of(const void* ptr, size_t bytes, const Mapping* mapping) {
  Exportable e;
  const auto at = reinterpret_cast<uintptr_t>(ptr);
  if (mapping == nullptr) {
    e.refusal = "not mapped";
    return e;
  }
  const Mapping& m = *mapping;
  const std::string dir = kSharedMemoryDir;
  const bool memfd = m.path.rfind(kMemfdPrefix, 0) == 0;
  if (!m.shared || m.inode == 0 || (!memfd && m.path.compare(0, dir.size(), dir) != 0)) {
    e.refusal = "not a shared mapping of a file in /dev/shm or of a memfd";
    return e;
  }
  if (at + bytes > m.end) {
    e.refusal = "the shard runs past its mapping";
    return e;
  }
  // No name a peer could open: the owner hands a descriptor of the file instead.
  if (memfd || m.path.find(" (deleted)") != std::string::npos) {
    e.record.kind = ExportRecord::Kind::ByDescriptor;
    e.record.bytes = m.end - m.start;
    e.base = m.start;
    e.identity = m.inode;
    e.pieces = {{m.start, m.end - m.start}};
    e.ok = true;
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

}  // namespace

Exportable find_host_export(const void* ptr, size_t bytes) {
  Mapping m;
  return export_of(ptr, bytes, find_mapping(reinterpret_cast<uintptr_t>(ptr), m) ? &m : nullptr);
}

std::function<Exportable(const void*, size_t)> host_export_finder() {
  // Read once, sorted by start: a plan's thousand shards take one read of the maps, not one each.
  auto mappings = std::make_shared<std::vector<Mapping>>();
  for_each_mapping([&](const Mapping& m) {
    mappings->push_back(m);
    return true;
  });
  std::sort(mappings->begin(), mappings->end(),
            [](const Mapping& a, const Mapping& b) { return a.start < b.start; });
  return [mappings](const void* ptr, size_t bytes) {
    const auto at = reinterpret_cast<uintptr_t>(ptr);
    auto after = std::upper_bound(mappings->begin(), mappings->end(), at,
                                  [](uintptr_t a, const Mapping& m) { return a < m.start; });
    const Mapping* holder = nullptr;
    if (after != mappings->begin() && at < std::prev(after)->end) holder = &*std::prev(after);
    return export_of(ptr, bytes, holder);
  };
}

bool host_export_alive(uintptr_t base, size_t bytes, uint64_t identity) {
  // The kernel names each mapping by its exact range in /proc/self/map_files: one lookup, where
  // a scan of /proc/self/maps costs a line per mapping (thousands, with the peers' shards
  // mapped), at every check. Where that lookup is not allowed, or the range is no longer one
  // mapping, the scan decides.
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/map_files/%" PRIxPTR "-%" PRIxPTR, base,
                base + bytes);
  struct stat st {};
  if (::stat(path, &st) == 0 && static_cast<uint64_t>(st.st_ino) == identity) return true;
  Mapping m;
  return find_mapping(base, m) && m.start == base && m.shared && m.inode == identity;
}

int host_export_descriptor(uintptr_t base, size_t bytes, uint64_t identity, uint64_t& file_offset) {
  Mapping m;
  if (!find_mapping(base, m) || m.start != base || m.end - m.start != bytes || m.inode != identity)
    throw Error(ErrorKind::System, "its mapping is no longer the one found");
  file_offset = m.file_offset;
  auto same_file = [&](int fd) {
    struct stat st {};
    return ::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_ino) == identity &&
           S_ISREG(st.st_mode);
  };
  // A descriptor the program still holds of the file (a memfd usually stays open).
  if (DIR* fds = ::opendir("/proc/self/fd")) {
    int found = -1;
    while (const dirent* entry = ::readdir(fds)) {
      char* end = nullptr;
      const long fd = std::strtol(entry->d_name, &end, 10);
      if (end == entry->d_name || *end != '\0' || fd == ::dirfd(fds)) continue;
      if (!same_file(static_cast<int>(fd))) continue;
      found = ::fcntl(static_cast<int>(fd), F_DUPFD_CLOEXEC, 0);
      if (found >= 0) break;
    }
    ::closedir(fds);
    if (found >= 0) return found;
  }
  // Else the mapping itself, where this process may open it (CAP_SYS_ADMIN or
  // CAP_CHECKPOINT_RESTORE).
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/map_files/%" PRIxPTR "-%" PRIxPTR, base,
                base + bytes);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd >= 0 && same_file(fd)) return fd;
  if (fd >= 0) ::close(fd);
  throw Error(ErrorKind::System,
              "no descriptor of its file is open in this process, and /proc/self/map_files is "
              "closed to it");
}

namespace {

// An export by descriptor: the owner's file, from its channel, mapped like a named one.
void* map_by_descriptor(const ExportRecord& record) {
  int file = -1;
  const std::vector<uint8_t> payload =
      fd_channel::fetch(descriptor_source(record), record.index, [&](size_t, int fd) {
        if (file >= 0) ::close(file);
        file = fd;
      });
  uint64_t said[3] = {};  // the file offset, inode and device
  struct stat st {};
  if (file < 0 || payload.size() != sizeof(said) || ::fstat(file, &st) != 0) {
    if (file >= 0) ::close(file);
    throw Error(ErrorKind::Usage, "a peer's export by descriptor came without its file");
  }
  std::memcpy(said, payload.data(), sizeof(said));
  if (static_cast<uint64_t>(st.st_ino) != said[1] || static_cast<uint64_t>(st.st_dev) != said[2] ||
      static_cast<uint64_t>(st.st_size) < said[0] + record.bytes) {
    ::close(file);
    throw Error(ErrorKind::Usage, "a peer's export by descriptor is not the file it exported");
  }
  void* base =
      mmap(nullptr, record.bytes, PROT_READ, MAP_SHARED, file, static_cast<off_t>(said[0]));
  const int mapped_errno = errno;
  ::close(file);
  if (base == MAP_FAILED)
    throw Error(ErrorKind::System, std::string("mapping a peer's export by descriptor: ") +
                                       std::strerror(mapped_errno));
  return base;
}

}  // namespace

HostImport HostImport::open(const ExportRecord& record) {
  if (record.kind == ExportRecord::Kind::ByDescriptor) {
    HostImport import;
    import.base_ = map_by_descriptor(record);
    import.bytes_ = record.bytes;
    return import;
  }
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
