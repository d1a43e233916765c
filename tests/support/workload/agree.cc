// agree --seed S --steps N [--comms 1|2] [--dump 1] [--device 1] [--static-gathers 1]
//
// A seeded random program (random_skeleton.h) for the ranks' agreement on each communicator's
// step: a prologue, then a step of all-gathers (single and grouped, every datatype, odd counts,
// in place and out of place), all-reduces, broadcasts and reduce-scatters, repeated N times; with
// --comms 2 a second communicator (ncclCommSplit by rank parity) runs a step of its own after the
// first one's, every step. Per-rank perturbations drawn from the same seed change call sites,
// buffers, counts and grouping where agreement must notice. --dump 1 prints the program on one
// line to stderr; otherwise the scenario is silent unless a byte is wrong.
//
// Every call's send data is written afresh before the call, from (seed, step, call, rank), and
// every received byte is checked after the step: gathers and broadcasts byte for byte (so
// datatypes never matter), all-reduce and reduce-scatter as exact int32 sums. With --device 1
// every buffer NCCL sees is device memory on GPU 0 and the calls run on a stream of the
// scenario's own (Placement, scenario.h): the data goes in before each call and the results come
// out after the step, before they are checked.
//
// --static-gathers 1: every all-gather sends the same bytes at every step (its data does not
// depend on the step), as weights do: the promise MAGI_STATIC_WEIGHTS=1 asks of a program. The
// buffers holding them may still change (the perturbations), values never.
//
// Hidden, for the test that a wrong byte is caught: --corrupt-rank R [--corrupt-offset O] flips
// byte O (modulo its size) of the first all-gather's result on rank R at step 0 before checking.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/bootstrap.h"
#include "tests/support/workload/random_skeleton.h"
#include "tests/support/workload/reference.h"
#include "tests/support/workload/scenario.h"

namespace workload {
namespace {

// Two distinct native call sites for the same gather. The empty asm after each call keeps it
// from becoming a tail call (which would leave no frame of its own on the stack), and the bodies
// differ so identical-code folding cannot merge the two functions.
__attribute__((noinline)) ncclResult_t gather_here(const void* send, void* recv, size_t count,
                                                   ncclDataType_t dtype, ncclComm_t comm,
                                                   cudaStream_t stream) {
  const ncclResult_t result = ncclAllGather(send, recv, count, dtype, comm, stream);
  asm volatile("" ::: "memory");
  return result;
}

__attribute__((noinline)) ncclResult_t gather_elsewhere(const void* send, void* recv, size_t count,
                                                        ncclDataType_t dtype, ncclComm_t comm,
                                                        cudaStream_t stream) {
  volatile size_t elements = count;
  const ncclResult_t result = ncclAllGather(send, recv, elements, dtype, comm, stream);
  asm volatile("" ::: "memory");
  return result;
}

// The calling process's place in one communicator.
struct Party {
  const Placement* placement = nullptr;
  ncclComm_t comm = nullptr;
  int index = 0;  // 0: the first communicator, 1: the split one
  int global_rank = 0;
  int rank = 0;
  int size = 1;
};

bool static_gathers = false;  // --static-gathers 1, set once before anything runs

uint64_t data_key(uint64_t seed, int step, int call_id, int rank) {
  uint64_t key = mix64(seed);
  key = mix64(key ^ static_cast<uint64_t>(static_cast<int64_t>(step)));
  key = mix64(key ^ static_cast<uint64_t>(call_id));
  return mix64(key ^ static_cast<uint64_t>(rank + 1));
}

uint64_t element_bits(uint64_t key, size_t index) {
  return mix64(key + index * 0x9e3779b97f4a7c15ull);
}

// `count` elements of the pattern `key`, from element `first`. Floating-point elements have the
// top bit of their exponent cleared, so none is a NaN or an infinity: a path that ever looked at
// the values instead of the bytes would still see them unchanged.
void fill(unsigned char* dst, ncclDataType_t dtype, size_t count, uint64_t key, size_t first = 0) {
  const size_t size = element_bytes(dtype);
  const bool floating = dtype == ncclFloat16 || dtype == ncclFloat32 || dtype == ncclFloat64 ||
                        dtype == ncclBfloat16 || dtype == ncclFloat8e4m3 || dtype == ncclFloat8e5m2;
  for (size_t i = 0; i < count; ++i) {
    uint64_t bits = element_bits(key, first + i);
    if (floating) bits &= ~(uint64_t{1} << (size * 8 - 2));
    std::memcpy(dst + i * size, &bits, size);  // little-endian: the low bytes
  }
}

// Addends of the int32 sums: small enough that no sum of up to 8 ranks overflows.
int32_t addend(uint64_t key, size_t index) {
  return static_cast<int32_t>(element_bits(key, index) & 0xfffff) - 0x80000;
}

void fill_addends(unsigned char* dst, size_t count, uint64_t key, size_t first = 0) {
  for (size_t i = 0; i < count; ++i) {
    const int32_t value = addend(key, first + i);
    std::memcpy(dst + i * sizeof value, &value, sizeof value);
  }
}

// One call of the program on one communicator, with its buffers for the whole run (so its
// addresses are stable, as a framework's are), large enough for one element more than the
// skeleton's count (the count perturbation).
class CallSlot {
 public:
  CallSlot(const SkeletonCall& call, const Party& party)
      : call_(call), party_(party), size_(element_bytes(call.dtype)) {
    allocate();
  }

