// Ranks that share one GPU take turns at opening CUDA IPC mappings. Private to ce_transport/.
//
// Why. One GPU opens some 25,000 IPC handles a second, whoever asks, and two mappers at once
// already fill it. Eight ranks on one GPU, each mapping its peers' allocations at once, only
// queue in the driver, and the program's own CUDA calls queue behind them: measured on one H100
// (BENCHMARKS.md, "Pacing the mappings"), 8 ranks at once set up in 1.6-2.0 s with a program
// call's p99 wait of 0.4-0.6 ms; two at a time, in 1.5 s with 0.14 ms. Ranks on different GPUs
// do not take turns: whether their mappings contend could not be measured here.
//
// How. kSlots words in the shared host memory of the lowest rank on the GPU (its SourceLog); a
// mapper holds a slot for the length of one mapping by writing its pid there (0: free). A slot
// whose holder process is gone is free again, so a rank that dies while mapping stops nobody, and
// a wait is bounded whatever the slots say.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace magi::ce {

class MappingTurns {
 public:
  static constexpr size_t kSlots = 2;

  MappingTurns() = default;  // no turns: every mapping goes at once
  // The group's kSlots words.
  explicit MappingTurns(std::atomic<uint64_t>* slots) : slots_(slots) {}
  bool taken() const { return slots_ != nullptr; }

  // One turn, held for its life: waits while every slot is held by a live process, for at most a
  // second (then maps without a turn: the turns only pace, they must never stop a set-up).
  class Turn {
   public:
    explicit Turn(const MappingTurns& turns);
    ~Turn();
    Turn(const Turn&) = delete;
    Turn& operator=(const Turn&) = delete;

   private:
    std::atomic<uint64_t>* slot_ = nullptr;
  };

 private:
  std::atomic<uint64_t>* slots_ = nullptr;
};

}  // namespace magi::ce
