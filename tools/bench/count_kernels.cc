// Counts the CUDA API calls that put work on a GPU — kernel launches, graph launches, copies,
// memsets, stream memory operations — in any program, and prints the counts to stderr when the
// process ends. No Nsight Systems needed: a CUPTI injection library, loaded by the driver itself
// at cuInit in every process that sets CUDA_INJECTION64_PATH (forked and exec'd ranks alike).
//
//   g++ -std=c++20 -O2 -shared -fPIC -I/usr/local/cuda/include tools/bench/count_kernels.cc
//       -o libcount_kernels.so -L/usr/local/cuda/lib64 -lcupti -ldl -pthread
//       -Wl,-rpath,/usr/local/cuda/lib64:/usr/local/cuda/extras/CUPTI/lib64:'$ORIGIN'   (one line)
//   CUDA_INJECTION64_PATH=$PWD/libcount_kernels.so program ...
//
// What is counted: every runtime and driver API entry (CUPTI callback API) whose name launches a
// kernel (cuLaunch*, cudaLaunch*, not the host-function launches), a graph, a copy or a memset, or
// is a stream memory operation. A runtime call appears twice, once per domain (cudaMemcpyAsync
// and the cuMemcpyAsync it makes); a kernel launched inside the driver on its own behalf is no
// API call and is not seen here — COUNT_KERNELS_ACTIVITY=1 adds CUPTI's activity records, which
// list every kernel, copy and memset the GPU actually ran, whoever asked for it.
//
// Attribution, so one run can tell whose calls they were:
//  - by phase: a program may name what it is doing (count_kernels_phase("gather"), found with
//    dlopen(getenv("CUDA_INJECTION64_PATH"), RTLD_NOLOAD) + dlsym); calls are counted under the
//    phase current on the calling thread's process;
//  - by module (COUNT_KERNELS_MODULES=1): the first stack frame outside CUDA, CUPTI, libc and
//    this library names the shared object that made the call (a statically linked cudart counts
//    as part of the module it is linked into).
#include <cupti.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace {

enum class Work { KernelLaunch, GraphLaunch, Memcpy, Memset, StreamMemOp };
const char* work_name(Work w) {
  switch (w) {
    case Work::KernelLaunch: return "kernel launch";
    case Work::GraphLaunch: return "graph launch";
    case Work::Memcpy: return "memcpy";
    case Work::Memset: return "memset";
    case Work::StreamMemOp: return "stream mem op";
  }
  return "?";
}

bool starts_with(const char* s, const char* prefix) {
  return std::strncmp(s, prefix, std::strlen(prefix)) == 0;
}

// What an API entry does, by its name; false for calls that put no work on a GPU.
bool classify(const char* name, Work& work) {
  if (name == nullptr) return false;
  if (std::strstr(name, "GraphLaunch") != nullptr) return (work = Work::GraphLaunch), true;
  if ((starts_with(name, "cuLaunch") || starts_with(name, "cudaLaunch")) &&
      std::strstr(name, "HostFunc") == nullptr)
    return (work = Work::KernelLaunch), true;
  if (std::strstr(name, "Memcpy") != nullptr) return (work = Work::Memcpy), true;
  if (std::strstr(name, "Memset") != nullptr) return (work = Work::Memset), true;
  if (std::strstr(name, "StreamBatchMemOp") != nullptr ||
      std::strstr(name, "StreamWaitValue") != nullptr ||
      std::strstr(name, "StreamWriteValue") != nullptr)
    return (work = Work::StreamMemOp), true;
  return false;
}

struct Key {
  std::string phase;
  std::string module;
  bool runtime;  // runtime API domain (else driver)
  std::string api;
  bool operator<(const Key& o) const {
    return std::tie(phase, module, runtime, api) < std::tie(o.phase, o.module, o.runtime, o.api);
  }
};
struct Tally {
  Work work;
  unsigned long long calls = 0;
};

std::mutex g_mutex;
std::map<Key, Tally> g_counts;
std::string g_phase = "start";
bool g_modules = false;
bool g_activity = false;
bool g_reported = false;
CUpti_SubscriberHandle g_subscriber = nullptr;
// Activity records: what the GPU ran.
unsigned long long g_gpu_kernels = 0, g_gpu_memcpys = 0, g_gpu_memsets = 0, g_activity_dropped = 0;
std::map<std::string, unsigned long long> g_kernel_names;

bool env_on(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strcmp(v, "0") != 0;
}

// The module of the first frame that is neither CUDA, CUPTI, libc nor this library.
std::string caller_module() {
  void* frames[48];
  const int n = backtrace(frames, 48);
  Dl_info self{};
  dladdr(reinterpret_cast<void*>(&caller_module), &self);
  for (int i = 1; i < n; ++i) {
    Dl_info info{};
    if (dladdr(frames[i], &info) == 0 || info.dli_fname == nullptr) continue;
    if (info.dli_fbase == self.dli_fbase) continue;
    const char* base = std::strrchr(info.dli_fname, '/');
    base = base != nullptr ? base + 1 : info.dli_fname;
    if (starts_with(base, "libcuda.") || starts_with(base, "libcupti") ||
        starts_with(base, "libc.") || starts_with(base, "libnvidia-") ||
        starts_with(base, "libpthread"))
      continue;
    return *base != '\0' ? base : "(main program)";
  }
  return "(unknown)";
}

void CUPTIAPI on_api(void*, CUpti_CallbackDomain domain, CUpti_CallbackId, const void* data) {
  const auto* info = static_cast<const CUpti_CallbackData*>(data);
  if (info->callbackSite != CUPTI_API_ENTER) return;
  Work work{};
  if (!classify(info->functionName, work)) return;
  std::string module = g_modules ? caller_module() : std::string("-");
  std::lock_guard<std::mutex> lock(g_mutex);
  Tally& t = g_counts[Key{g_phase, std::move(module), domain == CUPTI_CB_DOMAIN_RUNTIME_API,
                          info->functionName}];
  t.work = work;
  ++t.calls;
}

