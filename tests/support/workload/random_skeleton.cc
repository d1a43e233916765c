#include "tests/support/workload/random_skeleton.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "tests/support/workload/reference.h"
#include "tests/support/workload/scenario.h"

namespace workload {

uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t SplitMix64::next() { return mix64(state_ += 0x9e3779b97f4a7c15ull); }

// The modulo bias is irrelevant here; what matters is that the draw is the same everywhere.
uint64_t SplitMix64::below(uint64_t bound) { return next() % bound; }

bool SplitMix64::percent(int chance) { return below(100) < static_cast<uint64_t>(chance); }

const char* perturbation_text(PerturbationKind kind) {
  switch (kind) {
    case PerturbationKind::Callsite: return "callsite";
    case PerturbationKind::Flap: return "flap";
    case PerturbationKind::Newbuf: return "newbuf";
    case PerturbationKind::Count: return "count";
    case PerturbationKind::Group: return "group";
  }
  return "?";
}

namespace {

constexpr size_t kSmallCounts[] = {1, 3, 5, 7, 17, 31, 33, 127, 255};
constexpr size_t kMediumCounts[] = {1000, 1023, 1025, 2049, 4097};
constexpr size_t kMaxCount = 20000;

// Odd and small counts are common (they find chunking and alignment mistakes); a few are large.
size_t draw_count(SplitMix64& rng) {
  const uint64_t r = rng.below(100);
  if (r < 35) return kSmallCounts[rng.below(std::size(kSmallCounts))];
  if (r < 65) return kMediumCounts[rng.below(std::size(kMediumCounts))];
  if (r < 90) return 1 + rng.below(5000);
  return 5000 + rng.below(kMaxCount - 5000 + 1);
}

class StepMaker {
 public:
  explicit StepMaker(SplitMix64& rng) : rng_(rng) {}

  SkeletonCall gather() {
    SkeletonCall c = base(CallKind::AllGather);
    c.dtype = static_cast<ncclDataType_t>(rng_.below(ncclNumTypes));
    c.count = draw_count(rng_);
    return c;
  }
  SkeletonCall all_reduce() {
    SkeletonCall c = base(CallKind::AllReduce);
    c.count = 1 + rng_.below(4097);
    return c;
  }
  SkeletonCall broadcast() {
    SkeletonCall c = base(CallKind::Broadcast);
    c.dtype = static_cast<ncclDataType_t>(rng_.below(ncclNumTypes));
    c.count = draw_count(rng_);
    c.root_pick = static_cast<int>(rng_.below(8));
    return c;
  }
  SkeletonCall reduce_scatter() {
    SkeletonCall c = base(CallKind::ReduceScatter);
    c.count = 1 + rng_.below(2049);
    return c;
  }

  // The same call again, as another layer would make it: same shape, its own buffers.
  SkeletonCall again(SkeletonCall call) {
    call.id = next_id_++;
    return call;
  }

  // A step of identical shapes: a unit (a gather; a gather and an all-reduce; or a gather and a
  // group of two gathers) repeated 2 to 6 times, each copy with its own buffers. By shapes the
  // step is one unit; by each rank's own buffers it is all of them.
  std::vector<SkeletonItem> repeated_step() {
    std::vector<SkeletonItem> unit{single(gather())};
    const uint64_t kind = rng_.below(3);
    if (kind == 1) unit.push_back(single(all_reduce()));
    if (kind == 2) {
      SkeletonItem pair;
      pair.grouped = true;
      pair.calls.push_back(gather());
      pair.calls.push_back(again(pair.calls[0]));
      unit.push_back(pair);
    }
    const uint64_t copies = 2 + rng_.below(5);
    std::vector<SkeletonItem> items = unit;
    for (uint64_t k = 1; k < copies; ++k) {
      for (SkeletonItem item : unit) {
        for (SkeletonCall& call : item.calls) call = again(call);
        items.push_back(item);
      }
    }
    return items;
  }

  SkeletonItem single(SkeletonCall call) {
    SkeletonItem item;
    item.calls.push_back(call);
    return item;
  }

  std::vector<SkeletonItem> step() {
    std::vector<SkeletonItem> items(1 + rng_.below(12));
    for (SkeletonItem& item : items) {
      const uint64_t r = rng_.below(100);
      if (r < 35) {
        item = single(gather());
      } else if (r < 60) {
        item.grouped = true;
        const uint64_t gathers = 1 + rng_.below(6);
        for (uint64_t g = 0; g < gathers; ++g) item.calls.push_back(gather());
        if (rng_.percent(30)) {
          const uint64_t at = rng_.below(item.calls.size() + 1);
          item.calls.insert(item.calls.begin() + static_cast<long>(at), all_reduce());
        }
      } else if (r < 75) {
        item = single(all_reduce());
      } else if (r < 90) {
        item = single(broadcast());
      } else {
        item = single(reduce_scatter());
      }
    }
    // Every step has an ungrouped gather, so each perturbation has something to act on.
    const bool has_single_gather = std::any_of(items.begin(), items.end(), [](const auto& item) {
      return !item.grouped && item.calls[0].kind == CallKind::AllGather;
    });
    if (!has_single_gather) items[rng_.below(items.size())] = single(gather());
    return items;
  }

 private:
  SkeletonCall base(CallKind kind) {
    SkeletonCall c;
    c.kind = kind;
    c.in_place = rng_.percent(50);
    c.id = next_id_++;
    return c;
  }

