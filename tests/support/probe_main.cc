// magi-probe: calls NCCL entry points found in the global scope (dlsym(RTLD_DEFAULT)) without
// loading any NCCL itself, and prints "Name=result" for each. Under LD_PRELOAD of the shim this
// shows what the shim answers when the real NCCL is missing or incomplete.
//   magi-probe AllReduce AllGather ...
#include <dlfcn.h>
#include <nccl.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>

int main(int argc, char** argv) {
  float send[4] = {1, 2, 3, 4}, recv[16] = {};
  for (int i = 1; i < argc; ++i) {
    const std::string_view name = argv[i];
    const std::string symbol = "nccl" + std::string(name);
    void* fn = dlsym(RTLD_DEFAULT, symbol.c_str());
    if (fn == nullptr) {
      std::printf("%s=absent\n", argv[i]);
      continue;
    }
    ncclResult_t r = ncclInternalError;
    if (name == "AllReduce")
      r = reinterpret_cast<decltype(&ncclAllReduce)>(fn)(send, recv, 4, ncclFloat32, ncclSum,
                                                         nullptr, nullptr);
    else if (name == "AllGather")
      r = reinterpret_cast<decltype(&ncclAllGather)>(fn)(send, recv, 4, ncclFloat32, nullptr,
                                                         nullptr);
    else if (name == "Broadcast")
      r = reinterpret_cast<decltype(&ncclBroadcast)>(fn)(send, recv, 4, ncclFloat32, 0, nullptr,
                                                         nullptr);
    else if (name == "GroupStart")
      r = reinterpret_cast<decltype(&ncclGroupStart)>(fn)();
    else if (name == "GroupEnd")
      r = reinterpret_cast<decltype(&ncclGroupEnd)>(fn)();
    else if (name == "CommDestroy")
      r = reinterpret_cast<decltype(&ncclCommDestroy)>(fn)(nullptr);
    else {
      std::printf("%s=unsupported-by-probe\n", argv[i]);
      continue;
    }
    std::printf("%s=%d\n", argv[i], static_cast<int>(r));
  }
  return 0;
}
