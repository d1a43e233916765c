// Where a backend is picked: every factory and fact of ce_transport.h that differs by backend
// asks here, and nowhere else. The host backend is always there; the CUDA one only once the
// program loaded the driver (we never start CUDA ourselves).
#include "ce_transport/backends.h"
#include "ce_transport/cuda_thread.h"

#include "base/base.h"
#include "base/cuda_driver.h"
#include "ce_transport/exports.h"
#include "ce_transport/memory_ops.h"

namespace magi::ce {

std::unique_ptr<Transport> make_host_transport(int rank, int nranks, uint64_t comm_identity,
                                               const Options::Fault& fault) {
  check_rank(rank, nranks);
  return make_window_transport(make_host_memory(nranks), rank, nranks, comm_identity, fault);
}

std::unique_ptr<Transport> make_cuda_transport(int rank, int nranks, uint64_t comm_identity,
                                               int device, const Options::Fault& fault) {
  check_rank(rank, nranks);
  return make_window_transport(make_cuda_memory(rank, nranks, comm_identity, device), rank, nranks,
                               comm_identity, fault);
}

std::unique_ptr<Transport> make_transport(Backend backend, int rank, int nranks,
                                          uint64_t comm_identity, int device) {
  if (backend == Backend::Host) return make_host_transport(rank, nranks, comm_identity);
  return make_cuda_transport(rank, nranks, comm_identity, device);
}

std::unique_ptr<Exchange> make_exchange(Backend backend, size_t contribution_bytes, int nranks,
                                        int device) {
  if (backend == Backend::Host) return make_host_exchange(contribution_bytes, nranks);
  return make_cuda_exchange(contribution_bytes, nranks, device);
}

std::unique_ptr<CompletionTimer> make_timer(Backend backend) {
  if (backend == Backend::Host) return make_wall_timer();
  return make_event_timer();
}

OutsideCapture::OutsideCapture(Backend backend)
    : saved_(backend == Backend::Cuda ? relax_capture_mode() : -1) {}
OutsideCapture::~OutsideCapture() { restore_capture_mode(saved_); }

bool backend_available(Backend backend) { return backend == Backend::Host || cuda_driver_loaded(); }

BufferIdentity identify_buffer(Backend backend, const void* ptr) {
  if (backend == Backend::Host) return {MemoryKind::Host, 0, -1};
  return identify_cuda_buffer(ptr);
}

bool exportable(Backend backend, const void* ptr, size_t bytes) {
  try {
    return backend == Backend::Host ? exports::find_host_export(ptr, bytes).ok
                                    : exports::find_cuda_export(ptr, bytes).ok;
  } catch (const Error&) {  // no driver: nothing is exportable
    return false;
  }
}

Locality local_locality(Backend backend, int cuda_device) {
  static const uint64_t host = host_fingerprint();
  Locality here;
  here.host = host;
  if (backend == Backend::Cuda && cuda_device >= 0 && cuda_driver_loaded()) {
    here.device = cuda_device;
    here.peer_access_mask = peer_access_mask(cuda_device);
  }
  return here;
}

}  // namespace magi::ce
