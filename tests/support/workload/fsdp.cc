// fsdp --layers L --steps S [--diverge-rank R --diverge-step K --diverge-kind count|callsite]
//      [--exit-without-destroy 1] [--fork-child 1]
//
// An FSDP-style inference loop: one all-reduce at start-up, then per step every layer's weight
// shard is all-gathered (pairs of layers in one ncclGroupStart/End, as FSDP buckets them), used
// for host "compute", and the step ends with an all-reduce of the logits. Silent unless wrong.
//
// Divergence, for the tools that must notice it: at step K rank R gathers layer 0 with one
// element less (count; run with STANDIN_MISMATCH=error and that call's error is reported and
// ignored), or from another function with the same shape (callsite).
#include <cmath>
#include <cstdlib>
#include <sys/wait.h>
#include <unistd.h>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/support/bootstrap.h"
#include "tests/support/workload/scenario.h"

namespace workload {
namespace {

constexpr int kHidden = 64;
constexpr int kVocab = 32;

size_t shard_elements(int layer) { return 256 * static_cast<size_t>(1 + layer % 3); }

float weight(int layer, size_t index) {
  const uint32_t h =
      static_cast<uint32_t>(index * 2654435761u) ^ static_cast<uint32_t>(layer * 40503);
  return static_cast<float>(h % 1000) / 1000.0f - 0.5f;
}

// Two distinct native call sites for the same gather. The empty asm after each call keeps it
// from becoming a tail call (which would leave no frame of its own on the stack), and the bodies
// differ so identical-code folding cannot merge the two functions.
__attribute__((noinline)) ncclResult_t gather_layer(const float* shard, float* full, size_t count,
                                                    ncclComm_t comm) {
  const ncclResult_t result = ncclAllGather(shard, full, count, ncclFloat32, comm, nullptr);
  asm volatile("" ::: "memory");
  return result;
}

__attribute__((noinline)) ncclResult_t gather_layer_elsewhere(const float* shard, float* full,
                                                              size_t count, ncclComm_t comm) {
  volatile size_t elements = count;
  const ncclResult_t result = ncclAllGather(shard, full, elements, ncclFloat32, comm, nullptr);
  asm volatile("" ::: "memory");
  return result;
}

struct Divergence {
  int rank = -1;
  int step = -1;
  std::string kind;
};

class FsdpModel {
 public:
  FsdpModel(ncclComm_t comm, int rank, int nranks, int layers, Divergence divergence)
      : comm_(comm), rank_(rank), n_(nranks), layers_(layers), divergence_(std::move(divergence)) {
    for (int l = 0; l < layers_; ++l) {
      const size_t shard = shard_elements(l);
      std::vector<float> mine(shard);
      for (size_t i = 0; i < shard; ++i) mine[i] = weight(l, rank_ * shard + i);
      shards_.push_back(std::move(mine));
      full_.emplace_back(shard * n_);
    }
  }

  void prologue() {
    int config[2] = {1, rank_};
    WORKLOAD_CHECK(ncclAllReduce(config, config, 2, ncclInt32, ncclSum, comm_, nullptr));
    if (config[0] != n_ || config[1] != n_ * (n_ - 1) / 2) {
      throw ScenarioFailure(
          format("rank %d: prologue all-reduce gave {%d, %d}", rank_, config[0], config[1]));
    }
  }

