#include "capture/communicator.h"

#include <memory>
#include <new>
#include <mutex>
#include <unordered_map>

#include "base/base.h"

namespace magi::capture {
namespace {

std::unordered_map<ncclComm_t, std::unique_ptr<Communicator>>& registry() { return registry_detail::map(); }

// Each join or leave bumps the generation, which invalidates every thread's cache at once.
std::atomic<uint64_t> g_generation{1};

// A few recent communicators per thread: the call path finds its state without a lock.
struct CacheEntry {
  ncclComm_t handle = nullptr;
  Communicator* state = nullptr;
  uint64_t generation = 0;
};
thread_local CacheEntry t_cache[4];
thread_local unsigned t_next_victim = 0;

}  // namespace

namespace registry_detail {
std::mutex& mutex() {
  static auto* m = new std::mutex();
  return *m;  // never destroyed: NCCL calls may arrive during static destruction
}
using Registry = std::unordered_map<ncclComm_t, std::unique_ptr<Communicator>>;
Registry* g_registry = nullptr;  // created on first use, never destroyed
Registry* g_parents_registry = nullptr;  // in a forked child: kept reachable, never used

std::unordered_map<ncclComm_t, std::unique_ptr<Communicator>>& map() {
  static Registry* first = g_registry = new Registry();
  (void)first;
  return *g_registry;
}
}  // namespace registry_detail

Communicator* find_communicator(ncclComm_t comm) {
  const uint64_t generation = g_generation.load(std::memory_order_acquire);
  for (CacheEntry& e : t_cache)
    if (e.handle == comm && e.generation == generation) return e.state;
  Communicator* state = nullptr;
  {
    std::lock_guard<std::mutex> lk(registry_detail::mutex());
    auto it = registry().find(comm);
    if (it != registry().end()) state = it->second.get();
  }
  if (state != nullptr) t_cache[t_next_victim++ % 4] = {comm, state, generation};
  return state;
}

Communicator& register_communicator(ncclComm_t comm, const CommInfo& info) {
  std::lock_guard<std::mutex> lk(registry_detail::mutex());
  auto state = std::make_unique<Communicator>(
      comm, info, static_cast<uint32_t>(Options::get().max_step_calls));
  Communicator& ref = *state;
  registry()[comm] = std::move(state);  // a handle NCCL reuses replaces the old entry
  g_generation.fetch_add(1, std::memory_order_acq_rel);
  return ref;
}

void unregister_communicator(ncclComm_t comm) {
  std::lock_guard<std::mutex> lk(registry_detail::mutex());
  // Bump before freeing, so no thread's cache can hand out the freed state.
  g_generation.fetch_add(1, std::memory_order_acq_rel);
  registry().erase(comm);
}

void forget_communicators_in_child() {
  new (&registry_detail::mutex()) std::mutex();  // a parent thread may have held it at fork
  registry_detail::map();                           // make sure there is one to set aside
  registry_detail::g_parents_registry = registry_detail::g_registry;
  registry_detail::g_registry = new registry_detail::Registry();
  g_generation.fetch_add(1, std::memory_order_acq_rel);
}

Communicator& communicator_of(ncclComm_t comm) {
  if (Communicator* state = find_communicator(comm)) return *state;
  CommInfo info{};
  info.identity = reinterpret_cast<uintptr_t>(comm) ^ 0x9e3779b97f4a7c15ull;  // rank-local
  info.rank = -1;
  info.nranks = -1;
  info.cuda_device = -1;
  info.origin = CommOrigin::Unknown;
  MAGI_INFO(Capture, "communicator %p was created out of sight; it is recorded, never agreed on",
            static_cast<void*>(comm));
  return register_communicator(comm, info);
}

}  // namespace magi::capture
