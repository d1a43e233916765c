// Call-site fingerprints (capture/callsite.h).
//
// Per call: unw_backtrace for the raw return addresses; one dl_iterate_phdr that stops at the
// first module, to read the loader's load/unload counters (it holds the loader's lock for those
// few instructions: no syscall unless a dlopen is running); then a per-thread cache keyed by the
// raw frames above the library's own. A hit costs one hash of those frames; a miss normalises
// each frame by binary search in the module table and refills the slot.
//
// Why the counters are read on every call, hit or miss: a cached entry ties raw addresses to
// module keys, and a library unloaded with another mapped at the same address would make it
// wrong. The counters change with every load and unload, a table remembers the counters it was
// built under, and a cache entry the table it was filled from; so an entry is only ever used
// with the modules that were mapped when its frames were resolved. The frames themselves cannot
// go stale during a call: code that is on the caller's stack cannot be unloaded under it.
//
// The module table is immutable once published. Readers find it through a per-thread hazard
// slot (held between calls, so the common path only compares counters), and a retired table is
// freed only when no slot holds it: no reader ever takes a lock, and at most one table per
// thread outlives its replacement.
#include "capture/callsite.h"

#include <elf.h>
#include <libunwind.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "base/free_later.h"

namespace magi::capture {
namespace {

constexpr int kMaxDepth = 64;                // MAGI_CALLSITE_DEPTH's upper bound
constexpr int kMaxCapture = kMaxDepth + 64;  // depth plus the library's own frames
constexpr size_t kCacheEntries = 64;         // per thread; a thread has few NCCL call sites

// ---- the loader's counters --------------------------------------------------------------------

struct LoaderCounters {
  unsigned long long adds = 0;
  unsigned long long subs = 0;
  // Both only grow, so a table built at or after a reading describes the modules of that moment.
  bool covers(const LoaderCounters& reading) const {
    return adds >= reading.adds && subs >= reading.subs;
  }
};

bool has_counters(size_t info_size) {
  return info_size >= offsetof(dl_phdr_info, dlpi_subs) + sizeof(dl_phdr_info::dlpi_subs);
}

LoaderCounters read_loader_counters() {
  LoaderCounters counters;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t size, void* data) {
        if (has_counters(size)) {
          auto* out = static_cast<LoaderCounters*>(data);
          out->adds = info->dlpi_adds;
          out->subs = info->dlpi_subs;
        }
        return 1;  // every entry carries the same counters: the first is enough
      },
      &counters);
  return counters;
}

// ---- the module table -------------------------------------------------------------------------

struct ModuleRange {
  uintptr_t start;
  uintptr_t end;   // exclusive
  uintptr_t base;  // the module's load base: offsets are taken from here
  uint64_t key;
};

struct ModuleTable {
  LoaderCounters counters;          // read in the same pass that listed the modules
  uint64_t generation = 0;          // tells cache entries of different tables apart; never 0
  std::vector<ModuleRange> ranges;  // PT_LOAD segments, sorted, disjoint
  std::vector<std::pair<uintptr_t, uintptr_t>> own;  // segments of the module holding this code

  const ModuleRange* find(uintptr_t address) const {
    auto after = std::upper_bound(ranges.begin(), ranges.end(), address,
                                  [](uintptr_t a, const ModuleRange& r) { return a < r.start; });
    if (after == ranges.begin()) return nullptr;
    const ModuleRange& range = *(after - 1);
    return address < range.end ? &range : nullptr;
  }

  bool is_own(uintptr_t address) const {
    for (const auto& [start, end] : own)
      if (address >= start && address < end) return true;
    return false;
  }
};