  void step(int s) {
    for (int l = 0; l < layers_;) {
      // Layers 1-2, 4-5, ... are bucketed: both gathers in one group.
      const bool bucket = l % 3 == 1 && l + 1 < layers_;
      if (bucket) {
        WORKLOAD_CHECK(ncclGroupStart());
        WORKLOAD_CHECK(gather(s, l));
        WORKLOAD_CHECK(gather(s, l + 1));
        WORKLOAD_CHECK(ncclGroupEnd());
        compute(l);
        compute(l + 1);
        l += 2;
      } else {
        const ncclResult_t result = gather(s, l);
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
    return s == divergence_.step && layer == 0 && divergence_.kind == "count";
  }

  ncclResult_t gather(int s, int layer) {
    const size_t shard = shard_elements(layer);
    const bool me = rank_ == divergence_.rank && s == divergence_.step && layer == 0;
    if (me && divergence_.kind == "count") {
      return gather_layer(shards_[layer].data(), full_[layer].data(), shard - 1, comm_);
    }
    if (me && divergence_.kind == "callsite") {
      return gather_layer_elsewhere(shards_[layer].data(), full_[layer].data(), shard, comm_);
    }
    return gather_layer(shards_[layer].data(), full_[layer].data(), shard, comm_);
  }

  // Checks the gathered weights, then applies the layer: a' = tanh(W a), W read cyclically.
  void compute(int layer) {
    const std::vector<float>& w = full_[layer];
    for (size_t i = 0; i < w.size(); ++i) {
      if (w[i] != weight(layer, i)) {
        throw ScenarioFailure(format("rank %d: layer %d: gathered weight %zu is %g, expected %g",
                                     rank_, layer, i, w[i], weight(layer, i)));
      }
    }
    std::vector<float> next(kHidden);
    for (int k = 0; k < kHidden; ++k) {
      float sum = 0;
      for (int i = 0; i < kHidden; ++i)
        sum += w[(static_cast<size_t>(k) * kHidden + i) % w.size()] * activation_[i];
      next[k] = std::tanh(sum);
    }
    activation_ = next;
  }

  // Every rank holds the same activations; rank r contributes (r + 1) times the logits.
  void logits(int s) {
    std::vector<float> base(kVocab), mine(kVocab);
    for (int v = 0; v < kVocab; ++v) {
      base[v] = activation_[v % kHidden] + static_cast<float>(v) * 0.01f;
      mine[v] = base[v] * static_cast<float>(rank_ + 1);
    }
    std::vector<float> total(kVocab);
    WORKLOAD_CHECK(
        ncclAllReduce(mine.data(), total.data(), kVocab, ncclFloat32, ncclSum, comm_, nullptr));
    const float factor = static_cast<float>(n_ * (n_ + 1) / 2);
    for (int v = 0; v < kVocab; ++v) {
      if (std::fabs(total[v] - base[v] * factor) > 1e-4f * (1.0f + std::fabs(base[v] * factor))) {
        throw ScenarioFailure(format("rank %d: step %d: logit %d is %g, expected %g", rank_, s, v,
                                     total[v], base[v] * factor));
      }
    }
    activation_[s % kHidden] += total[0] * 1e-3f;  // the next step depends on this one
  }

  ncclComm_t comm_;
  int rank_, n_, layers_;
  Divergence divergence_;
  std::vector<std::vector<float>> shards_, full_;
  std::vector<float> activation_ = std::vector<float>(kHidden, 0.5f);
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
  if (divergence.kind != "count" && divergence.kind != "callsite") {
    throw ScenarioFailure("--diverge-kind is count or callsite");
  }

  const Bootstrap boot = bootstrap_from_env();
  OwnedComm comm;
  WORKLOAD_CHECK(ncclCommInitRank(comm.out(), boot.nranks, boot.id, boot.rank));
  FsdpModel model(comm.get(), boot.rank, boot.nranks, layers, divergence);
  model.prologue();
  for (int s = 0; s < steps; ++s) model.step(s);
  if (options.has("fork-child")) {
    // Like a program that forks a helper process (Python multiprocessing, say) which then exits
    // normally: the child must leave no trace of the parent's communicators behind.
    const pid_t child = fork();
    if (child == 0) std::exit(0);
    int status = 0;
    waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) throw ScenarioFailure("forked child failed");
  }
  if (options.has("exit-without-destroy")) {
    std::fflush(nullptr);
    std::exit(0);  // like a program that never tears down: no destroy, no unwinding
  }
  comm.destroy();
  return 0;
}

}  // namespace workload
