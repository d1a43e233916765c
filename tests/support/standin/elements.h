// Element types and reductions, as nccl.h defines them.
//
// A reduction folds the ranks' inputs in rank order, rounding to the element type after every
// step (narrow floats compute in float): the same bits on every rank and in every run. Integer
// sum and product wrap; avg is the sum divided by the rank count (integers truncate).
#pragma once

#include <nccl.h>

#include <cstddef>

namespace standin {

bool valid_datatype(int dtype);
bool valid_redop(int redop);  // the built-in ones; user-made ops are not supported
size_t datatype_bytes(ncclDataType_t dtype);
const char* datatype_name(int dtype);
const char* redop_name(int redop);

// out[i] = fold(op, inputs[0][i], …, inputs[n-1][i]) for i < count. `out` may be one of the
// inputs only if it is inputs[0]; buffers need no alignment.
void reduce_elements(ncclDataType_t dtype, ncclRedOp_t op, void* out, const void* const* inputs,
                     int ninputs, size_t count);

}  // namespace standin
