// libcallsite_probe.so: a library for the call-site tests (tests/capture/callsite_test.cc) to
// dlopen, unload and load again. It offers two call paths that end in a callback into the test
// program, as a host program's code calls into NCCL, and a function whose address the tests
// normalise. Nothing here refers to the test program, so it links on its own.
#include <cstdint>

namespace {

// The empty asm after each call keeps the compiler from turning the call into a jump, which
// would take this frame off the stack the fingerprint walks.
__attribute__((noinline)) uint64_t second_hop(uint64_t (*callback)(void*), void* context) {
  const uint64_t result = callback(context);
  asm volatile("" ::: "memory");
  return result;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"), noinline)) uint64_t magi_probe_path_a(
    uint64_t (*callback)(void*), void* context) {
  const uint64_t result = callback(context);
  asm volatile("" ::: "memory");
  return result;
}

__attribute__((visibility("default"), noinline)) uint64_t magi_probe_path_b(
    uint64_t (*callback)(void*), void* context) {
  const uint64_t result = second_hop(callback, context);
  asm volatile("" ::: "memory");
  return result;
}

__attribute__((visibility("default"), noinline)) int magi_probe_anchor(int value) {
  return value * 3 + 1;
}

}  // extern "C"