constexpr size_t kActivityBuffer = 8 << 20;

void CUPTIAPI activity_buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kActivityBuffer));
  *size = kActivityBuffer;
  *max_records = 0;
}

void CUPTIAPI activity_buffer_completed(CUcontext, uint32_t stream_id, uint8_t* buffer, size_t,
                                        size_t valid) {
  (void)stream_id;
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        ++g_gpu_kernels;
        const char* name = reinterpret_cast<const CUpti_ActivityKernel10*>(record)->name;
        ++g_kernel_names[name != nullptr ? name : "?"];
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY:
      case CUPTI_ACTIVITY_KIND_MEMCPY2: ++g_gpu_memcpys; break;
      case CUPTI_ACTIVITY_KIND_MEMSET: ++g_gpu_memsets; break;
      default: break;
    }
  }
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(nullptr, stream_id, &dropped) == CUPTI_SUCCESS)
    g_activity_dropped += dropped;
  std::free(buffer);
}

void warn(const char* what, CUptiResult r) {
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  std::fprintf(stderr, "count_kernels pid %d: %s failed: %s\n", getpid(), what,
               text != nullptr ? text : "?");
}

}  // namespace

extern "C" {

// Names what the calling process does from now on (a static string or not: it is copied).
__attribute__((visibility("default"))) void count_kernels_phase(const char* phase) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_phase = phase != nullptr ? phase : "?";
}

// Prints the counts (once per process); also runs at exit. A process that leaves by _exit calls
// it itself.
__attribute__((visibility("default"))) void count_kernels_report() {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_reported || g_subscriber == nullptr) return;
  }
  if (g_activity) cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);  // takes the lock itself
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_reported) return;
  g_reported = true;
  const int pid = getpid();
  unsigned long long totals[5] = {};
  std::string out;
  char line[512];
  for (const auto& [key, tally] : g_counts) {
    if (!key.runtime) totals[static_cast<int>(tally.work)] += tally.calls;
    std::snprintf(line, sizeof line,
                  "count_kernels pid %d: phase %-16s module %-22s %-7s %-36s %-13s %llu\n", pid,
                  key.phase.c_str(), key.module.c_str(), key.runtime ? "runtime" : "driver",
                  key.api.c_str(), work_name(tally.work), tally.calls);
    out += line;
  }
  std::snprintf(line, sizeof line,
                "count_kernels pid %d: driver API totals: kernel launches %llu, graph launches "
                "%llu, memcpy %llu, "
                "memset %llu, stream mem ops %llu\n",
                pid, totals[0], totals[1], totals[2], totals[3], totals[4]);
  out += line;
  if (g_activity) {
    std::snprintf(line, sizeof line,
                  "count_kernels pid %d: GPU activity: kernels %llu, memcpys %llu, memsets %llu, "
                  "records dropped %llu\n",
                  pid, g_gpu_kernels, g_gpu_memcpys, g_gpu_memsets, g_activity_dropped);
    out += line;
    for (const auto& [name, n] : g_kernel_names) {
      std::snprintf(line, sizeof line, "count_kernels pid %d: GPU kernel %.300s x %llu\n", pid,
                    name.c_str(), n);
      out += line;
    }
  }
  std::fputs(out.c_str(), stderr);
  std::fflush(stderr);
}

// Called by the driver at cuInit when CUDA_INJECTION64_PATH names this library.
__attribute__((visibility("default"))) int InitializeInjection(void) {
  if (g_subscriber != nullptr) return 1;
  g_modules = env_on("COUNT_KERNELS_MODULES", false);
  CUptiResult r = cuptiSubscribe(&g_subscriber, on_api, nullptr);
  if (r != CUPTI_SUCCESS) {
    warn("cuptiSubscribe", r);
    g_subscriber = nullptr;
    return 0;
  }
  if ((r = cuptiEnableDomain(1, g_subscriber, CUPTI_CB_DOMAIN_DRIVER_API)) != CUPTI_SUCCESS)
    warn("cuptiEnableDomain (driver)", r);
  if ((r = cuptiEnableDomain(1, g_subscriber, CUPTI_CB_DOMAIN_RUNTIME_API)) != CUPTI_SUCCESS)
    warn("cuptiEnableDomain (runtime)", r);
  if (env_on("COUNT_KERNELS_ACTIVITY", false)) {
    g_activity = true;
    if ((r = cuptiActivityRegisterCallbacks(activity_buffer_requested,
                                            activity_buffer_completed)) != CUPTI_SUCCESS) {
      warn("cuptiActivityRegisterCallbacks", r);
      g_activity = false;
    }
    for (CUpti_ActivityKind kind :
         {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
          CUPTI_ACTIVITY_KIND_MEMCPY2, CUPTI_ACTIVITY_KIND_MEMSET}) {
      if (!g_activity) break;
      if ((r = cuptiActivityEnable(kind)) != CUPTI_SUCCESS) warn("cuptiActivityEnable", r);
    }
  }
  std::atexit(count_kernels_report);
  std::fprintf(stderr, "count_kernels pid %d: counting (modules %s, GPU activity %s)\n", getpid(),
               g_modules ? "on" : "off", g_activity ? "on" : "off");
  return 1;
}

}  // extern "C"

// Also at unload, for a process whose atexit handlers never ran.
__attribute__((destructor)) static void count_kernels_at_unload() { count_kernels_report(); }
