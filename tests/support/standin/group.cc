#include "tests/support/standin/group.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "tests/support/standin/device_memory.h"
#include "tests/support/standin/report.h"
#include "tests/support/standin/settings.h"

namespace standin {
namespace {

struct GroupState {
  int depth = 0;
  std::vector<std::unique_ptr<Operation>> queued;
};
thread_local GroupState t_group;

}  // namespace

// Drives `ops` until all are done. Cannot hang on its own: every operation can advance whenever
// its peers have, and the sleep is cut short by any doorbell of the segment slept on (and by a
// short limit when operations wait on several segments). What stays is a real hang, as in NCCL:
// STANDIN_TIMEOUT_S bounds it, and a peer process that has exited ends it (ncclRemoteError).
ncclResult_t run_operations(std::vector<std::unique_ptr<Operation>>& ops) {
  using Clock = std::chrono::steady_clock;
  // How often a wait asks whether the rank it waits for still lives: one kill(pid, 0) per tenth
  // of a second of waiting costs nothing, and a dead peer ends the wait that soon.
  constexpr auto kLivenessInterval = std::chrono::milliseconds(100);
  if (Settings::get().delay_us > 0)
    std::this_thread::sleep_for(std::chrono::microseconds(Settings::get().delay_us));
  if (Settings::get().group_order_by_size && ops.size() > 1) {
    // The collectives trade places among themselves, largest first (stable among equals);
    // everything else keeps its place.
    std::vector<size_t> slots;
    std::vector<std::unique_ptr<Operation>> collectives;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i]->traffic_bytes() == 0) continue;
      slots.push_back(i);
      collectives.push_back(std::move(ops[i]));
    }
    std::stable_sort(collectives.begin(), collectives.end(), [](const auto& a, const auto& b) {
      return a->traffic_bytes() > b->traffic_bytes();
    });
    for (size_t k = 0; k < slots.size(); ++k) ops[slots[k]] = std::move(collectives[k]);
  }
  for (auto& op : ops) op->launch();
  const double timeout_s = Settings::get().timeout_s;
  auto last_move = Clock::now();
  auto last_liveness_check = last_move;
  for (;;) {
    Operation* first_pending = nullptr;
    for (auto& op : ops) {
      if (!op->done()) {
        first_pending = op.get();
        break;
      }
    }
    if (first_pending == nullptr) break;
    Segment* bell = first_pending->awaited();
    const uint32_t seen = bell->doorbell();  // before the sweep, so no ring is missed
    bool moved = false;
    bool several_segments = false;
    for (auto& op : ops) {
      if (op->done()) continue;
      moved |= op->progress();
      if (!op->done() && op->awaited() != bell) several_segments = true;
    }
    const auto now = Clock::now();
    if (moved) {
      last_move = now;
      continue;
    }
    const double waited_s = std::chrono::duration<double>(now - last_move).count();
    for (auto& op : ops) {
      if (op->done() || !op->awaited()->aborted_here()) continue;
      const std::string message =
          format("rank %d: %s: the communicator was aborted", op->rank(), op->describe().c_str());
      op->give_up(ncclSystemError, message);
    }
    if (now - last_liveness_check >= kLivenessInterval) {
      last_liveness_check = now;
      for (auto& op : ops) {
        const int peer = op->done() ? -1 : op->awaited_rank();
        if (peer < 0 || op->awaited()->rank_alive(peer)) continue;
        const std::string message =
            format("rank %d: rank %d exited while %s waits for it; giving up", op->rank(), peer,
                   op->describe().c_str());
        report("%s", message.c_str());
        op->give_up(ncclRemoteError, message);
      }
    }
    if (timeout_s > 0 && waited_s > timeout_s) {
      for (auto& op : ops) {
        if (op->done()) continue;
        const std::string message =
            format("rank %d: blocked %.1f s in %s %s; giving up (STANDIN_TIMEOUT_S)", op->rank(),
                   waited_s, op->describe().c_str(), op->why_waiting().c_str());
        report("%s", message.c_str());
        op->give_up(ncclSystemError, message);
      }
      continue;
    }
    bell->sleep_unless_rung(seen, several_segments ? std::chrono::microseconds(500)
                                                   : std::chrono::microseconds(100000));
  }
  ncclResult_t result = ncclSuccess;
  for (auto& op : ops) {
    if (op->result() != ncclSuccess && result == ncclSuccess) {
      result = op->result();
      set_last_error(op->error());
    }
  }
  return result;
}

namespace {

// A group's operations: those on a stream capturing a CUDA graph are recorded into it (they run
// at its replays), the others run now.
ncclResult_t run(std::vector<std::unique_ptr<Operation>>& ops) {
  std::vector<std::unique_ptr<Operation>> captured;
  for (auto& op : ops) {
    if (is_captured(*op)) captured.push_back(std::move(op));
  }
  if (captured.empty()) return run_operations(ops);
  std::erase(ops, nullptr);
  // A capture that failed fails the call, after the rest of the group ran: the peers expect it.
  ncclResult_t recorded = ncclSuccess;
  std::string why;
  try {
    record_captured(std::move(captured));
  } catch (const Failure& f) {
    recorded = f.code();
    why = f.what();
  }
  const ncclResult_t result = ops.empty() ? ncclSuccess : run_operations(ops);
  if (recorded == ncclSuccess) return result;
  throw Failure(recorded, why);
}

}  // namespace

void group_start() { ++t_group.depth; }
bool group_open() { return t_group.depth > 0; }

ncclResult_t group_end() {
  if (t_group.depth == 0) throw Failure(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--t_group.depth > 0) return ncclSuccess;
  std::vector<std::unique_ptr<Operation>> ops = std::move(t_group.queued);
  t_group.queued.clear();
  return run(ops);
}

ncclResult_t group_simulate_end() {
  if (t_group.depth == 0) {
    throw Failure(ncclInvalidUsage, "ncclGroupSimulateEnd without ncclGroupStart");
  }
  if (--t_group.depth == 0) t_group.queued.clear();
  return ncclSuccess;
}

ncclResult_t submit(std::unique_ptr<Operation> op) {
  if (t_group.depth > 0) {
    t_group.queued.push_back(std::move(op));
    return ncclSuccess;
  }
  std::vector<std::unique_ptr<Operation>> ops;
  ops.push_back(std::move(op));
  return run(ops);
}

}  // namespace standin
