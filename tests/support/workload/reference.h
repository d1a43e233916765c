// What NCCL defines, computed on the host independently of any NCCL: inputs as a deterministic
// function of (rank, case, index), and the element-wise reduction the ops scenario expects.
// Narrow floats go through CUDA's own host conversions (cuda_fp16/bf16/fp8 headers), so they
// check the stand-in's hand-written ones rather than repeat them.
//
// A reduction folds the ranks in rank order, rounding to the element type after every step;
// integer sum and product wrap; avg divides the sum by the rank count (integers truncate);
// fp8 saturates to its largest finite value.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <string>
#include <vector>

namespace workload {

using Bytes = std::vector<unsigned char>;

size_t element_bytes(ncclDataType_t dtype);
const char* dtype_text(ncclDataType_t dtype);
const char* redop_text(ncclRedOp_t op);

// `count` elements of rank `rank`'s input for case `case_id`, starting at pattern index `first`.
Bytes make_input(ncclDataType_t dtype, int rank, int case_id, size_t count, size_t first = 0);

// out[i] = fold(op, inputs[0][i], ..., inputs[n-1][i])
Bytes reference_reduce(ncclDataType_t dtype, ncclRedOp_t op, const std::vector<Bytes>& inputs,
                       size_t offset_elements, size_t count);

// "0x3c00 (1)": an element's bits and value, for messages.
std::string element_text(ncclDataType_t dtype, const unsigned char* element);

}  // namespace workload
