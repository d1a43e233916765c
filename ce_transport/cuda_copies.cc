#include <cuda_runtime_api.h>

#include "base/base.h"
#include "base/cuda_driver.h"
#include "ce_transport/cuda_memory.h"

namespace magi::ce {

// One cudaMemcpyBatchAsync: the driver spreads the copies over the copy engines. The legacy
// default stream does not take batches; there each copy goes on its own.
void copy_batch_on(std::span<const Copy> copies, cudaStream_t stream, int device,
                   CopyBatch& batch) {
  if (copies.empty()) return;
  if (stream == nullptr || stream == cudaStreamLegacy) {
    for (const Copy& c : copies)
      cuda_check(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream),
                 "cudaMemcpyAsync");
    return;
  }
  batch.dsts.clear();
  batch.srcs.clear();
  batch.sizes.clear();
  for (const Copy& c : copies) {
    batch.dsts.push_back(c.dst);
    batch.srcs.push_back(c.src);
    batch.sizes.push_back(c.bytes);
  }
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  attributes.srcLocHint.type = cudaMemLocationTypeDevice;
  attributes.srcLocHint.id = device < 0 ? 0 : device;
  attributes.dstLocHint = attributes.srcLocHint;
  size_t first = 0;
  const cudaError_t batched =
      cudaMemcpyBatchAsync(batch.dsts.data(), batch.srcs.data(), batch.sizes.data(), copies.size(),
                           &attributes, &first, 1, stream);
  if (batched == cudaSuccess) return;
  // The peers are already waiting on this bucket's flags: a refused batch (not a broken
  // context) is retried copy by copy rather than leaving them without their bytes.
  cudaGetLastError();
  MAGI_WARN(Transport, "cudaMemcpyBatchAsync refused a bucket (%s); copying one by one",
            cudaGetErrorName(batched));
  for (const Copy& c : copies)
    cuda_check(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream),
               "cudaMemcpyAsync");
}

void copy_each(std::span<const Copy> copies, cudaStream_t stream, const char* what) {
  for (const Copy& c : copies)
    cuda_check(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream), what);
}

// The full lines in one strided copy (one copy-engine operation), a short last line in a second.
// The source pitch, S, is about B / 256 (B >= 64 KiB): under the devices' maximum pitch
// (cudaDevAttrMaxPitch, 2^31 - 1 on current GPUs) for any shard that fits in one.
void copy_lines_on(uint8_t* into, const uint8_t* from, const SampleSet& set, cudaStream_t stream) {
  if (set.rows != 0)
    cuda_check(cudaMemcpy2DAsync(into, SampleSet::kLine, from + set.first, set.stride,
                                 SampleSet::kLine, set.rows, cudaMemcpyDefault, stream),
               "cudaMemcpy2DAsync (verify)");
  if (set.tail_bytes != 0)
    cuda_check(cudaMemcpyAsync(into + set.rows * SampleSet::kLine, from + set.offset(set.rows),
                               set.tail_bytes, cudaMemcpyDefault, stream),
               "cudaMemcpyAsync (verify)");
}

}  // namespace magi::ce
