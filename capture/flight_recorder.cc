#include "capture/flight_recorder.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <new>
#include <stdexcept>

#include "base/base.h"
#include "base/host.h"

namespace magi::capture {

struct FlightRing {
  flight::RingHeader* header;
  flight::Record* records;
  uint64_t mask;  // capacity - 1
  uint64_t comm_id;
  flight::CompletionSource completion;
};

namespace flight {

uint32_t capacity_for(int64_t calls) {
  uint32_t capacity = kMinCapacity;
  while (capacity < calls && capacity < kMaxCapacity) capacity <<= 1;
  return capacity;
}

std::string_view unwatched_text(uint8_t reason) {
  switch (reason) {
    case kUnwatchedCaptured: return "captured into a CUDA graph";
    case kUnwatchedFailed: return "the call failed";
    case kUnwatchedInProgress: return "enqueued later (ncclInProgress)";
    case kUnwatchedBusy: return "no event free";
    case kUnwatchedDriver: return "an event call failed";
    case kUnwatchedNotRun: return "its group never ran";
    default: return "unknown reason";
  }
}

size_t segment_bytes(uint32_t capacity) {
  static_assert(sizeof(RingHeader) == 80);
  const size_t bytes = sizeof(RingHeader) + size_t{capacity} * sizeof(Record);
  return (bytes + kPage - 1) / kPage * kPage;
}

namespace {

// A live writer may store concurrently: read a published word as the writer wrote it.
uint64_t load(const uint64_t& word) {
  return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(word)).load(std::memory_order_acquire);
}

[[noreturn]] void malformed(const std::string& name, const std::string& what) {
  throw std::runtime_error(name + ": " + what);
}

}  // namespace

FileView parse_file(const std::string& name, std::span<const char> bytes) {
  FileView view;
  view.path = name;
  if (bytes.size() < sizeof(FileHeader) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    malformed(name, "not a flight recorder file");
  std::memcpy(&view.header, bytes.data(), sizeof(FileHeader));
  if (view.header.version != kVersion)
    malformed(name, "flight recorder version " + std::to_string(view.header.version) +
                        " (this reader knows " + std::to_string(kVersion) + ")");
  if (view.header.record_bytes != sizeof(Record) || view.header.header_bytes != kPage)
    malformed(name, "unexpected layout");
  size_t at = view.header.header_bytes;
  while (at + sizeof(SegmentHeader) <= bytes.size()) {
    SegmentHeader segment;
    std::memcpy(&segment, bytes.data() + at, sizeof(segment));
    const uint64_t seg = segment.bytes;
    if (seg == 0) break;  // the process died adding this segment
    if (seg % kPage != 0 || at + seg > bytes.size())
      malformed(name, "damaged segment at offset " + std::to_string(at));
    if (segment.kind == kSites && seg >= sizeof(SitesHeader)) {
      const auto* sites = reinterpret_cast<const SitesHeader*>(bytes.data() + at);
      const uint64_t used = std::min<uint64_t>(load(sites->used), seg - sizeof(SitesHeader));
      view.sites.emplace_back(bytes.data() + at + sizeof(SitesHeader), used);
    }
    if (segment.kind != kRing) {  // what this reader does not know, it skips
      at += seg;
      continue;
    }
    const auto* ring = reinterpret_cast<const RingHeader*>(bytes.data() + at);
    if (ring->capacity == 0 || (ring->capacity & (ring->capacity - 1)) != 0 ||
        seg != segment_bytes(ring->capacity))
      malformed(name, "damaged communicator segment at offset " + std::to_string(at));
    RingView rv;
    std::memcpy(&rv.header, ring, sizeof(RingHeader));
    const auto* records = reinterpret_cast<const Record*>(bytes.data() + at + sizeof(RingHeader));
    for (uint32_t i = 0; i < ring->capacity; ++i) {
      const Record& slot = records[i];
      const uint64_t before = load(slot.stamp);
      if (before == 0) {
        // Never written, or written when the process died: only the latter counts as torn.
        if (slot.seq != 0 || slot.count != 0 || slot.op != 0) ++rv.torn;
        continue;
      }
      Record copy;
      std::memcpy(&copy, &slot, sizeof(Record));
#if !defined(__SANITIZE_THREAD__)  // TSan refuses fences; its tests read no live writer
      std::atomic_thread_fence(std::memory_order_acquire);
#endif
      if (load(slot.stamp) != before || copy.seq + 1 != before ||
          (copy.seq & (ring->capacity - 1)) != i) {
        ++rv.torn;
        continue;
      }
      rv.records.push_back(copy);
    }
    std::sort(rv.records.begin(), rv.records.end(),
              [](const Record& a, const Record& b) { return a.seq < b.seq; });
    view.rings.push_back(std::move(rv));
    at += seg;
  }
  return view;
}

SitesHeader* init_sites(void* memory, size_t bytes) {
  auto* sites = static_cast<SitesHeader*>(memory);
  sites->segment.kind = kSites;
  std::atomic_ref<uint64_t>(sites->segment.bytes).store(bytes, std::memory_order_release);
  return sites;
}

bool append_site(SitesHeader& sites, trace::RecordType type, const void* payload,
                 uint32_t payload_bytes, const void* tail, uint32_t tail_bytes) {
  const uint64_t used = sites.used;  // the only writer
  const uint32_t bytes = trace::record_bytes(payload_bytes, tail_bytes);
  if (used + bytes > sites.segment.bytes - sizeof(SitesHeader)) return false;
  char* body = reinterpret_cast<char*>(&sites + 1);
  trace::encode_record(body + used, type, payload, payload_bytes, tail, tail_bytes);
  std::atomic_ref<uint64_t>(sites.used).store(used + bytes, std::memory_order_release);
  return true;
}

FileView read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open (" + std::strerror(errno) + ")");
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_file(path, std::span<const char>(bytes.data(), bytes.size()));
}

}  // namespace flight

