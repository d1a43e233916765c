#include "rewrite/world.h"

#include "capture/capture.h"
#include "rewrite/agreement.h"

namespace magi::rewrite {

AgreementWorld production_world(const RealNcclCalls& nccl) {
  const Options& options = Options::get();
  const ce::Backend backend = options.backend;
  TransportFactory make;
  make.transport = [backend](const capture::CommInfo& info) {
    return ce::make_transport(backend, info.rank, info.nranks, info.identity, info.cuda_device);
  };
  make.exchange = [backend](const capture::CommInfo& info, size_t bytes) {
    // A process without the CUDA driver still makes the hello (rewrite/hello.h); its NCCL, then,
    // takes host memory.
    const ce::Backend where = ce::backend_available(backend) ? backend : ce::Backend::Host;
    return ce::make_exchange(where, bytes, info.nranks, info.cuda_device);
  };
  make.timer = [backend] { return ce::make_timer(backend); };
  // Measured on an H200: cudaIpcOpenMemHandle of a 4 MiB allocation, 0.056 ms in one process,
  // 0.12 ms with four processes opening at once (BENCHMARKS.md); mapping a /dev/shm file, µs.
  // So the default mode's windows (one per peer) stay at the call up to 8 ranks.
  make.mapping_ns = backend == ce::Backend::Cuda ? 120'000 : 10'000;
  // The owner's side: 256 cudaMalloc allocations exported (a handle and a range query each) and
  // a window made took 45-65 ms at the publish call on an H200 with 4 ranks, ~0.2 ms each; the
  // host finds all of a plan's in one read of /proc/self/maps, then a few µs each.
  make.export_ns = backend == ce::Backend::Cuda ? 100'000 : 2'000;
  make.board = [](const capture::CommInfo& info) {
    return ce::open_round_board(info.identity, info.rank, info.nranks);
  };
  make.locality = [backend](const capture::CommInfo& info) {
    return ce::local_locality(backend, info.cuda_device);
  };
  return AgreementWorld{
      options,
      nccl,
      std::move(make),
      [] {
        return GroupView{capture::group_depth(), capture::group_holds_point_to_point(),
                         capture::group_calls()};
      },
      [](trace::RecordType type, const void* payload, uint32_t bytes) {
        capture::trace_record(type, payload, bytes);
      },
  };
}

std::shared_ptr<CommAgreement> make_comm_agreement(ncclComm_t comm, const capture::CommInfo& info,
                                                   const RealNcclCalls& nccl) {
  return std::make_shared<CommAgreement>(comm, info, production_world(nccl));
}

}  // namespace magi::rewrite
