// fsdp --layers L --steps S [--diverge-rank R --diverge-step K --diverge-kind count|op|callsite]
//      [--exit-without-destroy 1] [--fork-child 1]
//      [--rewrite 1] [--callsite-rank R] [--group-rank R] [--newbuf-rank R --newbuf-step K]
//      [--count-step K] [--mixed-group 1] [--comms 2 [--perturb-comm 1|2]] [--device 1]
//      [--step-group 1] [--settle-step K] [--p2p 1]
//      [--static-change-rank R --static-change-step K] [--die-rank R --die-step K] [--abort-step K]
//      [--stall-rank R --stall-step K --stall-s T] [--watchdog-s S [--watchdog-grace-s G]]
//      [--end-rank R --end-how kill|exit] [--end-poll-s T] [--step-pause-ms T]
//
// An FSDP-style inference loop: one all-reduce at start-up, then per step every layer's weight
// shard is all-gathered (pairs of layers in one ncclGroupStart/End, as FSDP buckets them), used
// for host "compute", and the step ends with an all-reduce of the logits. Silent unless wrong:
// every gathered element is checked. With --device 1 every buffer NCCL sees is device memory on
// GPU 0 and the calls run on a stream of the scenario's own (Placement, scenario.h).
//
// Divergence, for the tools that must notice it: at step K rank R gathers layer 0 with one
// element less (count; run with STANDIN_MISMATCH=error and that call's error is reported and
// ignored), all-reduces it instead (op; likewise), or gathers it from another function with the
// same shape (callsite).
//
// Changes the agreement must survive (each about layer 0 of the perturbed communicator):
//   --rewrite 1        the weights change every step (the shards are rewritten before gathering)
//   --callsite-rank R  rank R gathers from another function for the whole run
//   --group-rank R     rank R wraps its gather in a group of its own (the ranks group differently)
//   --newbuf-rank R --newbuf-step K   rank R's shard moves to a new buffer at step K
//   --count-step K     from step K every rank gathers one element less
//   --mixed-group 1    each bucket's group also holds an all-reduce
//   --step-group 1     the whole step is one ncclGroupStart/End: every layer's gather and the
//                      all-reduce of the logits, of the activation before the step (a program
//                      that coalesces all its calls)
//   --settle-step K    until step K, every shard moves to a new buffer at each step (a program
//                      whose buffers settle late); the old ones stay allocated
//   --static-change-rank R --static-change-step K   rank R's shard changes in place at step K,
//                      breaking MAGI_STATIC_WEIGHTS's promise (stale reads accepted until the end)
//   --die-rank R --die-step K   rank R kills itself (SIGKILL) as step K begins; with
//                      --die-in-gather 1, right after its layer-0 gather of step K returned (its
//                      device work queued, not waited for: inside a moved gather once it moves)
//   --abort-step K     every rank calls ncclCommAbort as step K begins, then returns
//   --stall-rank R --stall-step K --stall-s T   rank R stops as step K begins, alive, for T
//                      seconds (a hung process), then exits 0 without another call;
//                      --stall-init 1: before ncclCommInitRank (a rank that never joins)
//   --watchdog-s S     as PyTorch's NCCL watchdog: if no step ends for S seconds, another thread
//                      aborts the communicators (ncclCommAbort) while the main thread may be
//                      blocked in a call or on the device. Once the main thread is free again the
//                      process exits 3; if it is still blocked G seconds (default 30) after the
//                      abort, it exits 4.
//   --end-rank R --end-how kill|exit   after its last step rank R ends at once: killed
//                      (SIGKILL: a crash with the communicator in use), or exit(0) with its
//                      communicator alive (a program that never tears down; the process's end
//                      releases what the library holds)
//   --end-poll-s T     after their last step the other ranks poll ncclCommGetAsyncError (every
//                      10 ms, as PyTorch's watchdog does) for T seconds before destroying, and
//                      say what they saw: "rank R: async error <name> after <ms> ms" at the first
//                      error, else "rank R: no async error in <T> s"
//   --uniform 1        every layer's shard has the same size and the step has no all-reduce:
//                      by shapes a step of one gather, each layer with its own buffer
//   --nonblocking 1    the communicator is made with config.blocking = 0
//   --p2p 1            after the start-up all-reduce, each rank sends a token to the next rank
//                      and receives one from the previous (ncclSend/ncclRecv in one group): the
//                      calls' numbers (seq) then run ahead of the collectives' numbers
//   --step-pause-ms T  after each step every rank sleeps T ms (host work between steps): a
//                      run of S steps then lasts at least S * T ms on any machine, so what
//                      happens at a set time (an injected set-up delay) lands inside it
//   --comms 2          a second communicator (ncclCommSplit, color rank % 2) runs a model of its
//                      own, step for step with the first; --perturb-comm picks which one the
//                      changes above apply to (default 1)
#include <signal.h>

