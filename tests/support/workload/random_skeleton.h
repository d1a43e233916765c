// The program the agree scenario runs, drawn from a seed: a prologue, then a step of items that
// repeats on one or two communicators (about a third of them steps of identical shapes: one
// unit repeated, each copy with its own buffers), and the per-rank perturbations that test
// agreement.
// Everything here is a pure function of (seed, rank count, communicator count, step count), drawn
// with splitmix64 (never <random>'s distributions, which differ between standard libraries), so
// every rank, run and build computes the same program.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace workload {

// splitmix64: a fixed generator whose output is defined by its few lines below.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next();
  uint64_t below(uint64_t bound);  // in [0, bound); bound > 0
  bool percent(int chance);        // true with probability chance/100

 private:
  uint64_t state_;
};

// splitmix64's finaliser: a good 64-bit mix, used for the data every call sends.
uint64_t mix64(uint64_t x);

enum class CallKind { AllGather, AllReduce, Broadcast, ReduceScatter };

// One collective. All-reduce and reduce-scatter are int32 sums (so results can be checked
// exactly); count is per rank (all-gather's sendcount, reduce-scatter's recvcount).
struct SkeletonCall {
  CallKind kind = CallKind::AllGather;
  ncclDataType_t dtype = ncclInt32;
  size_t count = 1;
  bool in_place = false;
  int root_pick = 0;  // broadcast root: root_pick % communicator size
  int id = 0;         // unique within the program; part of the data each rank sends
};

// A single call, or calls inside one ncclGroupStart/End.
struct SkeletonItem {
  bool grouped = false;
  std::vector<SkeletonCall> calls;
};

// "ag(float16 x17 in)": kind, datatype, count per rank, in place or out of place (and root).
std::string describe_call(const SkeletonCall& call);

enum class PerturbationKind { Callsite, Flap, Newbuf, Count, Group };
const char* perturbation_text(PerturbationKind kind);

// What one rank (or every rank: rank -1) does differently, on one gather of one communicator's
// step (comm 0 is the first communicator, 1 the split one), from step `from_step` on (0: the
// whole run).
struct Perturbation {
  PerturbationKind kind = PerturbationKind::Callsite;
  int comm = 0;
  int rank = -1;
  int item = 0;
  int call = 0;
  int from_step = 0;
};

struct Skeleton {
  uint64_t seed = 0;
  std::vector<SkeletonCall> prologue;            // on the first communicator, before the steps
  std::vector<std::vector<SkeletonItem>> steps;  // one step per communicator
  std::vector<Perturbation> perturbations;

  // Whether perturbation `kind` applies to (comm, item, call) on `rank` at `step`.
  const Perturbation* find(PerturbationKind kind, int comm, int rank, int item, int call,
                           int step) const;
  // One line: the prologue, each step and the perturbations.
  std::string describe() const;
};

// nranks >= 1, comms is 1 or 2, steps >= 0.
Skeleton make_skeleton(uint64_t seed, int nranks, int comms, int steps);

}  // namespace workload