std::string_view basename_of(std::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

// The main program is listed with an empty name.
std::string program_path() {
  char path[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return "[program]";
  return std::string(path, static_cast<size_t>(n));
}

// Reads notes only inside a loaded segment, where the bytes are mapped.
bool note_is_mapped(const dl_phdr_info& info, const ElfW(Phdr) & note) {
  for (int i = 0; i < info.dlpi_phnum; ++i) {
    const ElfW(Phdr)& load = info.dlpi_phdr[i];
    if (load.p_type == PT_LOAD && note.p_vaddr >= load.p_vaddr &&
        note.p_vaddr + note.p_memsz <= load.p_vaddr + load.p_filesz)
      return true;
  }
  return false;
}

bool find_build_id(const dl_phdr_info& info, std::string_view& build_id) {
  for (int i = 0; i < info.dlpi_phnum; ++i) {
    const ElfW(Phdr)& segment = info.dlpi_phdr[i];
    if (segment.p_type != PT_NOTE || !note_is_mapped(info, segment)) continue;
    const size_t align = segment.p_align == 8 ? 8 : 4;
    const auto pad = [align](size_t bytes) { return (bytes + align - 1) & ~(align - 1); };
    const char* at = reinterpret_cast<const char*>(info.dlpi_addr + segment.p_vaddr);
    size_t left = segment.p_memsz;
    while (left >= sizeof(ElfW(Nhdr))) {
      ElfW(Nhdr) header;
      std::memcpy(&header, at, sizeof(header));
      const size_t name_bytes = pad(header.n_namesz);
      const size_t note_bytes = sizeof(header) + name_bytes + pad(header.n_descsz);
      if (note_bytes > left) break;  // malformed: stop rather than read past the segment
      const char* name = at + sizeof(header);
      if (header.n_type == NT_GNU_BUILD_ID && header.n_namesz == 4 &&
          std::memcmp(name, "GNU", 4) == 0 && header.n_descsz > 0) {
        build_id = std::string_view(name + name_bytes, header.n_descsz);
        return true;
      }
      at += note_bytes;
      left -= note_bytes;
    }
  }
  return false;
}

struct TableBuild {
  ModuleTable* table;
  std::vector<std::pair<uint64_t, ModuleIdentity>> names;
  std::string program;
  uintptr_t own_address;
  bool first = true;
};

int add_module(dl_phdr_info* info, size_t size, void* data) {
  auto& build = *static_cast<TableBuild*>(data);
  const bool is_program = build.first && (info->dlpi_name == nullptr || info->dlpi_name[0] == 0);
  if (build.first && has_counters(size))
    build.table->counters = LoaderCounters{info->dlpi_adds, info->dlpi_subs};
  build.first = false;

  std::string path =
      is_program ? build.program : std::string(info->dlpi_name ? info->dlpi_name : "");
  std::string name(basename_of(path));
  std::string_view build_id;
  const uint64_t key = find_build_id(*info, build_id)
                           ? XXH3_64bits(build_id.data(), build_id.size())
                           : XXH3_64bits(name.data(), name.size());
  const size_t first_range = build.table->ranges.size();
  bool holds_own = false;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& segment = info->dlpi_phdr[i];
    if (segment.p_type != PT_LOAD || segment.p_memsz == 0) continue;
    const uintptr_t start = info->dlpi_addr + segment.p_vaddr;
    const uintptr_t end = start + segment.p_memsz;
    build.table->ranges.push_back(ModuleRange{start, end, info->dlpi_addr, key});
    holds_own = holds_own || (build.own_address >= start && build.own_address < end);
  }
  if (holds_own)
    for (size_t i = first_range; i < build.table->ranges.size(); ++i)
      build.table->own.emplace_back(build.table->ranges[i].start, build.table->ranges[i].end);
  build.names.emplace_back(key,
                           ModuleIdentity{std::move(name), std::move(path), std::string(build_id)});
  return 0;
}

// ---- publication: one current table, retired ones freed when no reader holds them -------------

struct HazardSlot {
  std::atomic<const ModuleTable*> held{nullptr};
  std::atomic<bool> in_use{true};
  HazardSlot* next = nullptr;
};

std::atomic<const ModuleTable*> g_table{nullptr};
std::atomic<HazardSlot*> g_slots{nullptr};  // grows only; a slot is reused after its thread ends

// Guards building and retiring tables and the name registry; never taken on the call path.
std::mutex g_build_mutex;
uint64_t g_generation = 0;
// Left allocated at exit on purpose: a call made while the process exits may still need them.
FreeLater<const ModuleTable*>* g_retired = nullptr;
std::unordered_map<uint64_t, ModuleIdentity>* g_module_names = nullptr;

HazardSlot* acquire_slot() {
  for (HazardSlot* slot = g_slots.load(std::memory_order_acquire); slot; slot = slot->next) {
    bool free = false;
    if (!slot->in_use.load(std::memory_order_relaxed) &&
        slot->in_use.compare_exchange_strong(free, true, std::memory_order_acq_rel))
      return slot;
  }
  auto* slot = new HazardSlot;
  HazardSlot* head = g_slots.load(std::memory_order_relaxed);
  do {
    slot->next = head;
  } while (!g_slots.compare_exchange_weak(head, slot, std::memory_order_release,
                                          std::memory_order_relaxed));
  return slot;
}

bool held_by_any_reader(const ModuleTable* table) {
  for (HazardSlot* slot = g_slots.load(std::memory_order_acquire); slot; slot = slot->next)
    if (slot->held.load(std::memory_order_seq_cst) == table) return true;
  return false;
}

// The reader's half of the hazard protocol: announce the table, then check it is still current.
// A writer swaps the table before it scans the slots, so (all seq_cst) either the writer sees
// the announcement or the reader sees the swap and retries.
const ModuleTable* protect_current(HazardSlot& slot) {
  const ModuleTable* table = g_table.load(std::memory_order_seq_cst);
  for (;;) {
    slot.held.store(table, std::memory_order_seq_cst);
    const ModuleTable* again = g_table.load(std::memory_order_seq_cst);
    if (again == table) return table;
    table = again;
  }
}

ModuleTable* build_table() {
  auto* table = new ModuleTable;
  table->generation = ++g_generation;
  TableBuild build{table, {}, program_path(), reinterpret_cast<uintptr_t>(&read_loader_counters)};
  dl_iterate_phdr(add_module, &build);
  std::sort(table->ranges.begin(), table->ranges.end(),
            [](const ModuleRange& a, const ModuleRange& b) { return a.start < b.start; });
  if (g_module_names == nullptr) g_module_names = new std::unordered_map<uint64_t, ModuleIdentity>;
  for (auto& [key, name] : build.names) g_module_names->try_emplace(key, std::move(name));
  return table;
}

// Publishes a table covering `reading` unless another thread already has.
void refresh_table(const LoaderCounters& reading) {
  std::lock_guard<std::mutex> lock(g_build_mutex);
  const ModuleTable* current = g_table.load(std::memory_order_acquire);
  if (current != nullptr && current->counters.covers(reading)) return;
  const ModuleTable* old = g_table.exchange(build_table(), std::memory_order_seq_cst);
  if (g_retired == nullptr) g_retired = new FreeLater<const ModuleTable*>;
  if (old != nullptr) g_retired->add(old);
  g_retired->free_ready([](const ModuleTable* table) { return !held_by_any_reader(table); },
                        [](const ModuleTable* table) { delete table; });
}

// A table that describes the modules mapped now; valid until this thread's next call here.
const ModuleTable& current_table(HazardSlot& slot) {
  const LoaderCounters now = read_loader_counters();
  const ModuleTable* held = slot.held.load(std::memory_order_relaxed);
  if (held != nullptr && held->counters.covers(now)) return *held;
  for (;;) {
    const ModuleTable* table = protect_current(slot);
    if (table != nullptr && table->counters.covers(now)) return *table;
    refresh_table(now);
  }
}

// ---- per-thread state -------------------------------------------------------------------------

struct FingerprintCache {
  struct Entry {
    uint64_t generation = 0;  // of the table its frames were resolved in; 0: empty
    XXH128_hash_t raw{};      // of the raw frames it was computed from
    uint64_t fingerprint = 0;
    int count = 0;
  };
  int frame_capacity = 0;  // frames kept per entry
  std::vector<Entry> entries;
  std::vector<trace::Frame> frames;  // frame_capacity per entry

  void reserve_depth(int depth) {
    if (depth <= frame_capacity) return;
    frame_capacity = depth;
    entries.assign(kCacheEntries, Entry{});
    frames.assign(kCacheEntries * static_cast<size_t>(depth), trace::Frame{});
  }
};

struct ThreadState {
  HazardSlot* slot;
  FingerprintCache cache;
};

// Trivially constructed, so reading it needs no guard; the state itself is made on first use.
thread_local ThreadState* t_state = nullptr;

void release_thread_state(void* data) {
  auto* state = static_cast<ThreadState*>(data);
  state->slot->held.store(nullptr, std::memory_order_release);
  state->slot->in_use.store(false, std::memory_order_release);
  t_state = nullptr;
  delete state;
}

ThreadState& thread_state() {
  if (__builtin_expect(t_state != nullptr, 1)) return *t_state;
  static pthread_key_t exit_key;
  static const bool have_exit_key = pthread_key_create(&exit_key, release_thread_state) == 0;
  auto* state = new ThreadState{acquire_slot(), {}};
  if (have_exit_key) pthread_setspecific(exit_key, state);
  t_state = state;
  return *state;
}

// The most leading frames of our own seen so far: the first capture asks for depth beyond them.
std::atomic<int> g_own_frames{4};

void remember_own_frames(int frames) {
  int seen = g_own_frames.load(std::memory_order_relaxed);
  while (seen < frames &&
         !g_own_frames.compare_exchange_weak(seen, frames, std::memory_order_relaxed)) {}
}

// Unmapped addresses (JIT code, say) become (0, 0), which is still equal on every rank.
bool normalize_with(const ModuleTable& table, uintptr_t address, trace::Frame& out) {
  const ModuleRange* range = table.find(address);
  out = range ? trace::Frame{range->key, address - range->base} : trace::Frame{0, 0};
  return range != nullptr;
}

// Frames are return addresses; one byte back is inside the call instruction, which is in the
// calling function even when that call is its last instruction (a noreturn call, say).
uintptr_t call_site(void* return_address) {
  return reinterpret_cast<uintptr_t>(return_address) - 1;
}

// The frames to skip: ours, and any the unwinder reports of itself before them (libunwind
// reports none, glibc's backtrace does).
int leading_own_frames(const ModuleTable& table, void* const* raw, int captured) {
  constexpr int kUnwinderFrames = 4;
  int first = 0;
  while (first < captured && first < kUnwinderFrames && !table.is_own(call_site(raw[first])))
    ++first;
  if (first == captured || first == kUnwinderFrames) return 0;
  int skip = first;
  while (skip < captured && table.is_own(call_site(raw[skip]))) ++skip;
  return skip;
}

}  // namespace