#include <sys/wait.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/bootstrap.h"
#include "tests/support/workload/scenario.h"

namespace workload {
namespace {

constexpr int kHidden = 64;
constexpr int kVocab = 32;

size_t shard_elements(int layer) { return 256 * static_cast<size_t>(1 + layer % 3); }

float weight(int layer, size_t index, int step = 0) {
  const uint32_t h = static_cast<uint32_t>(index * 2654435761u) ^
                     static_cast<uint32_t>(layer * 40503) ^ static_cast<uint32_t>(step * 97);
  return static_cast<float>(h % 1000) / 1000.0f - 0.5f;
}

// Two distinct native call sites for the same gather. The empty asm after each call keeps it
// from becoming a tail call (which would leave no frame of its own on the stack), and the bodies
// differ so identical-code folding cannot merge the two functions.
__attribute__((noinline)) ncclResult_t gather_layer(const void* shard, void* full, size_t count,
                                                    ncclComm_t comm, cudaStream_t stream) {
  const ncclResult_t result = ncclAllGather(shard, full, count, ncclFloat32, comm, stream);
  asm volatile("" ::: "memory");
  return result;
}

__attribute__((noinline)) ncclResult_t gather_layer_elsewhere(const void* shard, void* full,
                                                              size_t count, ncclComm_t comm,
                                                              cudaStream_t stream) {
  volatile size_t elements = count;
  const ncclResult_t result = ncclAllGather(shard, full, elements, ncclFloat32, comm, stream);
  asm volatile("" ::: "memory");
  return result;
}

struct Divergence {
  int rank = -1;
  int step = -1;
  std::string kind;
};

// The changes of the header, for the communicator they apply to.
struct Changes {
  bool rewrite = false;
  // Breaks the promise of MAGI_STATIC_WEIGHTS: rank R's layer-0 shard changes in place at step K.
  // Peers may read the old bytes until the shim takes the gather back to NCCL, so both are
  // accepted until the last step, which must see the new ones.
  int static_change_rank = -1;
  int static_change_step = -1;
  int last_step = -1;
  int callsite_rank = -1;
  int group_rank = -1;
  int newbuf_rank = -1;
  int newbuf_step = -1;
  int count_step = -1;
  bool mixed_group = false;
  bool step_group = false;
  int settle_step = -1;
  bool uniform = false;
  int die_in_gather_rank = -1;  // SIGKILL right after this rank's layer-0 gather of die_step
  int die_step = -1;
};

float* floats(const Buffer& buffer) { return reinterpret_cast<float*>(buffer.host()); }
int* ints(const Buffer& buffer) { return reinterpret_cast<int*>(buffer.host()); }

class FsdpModel {
 public:
  FsdpModel(const Placement& placement, ncclComm_t comm, int rank, int nranks, int layers,
            Divergence divergence, Changes changes = {})
      : placement_(placement),
        comm_(comm),
        rank_(rank),
        n_(nranks),
        layers_(layers),
        divergence_(std::move(divergence)),
        changes_(changes) {
    for (int l = 0; l < layers_; ++l) {
      const size_t shard = shard_of(l);
      shards_.emplace_back(placement_, shard * sizeof(float));
      for (size_t i = 0; i < shard; ++i) floats(shards_.back())[i] = weight(l, rank_ * shard + i);
      full_.emplace_back(placement_, shard * n_ * sizeof(float));
    }
  }

