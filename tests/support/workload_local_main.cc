// magi-workload-local SCENARIO [options]: like magi-workload, but libworkload.so (and with it
// libnccl.so.2) is opened with dlopen(RTLD_LOCAL | RTLD_NOW), the way PyTorch loads NCCL, so no
// NCCL symbol is in the global scope.
//
// magi-workload-local --no-nccl: loads nothing; asks the global scope for ncclAllReduce. Exit 3:
// there is none; else it calls it with a NULL communicator and exits 0 if that returned an error
// (printed on stderr), 1 if it claimed success.
#include <dlfcn.h>
#include <nccl.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstring>
#include <string>

namespace {

int call_global_allreduce() {
  using AllReduce = ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                     ncclComm_t, cudaStream_t);
  void* symbol = dlsym(RTLD_DEFAULT, "ncclAllReduce");
  if (symbol == nullptr) {
    std::fprintf(stderr, "no ncclAllReduce in the process\n");
    return 3;
  }
  float in[4] = {1, 2, 3, 4};
  float out[4] = {};
  const ncclResult_t result =
      reinterpret_cast<AllReduce>(symbol)(in, out, 4, ncclFloat32, ncclSum, nullptr, nullptr);
  if (result == ncclSuccess) {
    std::fprintf(stderr, "ncclAllReduce with a NULL communicator returned ncclSuccess\n");
    return 1;
  }
  std::fprintf(stderr, "ncclAllReduce with a NULL communicator returned %d\n",
               static_cast<int>(result));
  return 0;
}

std::string beside_executable(const char* file) {
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return file;
  std::string path(self, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/') + 1) + file;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "--no-nccl") == 0) return call_global_allreduce();
  const std::string library = beside_executable("libworkload.so");
  void* handle = dlopen(library.c_str(), RTLD_LOCAL | RTLD_NOW);
  if (handle == nullptr) {
    std::fprintf(stderr, "cannot load %s: %s\n", library.c_str(), dlerror());
    return 2;
  }
  using Entry = int (*)(int, char**);
  auto entry = reinterpret_cast<Entry>(dlsym(handle, "magi_workload_main"));
  if (entry == nullptr) {
    std::fprintf(stderr, "%s has no magi_workload_main\n", library.c_str());
    return 2;
  }
  return entry(argc - 1, argv + 1);
}
