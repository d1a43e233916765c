// Windows that CUDA graphs read (cuda_memory.h): the count each graph's user object holds, the
// windows released while graphs still lived, freed once those are destroyed, and their latches
// opened at an abort of their communicator (abandon_graphs, ce_transport.h).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "base/base.h"
#include "base/cuda_driver.h"
#include "ce_transport/cuda_memory.h"
#include "ce_transport/cuda_thread.h"
#include "ce_transport/window_end.h"

namespace magi::ce {
namespace {

// Never destroyed: a CUDA thread may still count down while the process exits.
std::mutex& kept_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::vector<KeptForGraphs>& kept_for_graphs() {
  static auto* kept = new std::vector<KeptForGraphs>;
  return *kept;
}

}  // namespace

void CUDART_CB drop_graph_hold(void* held) {
  auto* holds = static_cast<std::shared_ptr<GraphHolds>*>(held);
  (*holds)->live.fetch_sub(1, std::memory_order_acq_rel);
  delete holds;
}

void keep_for_graphs(KeptForGraphs kept) {
  std::lock_guard<std::mutex> lock(kept_mutex());
  kept_for_graphs().push_back(std::move(kept));
}

void free_window(int device, void* base, void* flags_host, void* host_check,
                 cudaEvent_t lines_copied, const std::vector<uint8_t*>& peers,
                 const std::vector<uint8_t*>& imports) {
  if (device >= 0) cudaSetDevice(device);
  for (uint8_t* p : peers)
    if (p != nullptr) cudaIpcCloseMemHandle(p);
  for (uint8_t* p : imports) close_imported(p);
  cudaFree(base);
  cudaFreeHost(flags_host);
  if (host_check != nullptr) cudaFreeHost(host_check);
  if (lines_copied != nullptr) cudaEventDestroy(lines_copied);
  cudaGetLastError();
}

void free_kept_for_graphs() {
  std::vector<KeptForGraphs> free;
  {
    std::lock_guard<std::mutex> lock(kept_mutex());
    auto& kept = kept_for_graphs();
    for (auto it = kept.begin(); it != kept.end();) {
      if (it->holds->live.load(std::memory_order_acquire) > 0) {
        ++it;
        continue;
      }
      free.push_back(std::move(*it));
      it = kept.erase(it);
    }
  }
  if (free.empty()) return;
  int device = -1;  // the thread's, given back after (another device's window may be freed)
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  for (const KeptForGraphs& k : free) {
    free_window(k.device, k.base, k.flags_host, k.host_check, k.lines_copied, k.peers, k.imports);
    if (k.bucket_end != nullptr) cudaEventDestroy(k.bucket_end);
    MAGI_INFO(Transport,
              "a window of %zu peer mappings kept for CUDA graphs was freed: those graphs are "
              "all destroyed",
              k.peers.size() + k.imports.size());
  }
  if (device >= 0) cudaSetDevice(device);
  cudaGetLastError();
}

void abandon_graphs(uint64_t comm_identity) noexcept {
  std::lock_guard<std::mutex> lock(kept_mutex());  // no window listed is freed meanwhile
  std::vector<CUstreamBatchMemOpParams> ops;
  int device = -1;
  size_t windows = 0;
  std::vector<FlagOp> opens;
  for (const KeptForGraphs& k : kept_for_graphs()) {
    if (k.identity != comm_identity || k.flags == nullptr) continue;
    device = k.device;
    ++windows;
    add_wait_releases(opens, k.layout, k.rank, k.flags, false);
  }
  for (const FlagOp& op : opens) ops.push_back(stream_flag_op(op));
  if (ops.empty()) return;
  const RelaxedCaptureMode own_calls;
  int saved = -1;
  if (cudaGetDevice(&saved) != cudaSuccess) saved = -1;
  cudaStream_t stream = nullptr;
  const CudaDriver* driver = cuda_driver();
  const bool opened = device >= 0 && cudaSetDevice(device) == cudaSuccess &&
                      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
                      driver != nullptr && driver->cuStreamBatchMemOp_fn != nullptr &&
                      driver->cuStreamBatchMemOp_fn(reinterpret_cast<CUstream>(stream),
                                                    static_cast<unsigned>(ops.size()), ops.data(),
                                                    0) == CUDA_SUCCESS &&
                      cudaStreamSynchronize(stream) == cudaSuccess;
  if (stream != nullptr) cudaStreamDestroy(stream);
  if (saved >= 0) cudaSetDevice(saved);
  cudaGetLastError();
  if (opened)
    MAGI_INFO(Transport,
              "comm %012llx: aborted: the graph latches of %zu window(s) kept for CUDA graphs "
              "are open, so no replay of those graphs waits on a peer",
              short_id(comm_identity), windows);
  else
    MAGI_WARN(Transport,
              "comm %012llx: aborted, but the graph latches of %zu window(s) kept for CUDA "
              "graphs could not be opened; a replay of those graphs may wait on its peers",
              short_id(comm_identity), windows);
}

}  // namespace magi::ce