  void prologue() {
    Buffer config(placement_, 2 * sizeof(int));
    ints(config)[0] = 1;
    ints(config)[1] = rank_;
    config.upload(0, config.bytes());
    WORKLOAD_CHECK(ncclAllReduce(config.nccl(), config.nccl(), 2, ncclInt32, ncclSum, comm_,
                                 placement_.stream()));
    placement_.synchronize();
    config.download(0, config.bytes());
    if (ints(config)[0] != n_ || ints(config)[1] != n_ * (n_ - 1) / 2) {
      throw ScenarioFailure(format("rank %d: prologue all-reduce gave {%d, %d}", rank_,
                                   ints(config)[0], ints(config)[1]));
    }
  }

  // A token round the ring: this rank's to the next, the previous rank's from it.
  void pass_token() {
    Buffer token(placement_, 2 * sizeof(int));
    ints(token)[0] = rank_;
    ints(token)[1] = -1;
    token.upload(0, token.bytes());
    WORKLOAD_CHECK(ncclGroupStart());
    WORKLOAD_CHECK(
        ncclSend(token.nccl(), 1, ncclInt32, (rank_ + 1) % n_, comm_, placement_.stream()));
    WORKLOAD_CHECK(ncclRecv(static_cast<int*>(token.nccl()) + 1, 1, ncclInt32,
                            (rank_ + n_ - 1) % n_, comm_, placement_.stream()));
    WORKLOAD_CHECK(ncclGroupEnd());
    placement_.synchronize();
    token.download(0, token.bytes());
    if (ints(token)[1] != (rank_ + n_ - 1) % n_)
      throw ScenarioFailure(
          format("rank %d: token from the previous rank is %d", rank_, ints(token)[1]));
  }

  void step(int s) {
    step_ = s;
    if (changes_.newbuf_rank == rank_ && changes_.newbuf_step == s) {
      // The old buffer is kept alive: its address must not come back.
      retired_.push_back(std::exchange(shards_[0], Buffer(placement_, shards_[0].bytes())));
    }
    if (changes_.static_change_rank == rank_ && changes_.static_change_step == s) {
      const size_t shard = shard_of(0);
      for (size_t i = 0; i < shard; ++i)
        floats(shards_[0])[i] = weight(0, rank_ * shard + i, kChanged);
    }
    if (s < changes_.settle_step) {
      for (Buffer& shard : shards_) {
        Buffer fresh(placement_, shard.bytes());
        std::memcpy(fresh.host(), shard.host(), shard.bytes());
        retired_.push_back(std::exchange(shard, std::move(fresh)));
      }
    }
    if (changes_.rewrite || (changes_.newbuf_rank == rank_ && changes_.newbuf_step == s)) {
      for (int l = 0; l < layers_; ++l) {
        const size_t shard = shard_of(l);
        for (size_t i = 0; i < shard; ++i) {
          floats(shards_[l])[i] = weight(l, rank_ * shard + i, version());
        }
      }
    }
    if (changes_.step_group) {
      step_as_one_group(s);
      return;
    }
    for (int l = 0; l < layers_;) {
      // Layers 1-2, 4-5, ... are bucketed: both gathers in one group.
      const bool bucket = l % 3 == 1 && l + 1 < layers_;
      if (bucket) {
        ints(counter_)[0] = rank_ + s;
        counter_.upload(0, counter_.bytes());
        WORKLOAD_CHECK(ncclGroupStart());
        WORKLOAD_CHECK(gather(s, l));
        if (changes_.mixed_group) {
          WORKLOAD_CHECK(ncclAllReduce(counter_.nccl(), counter_.nccl(), 1, ncclInt32, ncclSum,
                                       comm_, placement_.stream()));
        }
        WORKLOAD_CHECK(gather(s, l + 1));
        WORKLOAD_CHECK(ncclGroupEnd());
        placement_.synchronize();
        counter_.download(0, counter_.bytes());
        if (changes_.mixed_group && ints(counter_)[0] != n_ * (n_ - 1) / 2 + n_ * s) {
          throw ScenarioFailure(format("rank %d: step %d: all-reduce inside the group gave %d",
                                       rank_, s, ints(counter_)[0]));
        }
        compute(l);
        compute(l + 1);
        l += 2;
      } else {
        const bool own_group = l == 0 && changes_.group_rank == rank_;
        if (own_group) WORKLOAD_CHECK(ncclGroupStart());
        const ncclResult_t result = gather(s, l);
        if (own_group) WORKLOAD_CHECK(ncclGroupEnd());
        if (l == 0 && changes_.die_in_gather_rank == rank_ && changes_.die_step == s)
          raise(SIGKILL);
        if (!diverged_here(s, l)) {
          check(result, "ncclAllGather");
          compute(l);
        } else if (result != ncclSuccess) {
          std::fprintf(stderr,
                       "fsdp: rank %d: step %d layer %d: ncclAllGather returned %d (%s); ignored, "
                       "a rank diverged on purpose\n",
                       rank_, s, l, static_cast<int>(result), ncclGetErrorString(result));
        }
        l += 1;
      }
    }
    logits(s);
  }

