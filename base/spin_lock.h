// A spin wait for the few places where a lock is held for a handful of stores: a futex round
// trip would cost more than the wait. The pause lets the sibling hyperthread run (x86 `pause`,
// Arm `yield`); elsewhere the loop just spins.
#pragma once

#include <atomic>

namespace magi {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  asm volatile("yield" ::: "memory");
#endif
}

// Test and test-and-set: a waiter spins on a plain load, so the holder's cache line is not
// bounced by writes while it is held. Constant-initialised and trivially destructible: usable in
// a global that a thread may still take while the process exits. Works with std::lock_guard.
class SpinLock {
 public:
  constexpr SpinLock() noexcept = default;
  SpinLock(const SpinLock&) = delete;
  SpinLock& operator=(const SpinLock&) = delete;

  void lock() noexcept {
    while (flag_.test_and_set(std::memory_order_acquire))
      while (flag_.test(std::memory_order_relaxed)) cpu_relax();
  }
  bool try_lock() noexcept { return !flag_.test_and_set(std::memory_order_acquire); }
  void unlock() noexcept { flag_.clear(std::memory_order_release); }

 private:
  std::atomic_flag flag_;  // clear (C++20)
};

}  // namespace magi
