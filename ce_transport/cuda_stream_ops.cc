// Flag words by stream memory operations (cuStreamBatchMemOp): 64-bit writes and waits of the
// eager handshake's sequence numbers, 32-bit writes of a latch's halves, waits on a latch's
// mask. No kernel is launched, no SM is used.
#include <cuda.h>

#include "ce_transport/cuda_memory.h"

namespace magi::ce {
namespace {

CUstreamBatchMemOpParams write_op(const uint8_t* address, uint64_t value) {
  CUstreamBatchMemOpParams op{};
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  op.writeValue.address = reinterpret_cast<CUdeviceptr>(address);
  op.writeValue.value64 = value;
  // With the memory barrier that precedes it by default (a batch refuses the flag that drops it).
  op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return op;
}

CUstreamBatchMemOpParams wait_op(const uint8_t* address, uint64_t at_least) {
  CUstreamBatchMemOpParams op{};
  op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
  op.waitValue.address = reinterpret_cast<CUdeviceptr>(address);
  op.waitValue.value64 = at_least;
  op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
  return op;
}

// A latch's half (protocol.h): the low one by the handshake, the high one by an abort. The
// words are little-endian on every device CUDA runs on.
CUstreamBatchMemOpParams write_half_op(const uint8_t* latch, bool high, uint32_t value) {
  CUstreamBatchMemOpParams op{};
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
  op.writeValue.address = reinterpret_cast<CUdeviceptr>(latch + (high ? 4 : 0));
  op.writeValue.value = value;
  op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return op;
}

// Until the latch is set or aborted: (word & kLatchOpen) != 0.
CUstreamBatchMemOpParams wait_latch_op(const uint8_t* latch) {
  CUstreamBatchMemOpParams op{};
  op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
  op.waitValue.address = reinterpret_cast<CUdeviceptr>(latch);
  op.waitValue.value64 = protocol::kLatchOpen;
  op.waitValue.flags = CU_STREAM_WAIT_VALUE_AND;
  return op;
}

}  // namespace

CUstreamBatchMemOpParams stream_flag_op(const FlagOp& op) {
  switch (op.kind) {
    case FlagOp::Kind::Write: return write_op(op.word, op.value);
    case FlagOp::Kind::Wait: return wait_op(op.word, op.value);
    case FlagOp::Kind::Latch: return write_half_op(op.word, false, op.value != 0 ? 1 : 0);
    case FlagOp::Kind::WaitLatch: return wait_latch_op(op.word);
    case FlagOp::Kind::Open: return write_half_op(op.word, true, 1);
  }
  return wait_latch_op(op.word);
}

}  // namespace magi::ce
