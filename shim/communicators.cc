#include "shim/communicators.h"

#include <atomic>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "base/base.h"

namespace magi::shim {

void arm_lifecycle();  // shim/lifecycle.cc

namespace {

using Registry = std::unordered_map<ncclComm_t, CommRef>;

// Created on first use and never destroyed: NCCL calls may arrive during static destruction.
std::mutex* g_mutex = new std::mutex();
Registry* g_registry = new Registry();

// Bumped at every join and leave: a thread's cached lookup of another generation is stale.
std::atomic<uint64_t> g_generation{1};

struct CacheEntry {
  ncclComm_t handle = nullptr;
  std::weak_ptr<CommRecord> record;
  uint64_t generation = 0;
};
constexpr unsigned kCacheEntries = 4;
thread_local CacheEntry t_cache[kCacheEntries];
thread_local unsigned t_next_victim = 0;

}  // namespace

CommRef find_comm(ncclComm_t comm) {
  const uint64_t generation = g_generation.load(std::memory_order_acquire);
  for (CacheEntry& entry : t_cache)
    if (entry.handle == comm && entry.generation == generation) return entry.record.lock();
  CommRef found;
  {
    std::lock_guard<std::mutex> lock(*g_mutex);
    if (auto it = g_registry->find(comm); it != g_registry->end()) found = it->second;
  }
  if (found) t_cache[t_next_victim++ % kCacheEntries] = {comm, found, generation};
  return found;
}

CommRef comm_of(ncclComm_t comm) {
  if (CommRef record = find_comm(comm)) return record;
  return add_comm(comm, capture::unseen_comm_info(comm), nullptr);
}

CommRef add_comm(ncclComm_t comm, const capture::CommInfo& info,
                 std::shared_ptr<rewrite::CommAgreement> agreement) {
  arm_lifecycle();
  auto record = std::make_shared<CommRecord>(
      info, static_cast<uint32_t>(Options::get().max_step_calls), std::move(agreement));
  if (record->agreement == nullptr || !rewrite::watching(*record->agreement))
    capture::stop_gather_callsites(record->capture);
  capture::comm_joined(comm, record->capture);
  CommRef replaced;
  {
    std::lock_guard<std::mutex> lock(*g_mutex);
    CommRef& slot = (*g_registry)[comm];
    replaced = std::move(slot);
    slot = record;
    g_generation.fetch_add(1, std::memory_order_acq_rel);
  }
  return record;  // `replaced` goes here, outside the lock: releasing windows may take time
}

CommRef remove_comm(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(*g_mutex);
  auto it = g_registry->find(comm);
  if (it == g_registry->end()) return nullptr;
  CommRef record = std::move(it->second);
  g_registry->erase(it);
  g_generation.fetch_add(1, std::memory_order_acq_rel);
  return record;
}

namespace registry {

std::vector<CommRef> take_all() {
  std::vector<CommRef> all;
  std::lock_guard<std::mutex> lock(*g_mutex);
  all.reserve(g_registry->size());
  for (auto& [handle, record] : *g_registry) all.push_back(std::move(record));
  g_registry->clear();
  g_generation.fetch_add(1, std::memory_order_acq_rel);
  return all;
}

void forget_in_child() {
  // Another parent thread may have held the lock at the fork; the records are the parent's
  // (NCCL does not survive fork, nor do CUDA mappings): set aside, reachable, never released.
  static auto* parents = new std::vector<Registry*>();
  new (g_mutex) std::mutex();
  parents->push_back(g_registry);
  g_registry = new Registry();
  g_generation.fetch_add(1, std::memory_order_acq_rel);
}

}  // namespace registry
}  // namespace magi::shim