 private:
  bool diverged_here(int s, int layer) const {
    return s == divergence_.step && layer == 0 &&
           (divergence_.kind == "count" || divergence_.kind == "op");
  }

  static constexpr int kChanged = 1000;  // the version a static shard changes to

  // Which weights the shards hold this step: 0 unless they are rewritten.
  int version() const { return changes_.rewrite ? step_ : 0; }

  size_t gathered_count(int layer) const {
    const size_t shard = shard_of(layer);
    return layer == 0 && changes_.count_step >= 0 && step_ >= changes_.count_step ? shard - 1
                                                                                  : shard;
  }

  // Writes the shard's current weights to what NCCL reads (device memory: a copy), then gathers.
  ncclResult_t gather(int s, int layer) {
    const size_t shard = gathered_count(layer);
    const Buffer& mine = shards_[layer];
    mine.upload(0, mine.bytes());
    const void* send = mine.nccl();
    void* recv = full_[layer].nccl();
    const cudaStream_t stream = placement_.stream();
    if (layer == 0 && changes_.callsite_rank == rank_) {
      return gather_layer_elsewhere(send, recv, shard, comm_, stream);
    }
    const bool me = rank_ == divergence_.rank && s == divergence_.step && layer == 0;
    if (me && divergence_.kind == "count") {
      return gather_layer(send, recv, shard - 1, comm_, stream);
    }
    if (me && divergence_.kind == "callsite") {
      return gather_layer_elsewhere(send, recv, shard, comm_, stream);
    }
    if (me && divergence_.kind == "op") {
      return ncclAllReduce(send, recv, shard, ncclFloat32, ncclSum, comm_, stream);
    }
    return gather_layer(send, recv, shard, comm_, stream);
  }

  // Checks the gathered weights, then applies the layer: a' = tanh(W a), W read cyclically.
  void compute(int layer) {
    const size_t shard = shard_of(layer);
    const size_t count = gathered_count(layer);  // rank r's part starts at r * count
    placement_.synchronize();
    full_[layer].download(0, count * n_ * sizeof(float));
    float* w = floats(full_[layer]);
    const size_t w_size = shard * n_;
    for (int r = 0; r < n_; ++r) {
      for (size_t i = 0; i < count; ++i) {
        const size_t at = r * count + i;
        const bool changed =
            layer == 0 && r == changes_.static_change_rank && step_ >= changes_.static_change_step;
        const float expected = weight(layer, r * shard + i, changed ? kChanged : version());
        const bool stale_allowed = changed && step_ < changes_.last_step &&
                                   w[at] == weight(layer, r * shard + i, version());
        if (w[at] != expected && !stale_allowed) {
          throw ScenarioFailure(
              format("rank %d: step %d layer %d: gathered weight %zu is %g, "
                     "expected %g",
                     rank_, step_, layer, at, w[at], expected));
        }
        w[at] = expected;  // a tolerated stale weight must not make this rank compute otherwise
      }
    }
    std::vector<float> next(kHidden);
    for (int k = 0; k < kHidden; ++k) {
      float sum = 0;
      for (int i = 0; i < kHidden; ++i)
        sum += w[(static_cast<size_t>(k) * kHidden + i) % w_size] * activation_[i];
      next[k] = std::tanh(sum);
    }
    activation_ = next;
  }

