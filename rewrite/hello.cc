#include "rewrite/hello.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>

namespace magi::rewrite {
namespace {

std::string transport_text(int64_t v) {
  return v == static_cast<int64_t>(Options::Transport::Nccl) ? "nccl" : "copy_engine";
}
std::string backend_text(int64_t v) {
  return v == static_cast<int64_t>(Options::Backend::Host) ? "host" : "cuda";
}
std::string count_text(int64_t v) { return std::to_string(v); }
std::string graph_slots_text(int64_t v) {
  switch (static_cast<Options::GraphSlots>(v)) {
    case Options::GraphSlots::Auto: return "auto";
    case Options::GraphSlots::Always: return "always";
    case Options::GraphSlots::Never: return "never";
  }
  return std::to_string(v);
}

struct Setting {
  const char* name;
  int64_t (*value)(const ScheduleSettings& s);
  std::string (*text)(int64_t v);
};
constexpr Setting kSettings[] = {
    {"MAGI_TRANSPORT", [](const ScheduleSettings& s) -> int64_t { return s.transport; },
     transport_text},
    {"MAGI_BACKEND", [](const ScheduleSettings& s) -> int64_t { return s.backend; }, backend_text},
    {"MAGI_WARMUP_STEPS", [](const ScheduleSettings& s) { return s.warmup_steps; }, count_text},
    {"MAGI_REAGREE_STEPS", [](const ScheduleSettings& s) { return s.reagree_steps; }, count_text},
    {"MAGI_MAX_STEP_CALLS", [](const ScheduleSettings& s) { return s.max_step_calls; }, count_text},
    {"MAGI_CE_FORCE", [](const ScheduleSettings& s) -> int64_t { return s.ce_force; }, count_text},
    {"MAGI_CAPTURE_WAIT_MS", [](const ScheduleSettings& s) { return s.capture_wait_ms; },
     count_text},
};
// Those that decide only whether a rank takes part in rounds at a graph capture.
constexpr Setting kCaptureSettings[] = {
    {"MAGI_GRAPH_SLOTS", [](const ScheduleSettings& s) -> int64_t { return s.graph_slots; },
     graph_slots_text},
    {"MAGI_STATIC_WEIGHTS", [](const ScheduleSettings& s) -> int64_t { return s.static_weights; },
     count_text},
};

// "0-2, 5"
std::string rank_ranges(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

// "rank 0: 3, rank 1: 5" for a few ranks; "3 on ranks 0-6; 5 on rank 7" for many.
std::string values_text(const Setting& setting, const std::vector<ScheduleSettings>& all) {
  std::string out;
  if (all.size() <= 4) {
    for (size_t r = 0; r < all.size(); ++r)
      out += (r ? ", rank " : "rank ") + std::to_string(r) + ": " +
             setting.text(setting.value(all[r]));
    return out;
  }
  std::map<int64_t, std::vector<int>> ranks_by_value;
  for (size_t r = 0; r < all.size(); ++r)
    ranks_by_value[setting.value(all[r])].push_back(static_cast<int>(r));
  for (const auto& [value, ranks] : ranks_by_value) {
    if (!out.empty()) out += "; ";
    out +=
        setting.text(value) + (ranks.size() == 1 ? " on rank " : " on ranks ") + rank_ranges(ranks);
  }
  return out;
}

// "MAGI_X differs between ranks (...)" for each setting of `table` that differs, joined by "; ".
template <size_t N>
std::string differences(const Setting (&table)[N], const std::vector<ScheduleSettings>& all) {
  std::string out;
  for (const Setting& setting : table) {
    bool differs = false;
    for (const ScheduleSettings& s : all)
      differs = differs || setting.value(s) != setting.value(all[0]);
    if (!differs) continue;
    if (!out.empty()) out += "; ";
    out += std::string(setting.name) + " differs between ranks (" + values_text(setting, all) + ")";
  }
  return out;
}

}  // namespace

ScheduleSettings schedule_settings(const Options& options, bool backend_available) {
  ScheduleSettings s{};
  s.warmup_steps = options.warmup_steps;
  s.reagree_steps = options.reagree_steps;
  s.max_step_calls = options.max_step_calls;
  s.capture_wait_ms = options.capture_wait_ms;
  s.transport = static_cast<uint8_t>(options.transport);
  s.backend = static_cast<uint8_t>(options.backend);
  s.ce_force = options.ce_force ? 1 : 0;
  s.backend_available = backend_available ? 1 : 0;
  s.graph_slots = static_cast<uint8_t>(options.graph_slots);
  s.static_weights = options.static_weights ? 1 : 0;
  return s;
}

bool takes_part(const ScheduleSettings& s) {
  return s.transport == static_cast<uint8_t>(Options::Transport::CopyEngine) &&
         s.backend_available != 0;
}

std::vector<uint8_t> hello_payload(const ScheduleSettings& s) {
  std::vector<uint8_t> out(sizeof s);
  std::memcpy(out.data(), &s, sizeof s);
  return out;
}

HelloOutcome read_hello(std::span<const uint8_t> all, int nranks) {
  HelloOutcome out;
  std::vector<ScheduleSettings> settings;
  std::vector<int> in_group;
  for (int r = 0; r < nranks; ++r) {
    Contribution c;
    const size_t at = static_cast<size_t>(r) * kContributionBytes;
    if (all.size() < at + kContributionBytes ||
        !Contribution::parse(all.subspan(at, kContributionBytes), c) ||
        c.header.kind != static_cast<uint8_t>(RoundKind::Hello) ||
        c.table.size() != sizeof(ScheduleSettings)) {
      out.reason = Reason::StepsDiffer;
      out.why = "rank " + std::to_string(r) +
                "'s settings check is unreadable (another version "
                "of the library?)";
      return out;
    }
    if (c.header.flags & kIssuedInGroup) in_group.push_back(r);
    settings.emplace_back();
    std::memcpy(&settings.back(), c.table.data(), sizeof(ScheduleSettings));
  }
  out.why = differences(kSettings, settings);
  std::vector<int> unable;
  for (size_t r = 0; r < settings.size(); ++r)
    if (settings[r].transport == static_cast<uint8_t>(Options::Transport::CopyEngine) &&
        !settings[r].backend_available)
      unable.push_back(static_cast<int>(r));
  if (!unable.empty()) {
    if (!out.why.empty()) out.why += "; ";
    out.why += std::string(unable.size() == 1 ? "rank " : "ranks ") + rank_ranges(unable) +
               " cannot run MAGI_BACKEND=cuda (the CUDA driver is not loaded there)";
  }
  if (!out.why.empty()) {
    out.reason = Reason::SettingsDiffer;
    out.why += ": this communicator stays on NCCL on every rank; set it alike on every rank";
    return out;
  }
  if (!in_group.empty()) {
    out.reason = Reason::AnchorInGroup;
    out.why = std::string(in_group.size() == 1 ? "rank " : "ranks ") + rank_ranges(in_group) +
              " made the settings check inside a group holding Send/Recv: this communicator "
              "stays on NCCL on every rank";
    return out;
  }
  // Alike everywhere; with MAGI_TRANSPORT=nccl everywhere nobody reads this.
  out.one_host = std::all_of(settings.begin(), settings.end(),
                             [&](const ScheduleSettings& s) { return s.host == settings[0].host; });
  out.capture_why = differences(kCaptureSettings, settings);
  out.capture_alike = out.capture_why.empty();
  out.agreed = takes_part(settings[0]);
  if (!out.agreed) {
    out.reason = Reason::CommNotAgreeable;
    out.why = "no rank takes part in agreement";
  }
  return out;
}

bool first_settings_warning() {
  static std::atomic<bool> said{false};
  return !said.exchange(true);
}

}  // namespace magi::rewrite
