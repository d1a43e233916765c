// Probe: is cudaIpcOpenMemHandle's cost per allocation or per byte, and do threads overlap it?
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
int main(int argc, char** argv) {
  const int n = atoi(argv[1]);
  const size_t bytes = size_t(atol(argv[2])) << 10;
  auto* shared = static_cast<cudaIpcMemHandle_t*>(mmap(nullptr, sizeof(cudaIpcMemHandle_t) * n + 64,
                                                       PROT_READ | PROT_WRITE,
                                                       MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  volatile int* flag = reinterpret_cast<volatile int*>(shared + n);
  *flag = 0;
  pid_t child = fork();
  if (child == 0) {
    std::vector<void*> p(n);
    for (int i = 0; i < n; ++i) {
      cudaMalloc(&p[i], bytes);
      cudaIpcGetMemHandle(&shared[i], p[i]);
    }
    __sync_synchronize();
    *flag = 1;
    while (*flag != 2) usleep(1000);
    return 0;
  }
  while (*flag != 1) usleep(1000);
  cudaFree(nullptr);
  for (int threads : {1, 2, 4, 8}) {
    std::vector<void*> opened(n);
    double t0 = now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        cudaSetDevice(0);
        for (int i = t; i < n; i += threads)
          if (cudaIpcOpenMemHandle(&opened[i], shared[i], cudaIpcMemLazyEnablePeerAccess) !=
              cudaSuccess)
            std::printf("open failed\n");
      });
    for (auto& th : pool) th.join();
    double t1 = now();
    for (int i = 0; i < n; ++i) cudaIpcCloseMemHandle(opened[i]);
    double t2 = now();
    std::printf(
        "n=%d size=%zu KiB threads=%d open %.2f ms (%.3f ms each, %.2f s/GiB) close %.2f ms\n", n,
        bytes >> 10, threads, (t1 - t0) * 1e3, (t1 - t0) * 1e3 / n,
        (t1 - t0) / (double(n) * bytes / (1 << 30)), (t2 - t1) * 1e3);
  }
  *flag = 2;
  waitpid(child, nullptr, 0);
}