namespace {

// The process's file: segments are appended under g_mutex at joins; the call path only touches
// mappings already made, which live until exit (a communicator's ring outlives its end, so a
// call racing a destroy still writes into mapped memory).
std::mutex g_mutex;
int g_fd = -1;
bool g_failed = false;
size_t g_file_bytes = 0;
uint32_t g_capacity = 0;
constexpr size_t kMaxMappings = 4096;
struct Mapping {
  void* at;
  size_t bytes;
};
Mapping g_mappings[kMaxMappings];
std::atomic<size_t> g_mapping_count{0};
// Rings live as long as their mappings (until exit), in a fixed array: nothing to free.
FlightRing g_rings[kMaxMappings];

flight::SitesHeader* g_sites = nullptr;  // the kSites segment being filled, under g_mutex

thread_local FlightRing* t_ring = nullptr;
thread_local flight::Record* t_slot = nullptr;
thread_local FlightRing* t_joining = nullptr;  // between flight_join(kJoining) and the init's end

std::string directory() {
  const Options& o = Options::get();
  if (!o.flight_recorder_dir.empty()) return o.flight_recorder_dir;
  if (!o.trace_dir.empty()) return o.trace_dir;
  return "/tmp";
}

void remember_mapping(void* at, size_t bytes) {
  const size_t n = g_mapping_count.load(std::memory_order_relaxed);
  if (n >= kMaxMappings) return;
  g_mappings[n] = {at, bytes};
  g_mapping_count.store(n + 1, std::memory_order_release);
}

// Under g_mutex. O_EXCL and O_NOFOLLOW, as the trace: never a planted symlink, never another
// run's file.
bool open_file_locked() {
  if (g_fd >= 0) return true;
  if (g_failed) return false;
  const std::string dir = directory();
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    MAGI_WARN(Trace, "flight recorder: cannot make %s (%s); the recorder is off", dir.c_str(),
              std::strerror(errno));
    g_failed = true;
    return false;
  }
  const std::string base = dir + "/magice." + short_host_name() + "." + std::to_string(getpid());
  std::string path;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    path = base + (attempt == 0 ? "" : "." + std::to_string(attempt)) + ".flight";
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(flight::kPage)) != 0) {
    MAGI_WARN(Trace, "flight recorder: cannot create a file in %s (%s); the recorder is off",
              dir.c_str(), std::strerror(errno));
    if (fd >= 0) ::close(fd);
    g_failed = true;
    return false;
  }
  void* at = mmap(nullptr, flight::kPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (at == MAP_FAILED) {
    MAGI_WARN(Trace, "flight recorder: cannot map %s (%s); the recorder is off", path.c_str(),
              std::strerror(errno));
    ::close(fd);
    g_failed = true;
    return false;
  }
  g_capacity = flight::capacity_for(Options::get().flight_recorder_calls);
  auto* h = static_cast<flight::FileHeader*>(at);
  std::memcpy(h->magic, flight::kMagic, sizeof(h->magic));
  h->version = flight::kVersion;
  h->header_bytes = flight::kPage;
  h->pid = static_cast<uint64_t>(getpid());
  h->start_monotonic_ns = clock_ns(CLOCK_MONOTONIC);
  h->start_realtime_ns = clock_ns(CLOCK_REALTIME);
  snprintf(h->host, sizeof(h->host), "%s", short_host_name());
  char exe[sizeof(h->program)] = {};
  if (readlink("/proc/self/exe", exe, sizeof(exe) - 1) > 0) {
    const char* slash = std::strrchr(exe, '/');
    snprintf(h->program, sizeof(h->program), "%s", slash ? slash + 1 : exe);
  }
  h->capacity = g_capacity;
  h->record_bytes = sizeof(flight::Record);
  remember_mapping(at, flight::kPage);
  g_fd = fd;
  g_file_bytes = flight::kPage;
  MAGI_INFO(Trace, "flight recorder: the last %u calls of each communicator go to %s", g_capacity,
            path.c_str());
  return true;
}