  // Writes this step's send data (and copies it to what NCCL reads), then issues the call;
  // gathers from gather_elsewhere when asked.
  void issue(uint64_t seed, int step, size_t count, bool elsewhere) {
    seed_ = seed;
    step_ = step;
    count_ = count;
    const uint64_t mine = key(party_.rank);
    const ncclComm_t comm = party_.comm;
    const cudaStream_t stream = party_.placement->stream();
    // Where the send data goes (reduce-scatter, below, always sends from its send buffer).
    const Buffer& in = call_.in_place ? *recv_ : *send_;
    const size_t at =
        call_.in_place && call_.kind == CallKind::AllGather ? party_.rank * count * size_ : 0;
    const void* from = static_cast<const unsigned char*>(in.nccl()) + at;
    void* recv = recv_->nccl();
    switch (call_.kind) {
      case CallKind::AllGather:
        fill(in.host() + at, call_.dtype, count, mine);
        in.upload(at, count * size_);
        WORKLOAD_CHECK((elsewhere ? gather_elsewhere : gather_here)(from, recv, count, call_.dtype,
                                                                    comm, stream));
        break;
      case CallKind::AllReduce:
        fill_addends(in.host(), count, mine);
        in.upload(0, count * size_);
        WORKLOAD_CHECK(ncclAllReduce(from, recv, count, ncclInt32, ncclSum, comm, stream));
        break;
      case CallKind::Broadcast:
        fill(in.host(), call_.dtype, count, mine);
        in.upload(0, count * size_);
        WORKLOAD_CHECK(ncclBroadcast(from, recv, count, call_.dtype, root(), comm, stream));
        break;
      case CallKind::ReduceScatter:
        fill_addends(send_->host(), count * party_.size, mine);
        send_->upload(0, count * party_.size * size_);
        WORKLOAD_CHECK(ncclReduceScatter(
            send_->nccl(), static_cast<unsigned char*>(result_buffer().nccl()) + result_offset(),
            count, ncclInt32, ncclSum, comm, stream));
        break;
    }
  }

  // Copies the result out of what NCCL wrote (device memory), once the stream is synchronized.
  void collect() const { result_buffer().download(result_offset(), result_bytes()); }

  // newbuf: from now on this rank's call reads from (or, in place, works in) memory at another
  // address. The old buffer stays allocated, so the new one cannot reuse its address.
  void replace_buffer() {
    retired_.push_back(call_.in_place ? std::move(recv_) : std::move(send_));
    allocate();
  }

  // The result as the scenario sees it (host memory, after collect()).
  unsigned char* result() const { return result_buffer().host() + result_offset(); }
  size_t result_bytes() const {
    return call_.kind == CallKind::AllGather ? count_ * party_.size * size_ : count_ * size_;
  }

  // Throws ScenarioFailure at the first byte of the result that is not what the ranks sent.
  void verify(const std::string& where) const {
    const Bytes expected = expected_result();
    const unsigned char* got = result();
    if (std::memcmp(got, expected.data(), expected.size()) == 0) return;
    size_t offset = 0;
    while (got[offset] == expected[offset]) ++offset;
    throw ScenarioFailure(format("%s %s: offset %zu (element %zu) is 0x%02x, expected 0x%02x",
                                 where.c_str(), describe_call(call_).c_str(), offset,
                                 offset / size_, got[offset], expected[offset]));
  }

