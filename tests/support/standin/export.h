// The exported NCCL names. Everything else in the library is hidden (-fvisibility=hidden), so
// nothing internal can be interposed. One exported name is called from inside on purpose, as
// real NCCL does: ncclBcast calls ncclBroadcast (api_ops.cc).
//
// Real NCCL exports each function twice, as ncclX and as the profiling name pncclX; so do we.
#pragma once

#define STANDIN_API extern "C" __attribute__((visibility("default")))
#define STANDIN_ALIAS(name) \
  extern "C" __attribute__((visibility("default"), alias("p" #name))) decltype(p##name) name;
