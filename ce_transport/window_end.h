// How a window ends (ce_transport.h's release() and abandon()), over any memory whose work runs
// on a stream (MemoryOps::synchronous() false). Private to ce_transport/.
//
// Measured on an H200 (2026-11): cudaFree, cudaIpcCloseMemHandle and even cudaMalloc block while
// any stream of the device waits on a word that nobody will write, and a peer's mapping stays
// readable after the peer dies. So a window is freed only once it has settled: every bucket of
// this rank has run on it (its own word) and every peer has said it finished reading it (their
// done words in it). Where that cannot be known, this rank's waits are released (its own words
// written, so its stream runs on) and the window is left allocated, said at WARN; the process's
// end returns it. An abort releases this rank's waits first, and the graph slots' latches for
// good (their high halves: a replay's own stores write only the low ones).
// Synchronous memory needs none of it: its buckets have run when gather() returns, a peer's
// mapping holds the memory it reads, and its waits run on threads that an abort interrupts.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ce_transport/memory_ops.h"
#include "ce_transport/protocol.h"

namespace magi::ce {

// How long release() waits for the peers to finish reading this window, and abandon() for a
// bucket still in flight to end by itself, before giving up on them.
inline constexpr auto kSettleLimit = std::chrono::seconds(10);
inline constexpr auto kAbortGrace = std::chrono::seconds(1);

// Whether a window could be freed, or why not.
enum class Settled : uint8_t {
  Finished,
  PeerDied,
  OwnStreamBehind,
  PeersBehind,
  Abandoned,
  Unreadable
};
// Why a window was left allocated; `ranks` names the peers concerned, where there are any.
std::string settled_name(Settled s, const std::string& ranks);

// Waits up to `limit` until buckets 1..target have run here and every peer has finished reading
// this window, reading this rank's flag words now (MemoryOps::read_flags_now) every 200 µs. A
// peer whose process ended before finishing died mid-run: this rank gives up on it at once
// (NCCL's kernels may be stuck on it too, and freeing would then hang). `pids`: the peers' by
// rank; `ranks` gets the peers that had not finished, for the warning.
Settled settle(MemoryOps& memory, const protocol::FlagLayout& layout, int rank,
               std::span<const pid_t> pids, uint64_t target,
               std::chrono::steady_clock::duration limit, std::string& ranks);

// The writes that let every wait of `rank` on its peers pass, queued or to come, in its own
// window's `flags`: each peer's ready and done words raised to kReleased (`counters`), and each
// peer's graph-slot latches opened for every replay to come.
void add_wait_releases(std::vector<FlagOp>& ops, const protocol::FlagLayout& layout, int rank,
                       uint8_t* flags, bool counters);

}  // namespace magi::ce