 private:
  void allocate() {
    const size_t capacity = (call_.count + 1) * size_;
    const size_t n = static_cast<size_t>(party_.size);
    const bool gather = call_.kind == CallKind::AllGather;
    const bool scatter = call_.kind == CallKind::ReduceScatter;
    const Placement& placement = *party_.placement;
    if (!send_) send_ = std::make_unique<Buffer>(placement, scatter ? capacity * n : capacity);
    if (!recv_) recv_ = std::make_unique<Buffer>(placement, gather ? capacity * n : capacity);
  }

  // Reduce-scatter in place leaves its result in its block of the send buffer.
  const Buffer& result_buffer() const {
    return call_.kind == CallKind::ReduceScatter && call_.in_place ? *send_ : *recv_;
  }
  size_t result_offset() const {
    return call_.kind == CallKind::ReduceScatter && call_.in_place
               ? party_.rank * count_ * sizeof(int32_t)
               : 0;
  }

  uint64_t key(int rank) const {
    const bool same_every_step = static_gathers && call_.kind == CallKind::AllGather;
    return data_key(seed_, same_every_step ? 0 : step_, call_.id, rank);
  }
  int root() const { return call_.root_pick % party_.size; }

  Bytes expected_result() const {
    Bytes out(result_bytes());
    switch (call_.kind) {
      case CallKind::AllGather:
        for (int r = 0; r < party_.size; ++r) {
          fill(out.data() + r * count_ * size_, call_.dtype, count_, key(r));
        }
        break;
      case CallKind::Broadcast: fill(out.data(), call_.dtype, count_, key(root())); break;
      case CallKind::AllReduce:
      case CallKind::ReduceScatter: {
        // All-reduce sums element i of every rank; reduce-scatter this rank's block of them.
        const size_t first = call_.kind == CallKind::AllReduce ? 0 : party_.rank * count_;
        for (size_t i = 0; i < count_; ++i) {
          uint32_t sum = 0;  // wraps as NCCL's int32 sum does (it cannot here)
          for (int r = 0; r < party_.size; ++r) {
            sum += static_cast<uint32_t>(addend(key(r), first + i));
          }
          std::memcpy(out.data() + i * sizeof sum, &sum, sizeof sum);
        }
        break;
      }
    }
    return out;
  }

  SkeletonCall call_;
  Party party_;
  size_t size_;
  std::unique_ptr<Buffer> send_, recv_;
  std::vector<std::unique_ptr<Buffer>> retired_;
  uint64_t seed_ = 0;
  int step_ = 0;
  size_t count_ = 0;
};

// One communicator's step, issued with this rank's perturbations and checked after the step.
class StepRun {
 public:
  StepRun(const Skeleton& skeleton, const Party& party) : skeleton_(skeleton), party_(party) {
    for (const SkeletonItem& item : items()) {
      std::vector<CallSlot> calls;
      for (const SkeletonCall& call : item.calls) calls.emplace_back(call, party_);
      slots_.push_back(std::move(calls));
    }
  }

  void issue(int step) {
    for (size_t i = 0; i < slots_.size(); ++i) {
      const int item = static_cast<int>(i);
      const bool grouped =
          items()[i].grouped || applies(PerturbationKind::Group, item, 0, step) != nullptr;
      if (grouped) WORKLOAD_CHECK(ncclGroupStart());
      for (size_t c = 0; c < slots_[i].size(); ++c) {
        const int call = static_cast<int>(c);
        CallSlot& slot = slots_[i][c];
        const Perturbation* newbuf = applies(PerturbationKind::Newbuf, item, call, step);
        if (newbuf != nullptr && newbuf->from_step == step) slot.replace_buffer();
        const bool elsewhere =
            applies(PerturbationKind::Callsite, item, call, step) != nullptr ||
            (applies(PerturbationKind::Flap, item, call, step) != nullptr && step % 2 == 1);
        const size_t count = items()[i].calls[c].count +
                             (applies(PerturbationKind::Count, item, call, step) != nullptr);
        slot.issue(skeleton_.seed, step, count, elsewhere);
      }
      if (grouped) WORKLOAD_CHECK(ncclGroupEnd());
    }
  }

  // After the step: every result out of device memory, so verify() and a planted corruption
  // work on the host copy.
  void collect() const {
    party_.placement->synchronize();
    for (const std::vector<CallSlot>& calls : slots_) {
      for (const CallSlot& slot : calls) slot.collect();
    }
  }

