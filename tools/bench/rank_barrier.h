// What the ranks of one benchmark launch share outside NCCL: a barrier before each timed loop
// and the mean of each rank's time after it, as nccl-tests does with MPI. Not NCCL, on purpose:
// a collective of the benchmark's own would be a call the library under test sees and counts.
//
// The ranks map one small file (in the launch's own directory, magi-launch's STANDIN_ID_FILE
// beside it) with MAP_SHARED; every rank creates it if absent and sizes it alike, so no rank has
// to come first. The barrier is a counter and a generation: the last rank to arrive resets the
// counter and only then bumps the generation, so a rank that leaves and arrives at the next
// barrier cannot count twice into this one. Waiting ranks sleep in short naps: ranks may
// outnumber cores, and a spinning rank would take the core a late rank needs to arrive.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace magi::bench {

class RankBarrier {
 public:
  static constexpr int kMaxRanks = 256;

  RankBarrier(const std::string& path, int rank, int nranks) : rank_(rank), nranks_(nranks) {
    if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks)
      throw std::runtime_error("rank barrier: rank " + std::to_string(rank) + " of " +
                               std::to_string(nranks) + " is out of range");
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) fail("open " + path);
    if (::ftruncate(fd, sizeof(Shared)) != 0) {
      const int err = errno;
      ::close(fd);
      errno = err;
      fail("ftruncate " + path);
    }
    void* mapped = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    errno = err;
    if (mapped == MAP_FAILED) fail("mmap " + path);
    shared_ = static_cast<Shared*>(mapped);
  }
  ~RankBarrier() { ::munmap(shared_, sizeof(Shared)); }
  RankBarrier(const RankBarrier&) = delete;
  RankBarrier& operator=(const RankBarrier&) = delete;

  // Returns once every rank has called it (as often as this rank has).
  void wait() {
    const uint64_t generation = shared_->generation.load(std::memory_order_acquire);
    if (shared_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 ==
        static_cast<uint64_t>(nranks_)) {
      shared_->arrived.store(0, std::memory_order_relaxed);
      shared_->generation.fetch_add(1, std::memory_order_release);
      return;
    }
    const timespec nap{0, 20'000};
    while (shared_->generation.load(std::memory_order_acquire) == generation)
      ::nanosleep(&nap, nullptr);
  }

  // Every rank's `value` summed, returned on every rank.
  double sum(double value) {
    shared_->values[rank_] = value;
    wait();  // every value written
    double total = 0;
    for (int r = 0; r < nranks_; ++r) total += shared_->values[r];
    wait();  // every value read before the next sum writes
    return total;
  }
  double mean(double value) { return sum(value) / nranks_; }

 private:
  struct Shared {
    std::atomic<uint64_t> arrived;
    std::atomic<uint64_t> generation;
    double values[kMaxRanks];
  };
  static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared between processes");

  [[noreturn]] static void fail(const std::string& what) {
    throw std::runtime_error("rank barrier: " + what + ": " + std::strerror(errno));
  }

  int rank_, nranks_;
  Shared* shared_ = nullptr;
};

}  // namespace magi::bench