  void step_as_one_group(int s) {
    const std::vector<float> base = logits_base();
    WORKLOAD_CHECK(ncclGroupStart());
    for (int l = 0; l < layers_; ++l) check(gather(s, l), "ncclAllGather");
    WORKLOAD_CHECK(ncclAllReduce(mine_logits_.nccl(), total_logits_.nccl(), kVocab, ncclFloat32,
                                 ncclSum, comm_, placement_.stream()));
    WORKLOAD_CHECK(ncclGroupEnd());
    for (int l = 0; l < layers_; ++l) compute(l);
    check_logits(s, base);
  }

  // Every rank holds the same activations; rank r contributes (r + 1) times the logits.
  std::vector<float> logits_base() {
    std::vector<float> base(kVocab);
    float* mine = floats(mine_logits_);
    for (int v = 0; v < kVocab; ++v) {
      base[v] = activation_[v % kHidden] + static_cast<float>(v) * 0.01f;
      mine[v] = base[v] * static_cast<float>(rank_ + 1);
    }
    mine_logits_.upload(0, mine_logits_.bytes());
    return base;
  }
  size_t shard_of(int layer) const { return changes_.uniform ? 256 : shard_elements(layer); }

  void logits(int s) {
    if (changes_.uniform) return;  // nothing but the gathers on the communicator
    const std::vector<float> base = logits_base();
    WORKLOAD_CHECK(ncclAllReduce(mine_logits_.nccl(), total_logits_.nccl(), kVocab, ncclFloat32,
                                 ncclSum, comm_, placement_.stream()));
    check_logits(s, base);
  }
  void check_logits(int s, const std::vector<float>& base) {
    placement_.synchronize();
    total_logits_.download(0, total_logits_.bytes());
    const float* total = floats(total_logits_);
    const float factor = static_cast<float>(n_ * (n_ + 1) / 2);
    for (int v = 0; v < kVocab; ++v) {
      if (std::fabs(total[v] - base[v] * factor) > 1e-4f * (1.0f + std::fabs(base[v] * factor))) {
        throw ScenarioFailure(format("rank %d: step %d: logit %d is %g, expected %g", rank_, s, v,
                                     total[v], base[v] * factor));
      }
    }
    activation_[s % kHidden] += total[0] * 1e-3f;  // the next step depends on this one
  }

  const Placement& placement_;
  ncclComm_t comm_;
  int rank_, n_, layers_;
  Divergence divergence_;
  Changes changes_;
  int step_ = 0;
  std::vector<Buffer> shards_, full_, retired_;
  Buffer counter_{placement_, sizeof(int)};
  Buffer mine_logits_{placement_, kVocab * sizeof(float)};
  Buffer total_logits_{placement_, kVocab * sizeof(float)};
  std::vector<float> activation_ = std::vector<float>(kHidden, 0.5f);
};

// See --watchdog-s above. Its thread is detached: it only ever ends the process.
class Watchdog {
 public:
  static constexpr int kAbortedExit = 3;
  static constexpr int kStillBlockedExit = 4;

  Watchdog(double seconds, double grace_s, int rank, std::vector<ncclComm_t> comms) {
    if (seconds <= 0) return;
    std::thread([seconds, grace_s, rank, comms = std::move(comms)] {
      using Clock = std::chrono::steady_clock;
      uint64_t seen = steps_.load();
      auto since = Clock::now();
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        if (steps_.load() != seen) {
          seen = steps_.load();
          since = Clock::now();
        } else if (Clock::now() - since > std::chrono::duration<double>(seconds)) {
          break;
        }
      }
      std::fprintf(stderr,
                   "rank %d: watchdog: no step ended for %g s; aborting the communicators\n", rank,
                   seconds);
      fired_.store(true);
      for (ncclComm_t comm : comms) ncclCommAbort(comm);
      aborted_.store(true);
      std::fprintf(stderr, "rank %d: watchdog: communicators aborted\n", rank);
      std::this_thread::sleep_for(std::chrono::duration<double>(grace_s));
      std::fprintf(stderr,
                   "rank %d: watchdog: the main thread is still blocked %g s after the abort\n",
                   rank, grace_s);
      std::fflush(nullptr);
      _exit(kStillBlockedExit);
    }).detach();
  }