  void verify(int step) const {
    for (size_t i = 0; i < slots_.size(); ++i) {
      for (size_t c = 0; c < slots_[i].size(); ++c) {
        slots_[i][c].verify(format("rank %d: step %d comm%d item %zu.%zu", party_.global_rank, step,
                                   party_.index, i, c));
      }
    }
  }

  // The first all-gather of the step (every step has one).
  CallSlot& first_gather() {
    for (size_t i = 0; i < slots_.size(); ++i) {
      for (size_t c = 0; c < slots_[i].size(); ++c) {
        if (items()[i].calls[c].kind == CallKind::AllGather) return slots_[i][c];
      }
    }
    throw ScenarioFailure("the step has no all-gather");
  }

 private:
  const std::vector<SkeletonItem>& items() const { return skeleton_.steps[party_.index]; }

  const Perturbation* applies(PerturbationKind kind, int item, int call, int step) const {
    return skeleton_.find(kind, party_.index, party_.global_rank, item, call, step);
  }

  const Skeleton& skeleton_;
  Party party_;
  std::vector<std::vector<CallSlot>> slots_;
};

Party party_of(const Placement& placement, ncclComm_t comm, int index, int global_rank) {
  Party party;
  party.placement = &placement;
  party.comm = comm;
  party.index = index;
  party.global_rank = global_rank;
  WORKLOAD_CHECK(ncclCommUserRank(comm, &party.rank));
  WORKLOAD_CHECK(ncclCommCount(comm, &party.size));
  return party;
}

}  // namespace

int run_agree(const ScenarioOptions& options) {
  const long seed = options.number("seed", 1);
  const int steps = static_cast<int>(options.number("steps", 8));
  const int comms = static_cast<int>(options.number("comms", 1));
  static_gathers = options.number("static-gathers", 0) != 0;
  const int corrupt_rank = static_cast<int>(options.number("corrupt-rank", -1));
  const long corrupt_offset = options.number("corrupt-offset", 0);
  if (steps < 0 || (comms != 1 && comms != 2) || corrupt_offset < 0) {
    throw ScenarioFailure("--steps not negative, --comms 1 or 2, --corrupt-offset not negative");
  }

  const Placement placement(options);  // before the communicators: NCCL takes the device then
  const Bootstrap boot = bootstrap_from_env();
  const Skeleton skeleton = make_skeleton(static_cast<uint64_t>(seed), boot.nranks, comms, steps);
  if (options.number("dump", 0) != 0)
    std::fprintf(stderr, "agree: %s\n", skeleton.describe().c_str());

  OwnedComm world;
  WORKLOAD_CHECK(ncclCommInitRank(world.out(), boot.nranks, boot.id, boot.rank));
  const Party first = party_of(placement, world.get(), 0, boot.rank);
  {
    std::vector<CallSlot> prologue;
    for (const SkeletonCall& call : skeleton.prologue) prologue.emplace_back(call, first);
    for (size_t i = 0; i < prologue.size(); ++i) {
      prologue[i].issue(skeleton.seed, -1, skeleton.prologue[i].count, false);
    }
    placement.synchronize();
    for (const CallSlot& slot : prologue) slot.collect();
    for (size_t i = 0; i < prologue.size(); ++i) {
      prologue[i].verify(format("rank %d: prologue call %zu", boot.rank, i));
    }
  }

  OwnedComm half;
  std::vector<StepRun> runs;
  runs.emplace_back(skeleton, first);
  if (comms == 2) {
    WORKLOAD_CHECK(ncclCommSplit(world.get(), boot.rank % 2, boot.rank, half.out(), nullptr));
    runs.emplace_back(skeleton, party_of(placement, half.get(), 1, boot.rank));
  }

  for (int s = 0; s < steps; ++s) {
    for (StepRun& run : runs) run.issue(s);
    for (const StepRun& run : runs) run.collect();
    if (s == 0 && boot.rank == corrupt_rank) {
      CallSlot& slot = runs[0].first_gather();
      slot.result()[static_cast<size_t>(corrupt_offset) % slot.result_bytes()] ^= 0x01;
    }
    for (const StepRun& run : runs) run.verify(s);
  }

  if (comms == 2) half.destroy();
  world.destroy();
  return 0;
}

}  // namespace workload
