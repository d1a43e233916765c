// The CUDA backend of the transport (device windows, CUDA IPC, copy-engine reads). Not in this
// build yet: it refuses at prepare, which rewrite/ treats as "this communicator stays on NCCL".
#include "ce_transport/backends.h"
#include "shim/shim.h"

namespace magi::ce {
namespace {

class CudaTransport final : public Transport {
 public:
  void prepare(size_t, HandleBlob&) override { refuse(); }
  void attach(std::span<const HandleBlob>) override { refuse(); }
  void gather(std::span<const GatherOp>, void*) override { refuse(); }
  void release() override {}
  size_t window_bytes() const override { return 0; }

 private:
  [[noreturn]] static void refuse() {
    throw Error(ErrorKind::System, "the CUDA copy-engine transport is not in this build yet");
  }
};

}  // namespace

std::unique_ptr<Transport> make_cuda_transport(int rank, int nranks, uint64_t /*comm_identity*/) {
  if (nranks < 1 || rank < 0 || rank >= nranks)
    throw Error(ErrorKind::Usage, "rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  return std::make_unique<CudaTransport>();
}

std::unique_ptr<Transport> make_transport(Backend backend, int rank, int nranks, uint64_t comm_identity) {
  if (backend == Backend::Host) return make_host_transport(rank, nranks, comm_identity);
  return make_cuda_transport(rank, nranks, comm_identity);
}

}  // namespace magi::ce