void init_ring(FlightRing* ring, void* memory, uint32_t capacity, uint64_t comm_id,
               uint64_t parent_id, int rank, int nranks, uint8_t origin, flight::JoinState state,
               flight::CompletionSource completion) {
  auto* header = static_cast<flight::RingHeader*>(memory);
  header->segment.kind = flight::kRing;
  header->joined = state;
  header->comm_id = comm_id;
  header->parent_id = parent_id;
  header->join_monotonic_ns = clock_ns(CLOCK_MONOTONIC);
  header->rank = rank;
  header->nranks = nranks;
  header->capacity = capacity;
  header->origin = origin;
  header->completion = completion;
  // Last: a reader takes a segment whose size is written as complete.
  std::atomic_ref<uint64_t>(header->segment.bytes)
      .store(flight::segment_bytes(capacity), std::memory_order_release);
  ring->header = header;
  ring->records = reinterpret_cast<flight::Record*>(header + 1);
  ring->mask = capacity - 1;
  ring->comm_id = comm_id;
  ring->completion = completion;
}

// Under g_mutex, with the file open: `bytes` more of it, mapped; null (and errno) on failure.
void* add_segment_locked(size_t bytes) {
  if (g_mapping_count.load(std::memory_order_relaxed) >= kMaxMappings) {
    errno = ENOSPC;
    return nullptr;
  }
  const size_t offset = g_file_bytes;
  void* at = MAP_FAILED;
  if (ftruncate(g_fd, static_cast<off_t>(offset + bytes)) == 0)
    at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, g_fd, static_cast<off_t>(offset));
  if (at == MAP_FAILED) return nullptr;
  g_file_bytes = offset + bytes;
  remember_mapping(at, bytes);
  return at;
}

}  // namespace

FlightRing* flight_join(uint64_t comm_id, uint64_t parent_id, int rank, int nranks, uint8_t origin,
                        flight::JoinState state, flight::CompletionSource completion) {
  if (Options::get().flight_recorder_calls == 0) return nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!open_file_locked()) return nullptr;
  if (g_mapping_count.load(std::memory_order_relaxed) >= kMaxMappings) {
    MAGI_INFO(Trace, "flight recorder: %zu communicators recorded; comm %012llx is not",
              kMaxMappings - 1, short_id(comm_id));
    return nullptr;
  }
  FlightRing* ring = &g_rings[g_mapping_count.load(std::memory_order_relaxed)];
  void* at = add_segment_locked(flight::segment_bytes(g_capacity));
  if (at == nullptr) {
    MAGI_WARN(Trace, "flight recorder: cannot add comm %012llx (%s); it is not recorded",
              short_id(comm_id), std::strerror(errno));
    return nullptr;
  }
  init_ring(ring, at, g_capacity, comm_id, parent_id, rank, nranks, origin, state, completion);
  if (state == flight::kJoining) t_joining = ring;
  return ring;
}

FlightRing* flight_take_joining(uint64_t comm_id) {
  FlightRing* ring = t_joining;
  t_joining = nullptr;
  return ring != nullptr && ring->comm_id == comm_id ? ring : nullptr;
}

void flight_set_joined(FlightRing* ring, flight::JoinState state, uint64_t parent_id) {
  if (ring == nullptr) return;
  ring->header->parent_id = parent_id;
  std::atomic_ref<uint8_t>(ring->header->joined).store(state, std::memory_order_release);
}