bool normalize_address(uintptr_t address, trace::Frame& out) {
  return normalize_with(current_table(*thread_state().slot), address, out);
}

std::string module_name(uint64_t module_key) {
  std::lock_guard<std::mutex> lock(g_build_mutex);
  if (g_module_names == nullptr) return "";
  const auto it = g_module_names->find(module_key);
  return it == g_module_names->end() ? "" : it->second.name;
}

ModuleIdentity module_identity(uint64_t module_key) {
  std::lock_guard<std::mutex> lock(g_build_mutex);
  if (g_module_names == nullptr) return {};
  const auto it = g_module_names->find(module_key);
  return it == g_module_names->end() ? ModuleIdentity{} : it->second;
}

uint64_t callsite_fingerprint(int depth, std::span<trace::Frame> frames_out, int* frame_count) {
  depth = std::clamp(depth, 1, kMaxDepth);
  ThreadState& state = thread_state();
  const ModuleTable& table = current_table(*state.slot);

  void* raw[kMaxCapture];
  int wanted = std::min(depth + g_own_frames.load(std::memory_order_relaxed), kMaxCapture);
  int captured = 0;
  int skip = 0;
  for (;;) {
    captured = unw_backtrace(raw, wanted);
    skip = leading_own_frames(table, raw, captured);
    // A full buffer may have cut frames the fingerprint needs: capture again, deeper.
    if (captured < wanted || captured - skip >= depth || wanted == kMaxCapture) break;
    remember_own_frames(skip);
    wanted = std::min(skip + depth, kMaxCapture);
  }
  const int count = std::min(depth, captured - skip);

  FingerprintCache& cache = state.cache;
  cache.reserve_depth(depth);
  const XXH128_hash_t raw_hash =
      XXH3_128bits(raw + skip, sizeof(void*) * static_cast<size_t>(count));
  const size_t index = raw_hash.low64 & (kCacheEntries - 1);
  FingerprintCache::Entry& entry = cache.entries[index];
  trace::Frame* frames = &cache.frames[index * static_cast<size_t>(cache.frame_capacity)];
  if (entry.generation != table.generation || !XXH128_isEqual(entry.raw, raw_hash)) {
    for (int i = 0; i < count; ++i) normalize_with(table, call_site(raw[skip + i]), frames[i]);
    entry.fingerprint = XXH3_64bits(frames, sizeof(trace::Frame) * static_cast<size_t>(count));
    entry.count = count;
    entry.raw = raw_hash;
    entry.generation = table.generation;
  }

  int written = entry.count;
  if (!frames_out.empty()) {
    written = std::min(entry.count, static_cast<int>(frames_out.size()));
    std::copy_n(frames, written, frames_out.begin());
  }
  if (frame_count != nullptr) *frame_count = written;
  return entry.fingerprint;
}

}  // namespace magi::capture
