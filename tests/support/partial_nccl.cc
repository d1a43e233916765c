// A deliberately incomplete "NCCL": only ncclGetVersion and ncclAllReduce exist, and the latter
// answers with a code no real call would give here (ncclRemoteError), so a test can see that the
// shim forwards it and returns it unchanged, and that the functions it lacks fail cleanly.
#include <nccl.h>

extern "C" __attribute__((visibility("default"))) ncclResult_t ncclGetVersion(int* version) {
  *version = 21901;
  return ncclSuccess;
}

extern "C" __attribute__((visibility("default"))) ncclResult_t ncclAllReduce(
    const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) {
  return ncclRemoteError;
}