void flight_set_completion(FlightRing* ring, flight::CompletionSource completion) {
  if (ring == nullptr) return;
  ring->completion = completion;
  ring->header->completion = completion;
}

void flight_end(FlightRing* ring, uint8_t how) {
  if (ring == nullptr) return;
  std::atomic_ref<uint32_t>(ring->header->ended)
      .store(static_cast<uint32_t>(how) + 1, std::memory_order_release);
}

FlightSlot flight_issue(FlightRing* ring, const FlightCall& call) {
  flight::Record& r = ring->records[call.seq & ring->mask];
  std::atomic_ref<uint64_t> stamp(r.stamp);
  // The zero lands before the fields. TSan models no fences (and refuses them): an exchange
  // there orders the same, at the cost of a locked instruction.
#if defined(__SANITIZE_THREAD__)
  stamp.exchange(0, std::memory_order_acq_rel);
#else
  stamp.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
#endif
  std::atomic_ref<uint64_t>(r.returned).store(0, std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(r.reached).store(0, std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(r.completed).store(0, std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(r.unwatched).store(0, std::memory_order_relaxed);
  r.seq = call.seq;
  r.collective = call.collective;
  r.count = call.count;
  r.callsite = call.callsite;
  r.python = call.python;
  r.root_or_peer = call.root_or_peer;
  r.redop = call.redop;
  r.result = 0;
  r.op = call.op;
  r.dtype = call.dtype;
  r.group_depth = call.group_depth;
  r.flags = call.flags;
  stamp.store(call.seq + 1, std::memory_order_release);
  t_ring = ring;
  t_slot = &r;
  if (ring->completion == flight::kCompletionOff) return {};
  return {&r, ring->completion};
}

// The calling thread's last issued record is the one returning: the shim brackets each call by
// begin_call and end_call on one thread, with no other recorded call between them.
void flight_return(uint64_t comm_id, uint64_t seq, int32_t result) {
  flight::Record* r = t_slot;
  if (r == nullptr || t_ring->comm_id != comm_id || r->seq != seq) return;
  r->result = result;
  std::atomic_ref<uint64_t>(r->returned).store(seq + 1, std::memory_order_release);
  t_slot = nullptr;
}

void flight_add_site(trace::RecordType type, const void* payload, uint32_t payload_bytes,
                     const void* tail, uint32_t tail_bytes) {
  constexpr size_t kBody = flight::kSitesSegmentBytes - sizeof(flight::SitesHeader);
  if (trace::record_bytes(payload_bytes, tail_bytes) > kBody) return;  // not with our records
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_fd < 0) return;
  if (g_sites != nullptr &&
      flight::append_site(*g_sites, type, payload, payload_bytes, tail, tail_bytes))
    return;
  void* at = add_segment_locked(flight::kSitesSegmentBytes);
  if (at == nullptr) {
    MAGI_INFO(Trace, "flight recorder: cannot add call sites (%s); later ones are not kept",
              std::strerror(errno));
    g_sites = nullptr;
    return;
  }
  g_sites = flight::init_sites(at, flight::kSitesSegmentBytes);
  flight::append_site(*g_sites, type, payload, payload_bytes, tail, tail_bytes);
}

void flight_sync() {
  const size_t n = g_mapping_count.load(std::memory_order_acquire);
  for (size_t i = 0; i < n; ++i) msync(g_mappings[i].at, g_mappings[i].bytes, MS_ASYNC);
}

void flight_forget_in_child() {
  // The parent's mappings stay mapped (a set-aside communicator's ring points into them) but
  // no later join appends to the parent's file. g_mutex may have been held by a parent thread.
  new (&g_mutex) std::mutex();
  if (g_fd >= 0) ::close(g_fd);
  g_fd = -1;
  g_failed = false;
  g_file_bytes = 0;
  g_sites = nullptr;
  t_ring = nullptr;
  t_slot = nullptr;
  t_joining = nullptr;
}

FlightRing* flight_ring_in(void* memory, uint32_t capacity, uint64_t comm_id, int rank, int nranks,
                           flight::CompletionSource completion) {
  auto* ring = new FlightRing{};
  init_ring(ring, memory, capacity, comm_id, 0, rank, nranks, 0, flight::kJoined, completion);
  return ring;
}

void flight_ring_release(FlightRing* ring) {
  if (t_ring == ring) {
    t_ring = nullptr;
    t_slot = nullptr;
  }
  delete ring;
}

}  // namespace magi::capture
