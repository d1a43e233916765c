// A toy sharded transformer serving a few tokens on N ranks: what `make demo` runs (4 ranks
// under magi-launch, through libmagice). It uses only the NCCL API, like a real serving loop,
// so every call the shim sees is one a real program would make:
//
//   FSDP      each layer's weights are sharded across the ranks and all-gathered just before
//             use; layers 0 and 1 form one bucket, gathered inside one ncclGroupStart/End.
//   MLP       split by its inner dimension (tensor parallel): each rank's partial output is
//             reduce-scattered, leaving rank r with slice r of the hidden state...
//   head      ...which is exactly what the output head, split by hidden dimension, needs: its
//             partial logits are summed by an all-reduce.
//   sampling  rank 0 picks the next token and broadcasts it; every rank checks it agrees.
//
// Rank 0 prints "step S: token T" per step and a checksum of the tokens at the end.
//   usage: magice-demo [--steps N]      (ranks and communicator come from magi-launch)
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

#include "tests/support/bootstrap.h"

namespace {

constexpr int kHidden = 48;  // divisible by 1, 2, 3, 4, 6, 8, 12, 16 ranks
constexpr int kInner = 96;   // the MLP's inner width
constexpr int kVocab = 40;
constexpr int kLayers = 4;

#define CHECK(call)                                                                \
  do {                                                                             \
    ncclResult_t result_ = (call);                                                 \
    if (result_ != ncclSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #call, ncclGetErrorString(result_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

// Deterministic "trained" weights: tensor `t`, element `i`, in [-scale, scale].
float param(int t, size_t i, float scale) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ static_cast<uint32_t>(t) * 2246822519u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return (static_cast<float>(h % 20001) / 10000.0f - 1.0f) * scale;
}

struct Model {
  int rank, nranks;
  ncclComm_t comm;
  std::vector<std::vector<float>> layer_shards;  // my 1/N of each H×H layer matrix
  std::vector<std::vector<float>> gathered =     // whole layers, for a bucket of up to two
      std::vector<std::vector<float>>(2, std::vector<float>(kHidden* kHidden));

  // A bucket's all-gathers go in one group, so they are in flight together (as FSDP does).
  void gather_bucket(int first, int count) {
    const size_t shard = layer_shards[first].size();
    CHECK(ncclGroupStart());
    for (int i = 0; i < count; ++i) {
      CHECK(ncclAllGather(layer_shards[first + i].data(), gathered[i].data(), shard, ncclFloat32,
                          comm, nullptr));
    }
    CHECK(ncclGroupEnd());
  }

  static void apply_layer(const std::vector<float>& w, std::vector<float>& x) {  // x = tanh(W x)
    std::vector<float> y(kHidden, 0.0f);
    for (int o = 0; o < kHidden; ++o) {
      for (int i = 0; i < kHidden; ++i) y[o] += w[o * kHidden + i] * x[i];
      y[o] = std::tanh(y[o]);
    }
    x = y;
  }

  int next_token(int token, int step) {
    std::vector<float> x(kHidden);  // token embedding + position embedding (replicated)
    for (int h = 0; h < kHidden; ++h)
      x[h] = param(100, token * kHidden + h, 1.0f) + param(101, step * kHidden + h, 1.5f);

    // FSDP layers: bucket {0, 1}, then the rest one at a time.
    gather_bucket(0, 2);
    apply_layer(gathered[0], x);
    apply_layer(gathered[1], x);
    for (int l = 2; l < kLayers; ++l) {
      gather_bucket(l, 1);
      apply_layer(gathered[0], x);
    }

    // MLP, tensor parallel over inner units [rank·F/N, (rank+1)·F/N).
    const int inner = kInner / nranks, slice = kHidden / nranks;
    std::vector<float> partial(kHidden, 0.0f);
    for (int j = rank * inner; j < (rank + 1) * inner; ++j) {
      float u = 0.0f;
      for (int i = 0; i < kHidden; ++i) u += param(200, j * kHidden + i, 0.3f) * x[i];
      u = std::max(u, 0.0f);
      for (int h = 0; h < kHidden; ++h) partial[h] += param(201, h * kInner + j, 0.3f) * u;
    }
    std::vector<float> mine(slice);  // slice `rank` of the summed MLP output
    CHECK(
        ncclReduceScatter(partial.data(), mine.data(), slice, ncclFloat32, ncclSum, comm, nullptr));
    for (int k = 0; k < slice; ++k) mine[k] += x[rank * slice + k];  // residual

    // Output head, split by hidden dimension: partial logits from my slice, summed.
    std::vector<float> logits(kVocab, 0.0f);
    for (int v = 0; v < kVocab; ++v) {
      for (int k = 0; k < slice; ++k)
        logits[v] += param(300, v * kHidden + rank * slice + k, 1.0f) * mine[k];
    }
    CHECK(ncclAllReduce(logits.data(), logits.data(), kVocab, ncclFloat32, ncclSum, comm, nullptr));

    int best = 0;
    for (int v = 1; v < kVocab; ++v) best = logits[v] > logits[best] ? v : best;
    int chosen = best;  // rank 0 decides (real samplers are random); the others must agree
    CHECK(ncclBroadcast(&chosen, &chosen, 1, ncclInt32, 0, comm, nullptr));
    if (chosen != best) {
      std::fprintf(stderr, "rank %d: step %d: rank 0 chose token %d, this rank computed %d\n", rank,
                   step, chosen, best);
      std::exit(1);
    }
    return chosen;
  }
};

}  // namespace

int main(int argc, char** argv) {
  int steps = 8;
  if (argc == 3 && std::strcmp(argv[1], "--steps") == 0) steps = std::atoi(argv[2]);
  Bootstrap boot;
  try {
    boot = bootstrap_from_env();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "magice-demo: %s\n", e.what());
    return 1;
  }
  if (kHidden % boot.nranks != 0 || kInner % boot.nranks != 0) {
    std::fprintf(stderr, "magice-demo: %d ranks do not divide the model (hidden %d, inner %d)\n",
                 boot.nranks, kHidden, kInner);
    return 1;
  }

  Model model{boot.rank, boot.nranks, nullptr, {}};
  CHECK(ncclCommInitRank(&model.comm, boot.nranks, boot.id, boot.rank));
  const size_t shard = kHidden * kHidden / boot.nranks;
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> w(shard);
    for (size_t i = 0; i < shard; ++i)
      w[i] = param(l, boot.rank * shard + i, 1.0f / std::sqrt(float(kHidden)) * 2.0f);
    model.layer_shards.push_back(w);
  }

  uint64_t checksum = 1469598103934665603ull;  // FNV-1a over the tokens
  int token = 1;
  for (int step = 0; step < steps; ++step) {
    token = model.next_token(token, step);
    checksum = (checksum ^ static_cast<uint64_t>(token)) * 1099511628211ull;
    if (boot.rank == 0) std::printf("step %d: token %d\n", step, token);
  }
  if (boot.rank == 0) std::printf("checksum: %016llx\n", static_cast<unsigned long long>(checksum));
  CHECK(ncclCommDestroy(model.comm));
  return 0;
}