  void step_ended() { steps_.fetch_add(1); }
  // Called by the main thread whenever it is free: after each step and when a call failed (a
  // call the abort itself ended fails while the aborts are still going on).
  void exit_if_fired(int rank) {
    if (!fired_.load()) return;
    while (!aborted_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::fprintf(stderr, "rank %d: watchdog: the main thread is free again after the abort\n",
                 rank);
    std::fflush(nullptr);
    std::exit(kAbortedExit);
  }

 private:
  // Static storage: the detached thread may outlive the scenario's frame.
  static inline std::atomic<uint64_t> steps_{0};
  static inline std::atomic<bool> fired_{false};    // the watchdog began aborting
  static inline std::atomic<bool> aborted_{false};  // every abort returned
};

}  // namespace

int run_fsdp(const ScenarioOptions& options) {
  const int layers = static_cast<int>(options.number("layers", 4));
  const int steps = static_cast<int>(options.number("steps", 3));
  Divergence divergence;
  divergence.rank = static_cast<int>(options.number("diverge-rank", -1));
  divergence.step = static_cast<int>(options.number("diverge-step", -1));
  divergence.kind = options.text("diverge-kind", "count");
  if (layers < 1 || steps < 0)
    throw ScenarioFailure("--layers must be positive, --steps not negative");
  if (divergence.kind != "count" && divergence.kind != "op" && divergence.kind != "callsite") {
    throw ScenarioFailure("--diverge-kind is count, op or callsite");
  }

  Changes changes;
  changes.rewrite = options.number("rewrite", 0) != 0;
  changes.callsite_rank = static_cast<int>(options.number("callsite-rank", -1));
  changes.group_rank = static_cast<int>(options.number("group-rank", -1));
  changes.newbuf_rank = static_cast<int>(options.number("newbuf-rank", -1));
  changes.newbuf_step = static_cast<int>(options.number("newbuf-step", -1));
  changes.count_step = static_cast<int>(options.number("count-step", -1));
  changes.static_change_rank = static_cast<int>(options.number("static-change-rank", -1));
  changes.static_change_step = static_cast<int>(options.number("static-change-step", -1));
  changes.last_step = steps - 1;
  changes.mixed_group = options.number("mixed-group", 0) != 0;
  changes.step_group = options.number("step-group", 0) != 0;
  changes.settle_step = static_cast<int>(options.number("settle-step", -1));
  changes.uniform = options.number("uniform", 0) != 0;
  const bool die_in_gather = options.number("die-in-gather", 0) != 0;
  if (die_in_gather) {
    changes.die_in_gather_rank = static_cast<int>(options.number("die-rank", -1));
    changes.die_step = static_cast<int>(options.number("die-step", -1));
  }
  const int comms = static_cast<int>(options.number("comms", 1));
  const int perturbed = static_cast<int>(options.number("perturb-comm", 1));
  if (comms != 1 && comms != 2) throw ScenarioFailure("--comms is 1 or 2");

  const Placement placement(options);  // before the communicators: NCCL takes the device then
  const Bootstrap boot = bootstrap_from_env();
  if (boot.rank == static_cast<int>(options.number("stall-rank", -1)) &&
      options.number("stall-init", 0) != 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(options.number("stall-s", 30)));
    std::fflush(nullptr);
    _exit(0);
  }
  OwnedComm comm;
  if (options.number("nonblocking", 0) != 0) {
    // A non-blocking communicator (config.blocking = 0): its calls may return ncclInProgress.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(comm.out(), boot.nranks, boot.id, boot.rank, &config);
    while (r == ncclInProgress) {
      const ncclResult_t polled = ncclCommGetAsyncError(comm.get(), &r);
      if (polled != ncclSuccess) r = polled;
    }
    WORKLOAD_CHECK(r);
  } else {
    WORKLOAD_CHECK(ncclCommInitRank(comm.out(), boot.nranks, boot.id, boot.rank));
  }
  FsdpModel model(placement, comm.get(), boot.rank, boot.nranks, layers, divergence,
                  perturbed == 1 ? changes : Changes{});
  OwnedComm sub;
  std::unique_ptr<FsdpModel> sub_model;
  if (comms == 2) {
    WORKLOAD_CHECK(ncclCommSplit(comm.get(), boot.rank % 2, boot.rank, sub.out(), nullptr));
    int sub_rank = 0, sub_n = 0;
    WORKLOAD_CHECK(ncclCommUserRank(sub.get(), &sub_rank));
    WORKLOAD_CHECK(ncclCommCount(sub.get(), &sub_n));
    sub_model = std::make_unique<FsdpModel>(placement, sub.get(), sub_rank, sub_n, layers + 1,
                                            Divergence{}, perturbed == 2 ? changes : Changes{});
  }
  model.prologue();
  if (sub_model) sub_model->prologue();
  if (options.number("p2p", 0) != 0) model.pass_token();
  const int die_rank = die_in_gather ? -1 : static_cast<int>(options.number("die-rank", -1));
  const int die_step = static_cast<int>(options.number("die-step", -1));
  const int abort_step = static_cast<int>(options.number("abort-step", -1));
  const int stall_rank = static_cast<int>(options.number("stall-rank", -1));
  const int stall_step = static_cast<int>(options.number("stall-step", -1));
  const double stall_s = options.number("stall-s", 30);
  const auto step_pause =
      std::chrono::duration<double, std::milli>(options.number("step-pause-ms", 0));
  std::vector<ncclComm_t> watched = {comm.get()};
  if (sub.get() != nullptr) watched.push_back(sub.get());
  // The hung rank runs none: it stands for a process whose every thread is stuck.
  Watchdog watchdog(boot.rank == stall_rank ? 0 : options.number("watchdog-s", 0),
                    options.number("watchdog-grace-s", 30), boot.rank, watched);
  for (int s = 0; s < steps; ++s) {
    if (boot.rank == die_rank && s == die_step) raise(SIGKILL);  // a crashed rank: no goodbye
    if (boot.rank == stall_rank && s == stall_step) {
      std::this_thread::sleep_for(std::chrono::duration<double>(stall_s));
      std::fflush(nullptr);
      _exit(0);  // a hung process someone finally killed, minus the signal
    }
    if (s == abort_step) {
      // Every rank abandons its communicators mid-run, as a program that gives up on an error
      // does: no destroy afterwards, and the process ends normally.
      if (sub.get() != nullptr) WORKLOAD_CHECK(ncclCommAbort(*sub.out()));
      WORKLOAD_CHECK(ncclCommAbort(*comm.out()));
      *sub.out() = nullptr;
      *comm.out() = nullptr;
      return 0;
    }
    try {
      model.step(s);
      if (sub_model) sub_model->step(s);
    } catch (...) {
      watchdog.exit_if_fired(boot.rank);  // the abort made this call fail: expected
      throw;
    }
    watchdog.step_ended();
    watchdog.exit_if_fired(boot.rank);
    if (step_pause.count() > 0) std::this_thread::sleep_for(step_pause);
  }
  const int end_rank = static_cast<int>(options.number("end-rank", -1));
  if (boot.rank == end_rank) {
    std::fflush(nullptr);
    if (options.text("end-how", "kill") == "kill") raise(SIGKILL);
    std::exit(0);
  }
  if (const double poll_s = options.number("end-poll-s", 0); poll_s > 0) {
    const auto began = std::chrono::steady_clock::now();
    ncclResult_t seen = ncclSuccess;
    while (seen == ncclSuccess &&
           std::chrono::steady_clock::now() - began < std::chrono::duration<double>(poll_s)) {
      WORKLOAD_CHECK(ncclCommGetAsyncError(comm.get(), &seen));
      if (seen == ncclSuccess) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (seen != ncclSuccess)
      std::fprintf(stderr, "rank %d: async error %s after %lld ms\n", boot.rank,
                   ncclGetErrorString(seen),
                   static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                              std::chrono::steady_clock::now() - began)
                                              .count()));
    else
      std::fprintf(stderr, "rank %d: no async error in %g s\n", boot.rank, poll_s);
  }
  if (sub.get() != nullptr) sub.destroy();
  if (options.has("fork-child")) {
    // Like a program that forks a helper process (Python multiprocessing, say) which then exits
    // normally: the child must leave no trace of the parent's communicators behind.
    const pid_t child = fork();
    if (child == 0) std::exit(0);
    int status = 0;
    waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
      throw ScenarioFailure("forked child failed");
  }
  if (options.has("exit-without-destroy")) {
    std::fflush(nullptr);
    std::exit(0);  // like a program that never tears down: no destroy, no unwinding
  }
  comm.destroy();
  return 0;
}

}  // namespace workload