  SplitMix64& rng_;
  int next_id_ = 0;
};

struct GatherAt {
  int item, call;
};

std::vector<GatherAt> gathers_of(const std::vector<SkeletonItem>& step, bool singles_only) {
  std::vector<GatherAt> found;
  for (size_t i = 0; i < step.size(); ++i) {
    if (singles_only && step[i].grouped) continue;
    for (size_t c = 0; c < step[i].calls.size(); ++c) {
      if (step[i].calls[c].kind == CallKind::AllGather) {
        found.push_back({static_cast<int>(i), static_cast<int>(c)});
      }
    }
  }
  return found;
}

}  // namespace

std::string describe_call(const SkeletonCall& c) {
  const char* op = c.kind == CallKind::AllGather   ? "ag"
                   : c.kind == CallKind::AllReduce ? "ar"
                   : c.kind == CallKind::Broadcast ? "bc"
                                                   : "rs";
  std::string text =
      format("%s(%s x%zu %s", op, dtype_text(c.dtype), c.count, c.in_place ? "in" : "out");
  if (c.kind == CallKind::Broadcast) text += format(" root %d%%n", c.root_pick);
  return text + ")";
}

namespace {

std::string calls_text(const std::vector<SkeletonCall>& calls) {
  std::string text;
  for (const SkeletonCall& c : calls) text += (text.empty() ? "" : " ") + describe_call(c);
  return text;
}

}  // namespace

const Perturbation* Skeleton::find(PerturbationKind kind, int comm, int rank, int item, int call,
                                   int step) const {
  for (const Perturbation& p : perturbations) {
    if (p.kind == kind && p.comm == comm && (p.rank == -1 || p.rank == rank) && p.item == item &&
        p.call == call && step >= p.from_step) {
      return &p;
    }
  }
  return nullptr;
}

std::string Skeleton::describe() const {
  std::string text = format("seed %llu: prologue [%s]", static_cast<unsigned long long>(seed),
                            calls_text(prologue).c_str());
  for (size_t c = 0; c < steps.size(); ++c) {
    text += format(" comm%zu step [", c);
    for (size_t i = 0; i < steps[c].size(); ++i) {
      const SkeletonItem& item = steps[c][i];
      text += i == 0 ? "" : " ";
      text += item.grouped ? "{" + calls_text(item.calls) + "}" : describe_call(item.calls[0]);
    }
    text += "]";
  }
  text += " perturbations [";
  for (size_t i = 0; i < perturbations.size(); ++i) {
    const Perturbation& p = perturbations[i];
    text += format("%s%s %s comm%d item %d.%d", i == 0 ? "" : "; ", perturbation_text(p.kind),
                   p.rank < 0 ? "every rank" : format("rank %d", p.rank).c_str(), p.comm, p.item,
                   p.call);
    if (p.from_step > 0) text += format(" from step %d", p.from_step);
  }
  return text + "]";
}

Skeleton make_skeleton(uint64_t seed, int nranks, int comms, int steps) {
  SplitMix64 rng(seed);
  StepMaker maker(rng);
  Skeleton s;
  s.seed = seed;
  const uint64_t prologue_calls = rng.below(4);
  for (uint64_t i = 0; i < prologue_calls; ++i) {
    s.prologue.push_back(rng.percent(50) ? maker.all_reduce() : maker.broadcast());
  }
  // Whether a communicator's step is one of identical shapes comes from draws of its own, so
  // the seeds whose steps are not keep the programs they always drew.
  SplitMix64 shapes(mix64(seed ^ 0x1de471ca1ull));
  for (int c = 0; c < comms; ++c)
    s.steps.push_back(shapes.percent(30) ? maker.repeated_step() : maker.step());

  // A rank-local or shared change at a step late enough for the ranks to have agreed first,
  // with steps left after it to find the step again.
  const int lo = std::max(1, steps / 3);
  const int hi = std::max(lo, 2 * steps / 3);
  auto late_step = [&] { return lo + static_cast<int>(rng.below(hi - lo + 1)); };
  auto perturb = [&](PerturbationKind kind, int comm, bool every_rank, bool singles_only,
                     int from_step) {
    const std::vector<GatherAt> at = gathers_of(s.steps[comm], singles_only);
    const GatherAt g = at[rng.below(at.size())];
    const int rank = every_rank ? -1 : static_cast<int>(rng.below(nranks));
    s.perturbations.push_back({kind, comm, rank, g.item, g.call, from_step});
  };
  if (rng.percent(35)) perturb(PerturbationKind::Callsite, 0, false, false, 0);
  if (rng.percent(25)) {
    perturb(PerturbationKind::Flap, 0, false, false, 0);
    // A gather that flaps is not also the one moved for good: each does what it says.
    Perturbation& flap = s.perturbations.back();
    if (s.find(PerturbationKind::Callsite, 0, flap.rank, flap.item, flap.call, 0) != nullptr) {
      flap.rank = (flap.rank + 1) % nranks;
    }
  }
  if (rng.percent(35)) perturb(PerturbationKind::Newbuf, 0, false, false, late_step());
  if (rng.percent(30)) perturb(PerturbationKind::Count, 0, true, false, late_step());
  if (rng.percent(30)) {
    // With two communicators, sometimes only the second one is grouped differently: it must
    // give up agreeing while the first one agrees.
    const int comm = comms == 2 && rng.percent(50) ? 1 : 0;
    perturb(PerturbationKind::Group, comm, false, true, 0);
  }
  return s;
}

}  // namespace workload
