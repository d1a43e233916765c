// The parts of device memory's operations (cuda_memory_ops.cc) that are concerns of their own.
// Private to the CUDA files of ce_transport/.
//  - cuda_copies.cc: a bucket's copies (one batch over the copy engines) and a check's lines;
//  - cuda_stream_ops.cc: flag words written and waited for by stream memory operations;
//  - cuda_imports.cc: the peers' exported allocations, mapped once per process;
//  - cuda_graphs.cc: windows held by the CUDA graphs that read them, freed once those are gone,
//    and their latches opened at an abort (abandon_graphs);
//  - cuda_thread.h: the calling thread's device and capture mode.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "ce_transport/ce_transport.h"
#include "ce_transport/memory_ops.h"
#include "ce_transport/protocol.h"
#include "ce_transport/sample_plan.h"

namespace magi::ce {

// ---- copies (cuda_copies.cc) ----
// What a batch is passed as, kept for its room.
struct CopyBatch {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
};
// A bucket's copies on `stream`, as one cudaMemcpyBatchAsync (`device`: where they run).
void copy_batch_on(std::span<const Copy> copies, cudaStream_t stream, int device, CopyBatch& batch);
// Each copy on its own (`what`: the call's name in an error).
void copy_each(std::span<const Copy> copies, cudaStream_t stream, const char* what);
// The lines of `set` from `from` into `into`, packed, on `stream`.
void copy_lines_on(uint8_t* into, const uint8_t* from, const SampleSet& set, cudaStream_t stream);

// ---- flag words (cuda_stream_ops.cc) ----
// The stream memory operation that runs `op` (memory_ops.h's FlagOp).
CUstreamBatchMemOpParams stream_flag_op(const FlagOp& op);

// ---- the peers' exported allocations (cuda_imports.cc) ----
// Maps `record`'s allocation on `device`, or counts one more reader of its mapping.
uint8_t* open_imported(const ExportRecord& record, int device);
// One reader fewer of the mapping at `base`; unmapped when it was the last.
void close_imported(uint8_t* base);

// ---- windows read by captured CUDA graphs (cuda_graphs.cc) ----
// A graph captured with moved gathers (Timing::Captured) holds one user object per capture; its
// destructor runs on a CUDA thread once the graph and every instance of it are destroyed (and
// their launches have run), and may make no CUDA call: it only counts down. A window released
// while the count is above zero keeps its memory and mappings in KeptForGraphs, freed by a later
// release or allocate (any communicator's) once the count is zero, or by the process's end.
struct GraphHolds {
  std::atomic<int64_t> live{0};
};
// The user object's destructor: `held` is a new std::shared_ptr<GraphHolds>, deleted here.
void CUDART_CB drop_graph_hold(void* held);

struct KeptForGraphs {
  std::shared_ptr<GraphHolds> holds;
  int device = -1;
  void* base = nullptr;
  void* flags_host = nullptr;
  void* host_check = nullptr;
  cudaEvent_t lines_copied = nullptr;
  std::vector<uint8_t*> peers;
  std::vector<uint8_t*> imports;
  // Whose window it is, and where its flag words lie: an abort of that communicator opens its
  // graph slots' latches (abandon_graphs).
  uint64_t identity = 0;
  int rank = -1;
  uint8_t* flags = nullptr;
  protocol::FlagLayout layout{};
  cudaEvent_t bucket_end = nullptr;  // named by the graphs' event nodes (bucket order)
};
// The windows kept, under their lock.
void keep_for_graphs(KeptForGraphs kept);
// What earlier releases kept for graphs now destroyed.
void free_kept_for_graphs();

// A window's memory, the peers' mappings and imports freed; `device` >= 0: made current first (a
// window kept for graphs, freed from any thread).
void free_window(int device, void* base, void* flags_host, void* host_check,
                 cudaEvent_t lines_copied, const std::vector<uint8_t*>& peers,
                 const std::vector<uint8_t*>& imports);

}  // namespace magi::ce
