#include "rewrite/round_log.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace magi::rewrite {

void record_round(const TraceSink& trace, const RoundStamp& stamp, RoundKind kind,
                  trace::RoundEvent event, uint64_t seq, AgreementMode mode, Reason reason,
                  uint32_t moved) {
  trace::AgreementRecord r{};
  r.comm_id = stamp.comm_id;
  r.seq = seq;
  r.step_digest = stamp.step_digest;
  r.round = stamp.round;
  r.period = stamp.period;
  r.gathers = stamp.gathers;
  r.moved = moved;
  r.rank = stamp.rank;
  r.kind = static_cast<uint8_t>(kind);
  r.event = static_cast<uint8_t>(event);
  r.mode = static_cast<uint8_t>(mode);
  r.reason = static_cast<uint8_t>(reason);
  trace(trace::RecordType::Agreement, &r, sizeof(r));
}

void record_decision(const TraceSink& trace, const capture::CommInfo& info,
                     const StepObservation& seen, const Decision& d, uint32_t round) {
  std::map<Reason, uint32_t> stays;
  for (const GatherDecision& g : d.gathers) {
    const PositionSeen& p = seen.at(g.position);
    trace::DecisionRecord r{};
    r.comm_id = info.identity;
    r.callsite = p.callsite;
    r.count = p.count;
    r.round = round;
    r.position = g.position;
    r.rank = info.rank;
    r.refused_by = g.refused_by;
    r.bucket = g.bucket;
    r.dtype = p.dtype;
    r.verdict = static_cast<uint8_t>(!g.moves    ? trace::Verdict::Stays
                                     : d.dry_run ? trace::Verdict::WouldMove
                                                 : trace::Verdict::Moved);
    r.reason = static_cast<uint8_t>(g.reason);
    r.mode = static_cast<uint8_t>(d.mode);
    if (d.machines.spans()) {
      r.machines = static_cast<uint8_t>(std::min(d.machines.count, 255));
      r.sub_comm =
          static_cast<uint8_t>(std::min(d.machines.local_of[static_cast<size_t>(info.rank)], 255));
    }
    trace(trace::RecordType::Decision, &r, sizeof(r));
    if (!g.moves) ++stays[g.reason];
    MAGI_TRACE(Rewrite, "comm %012llx round %u gather at position %u: %s%s%s",
               short_id(info.identity), round, g.position,
               std::string(trace::verdict_name(static_cast<trace::Verdict>(r.verdict))).c_str(),
               g.moves ? "" : ": ",
               g.moves ? "" : std::string(trace::reason_name(g.reason)).c_str());
  }
  std::string why;
  for (const auto& [reason, count] : stays)
    why += (why.empty() ? "" : "; ") + std::to_string(count) + " " +
           std::string(trace::reason_name(reason));
  MAGI_INFO(Rewrite, "comm %012llx round %u: mode %s, %u of %zu gathers %s%s%s",
            short_id(info.identity), round, std::string(trace::mode_name(d.mode)).c_str(), d.moved,
            d.gathers.size(), d.dry_run ? "would move" : "move",
            why.empty() ? "" : "; stay: ", why.c_str());
}

void record_window(const TraceSink& trace, const RoundStamp& stamp, uint64_t seq,
                   AgreementMode mode, const ce::WindowMemory& memory) {
  trace::WindowRecord r{};
  r.comm_id = stamp.comm_id;
  r.seq = seq;
  r.window_bytes = memory.window_bytes;
  r.bound_bytes = memory.bound_bytes;
  r.exported_bytes = memory.exported_bytes;
  r.round = stamp.round;
  r.rank = stamp.rank;
  r.bound_shards = static_cast<uint32_t>(memory.bound_shards);
  r.exported_shards = static_cast<uint32_t>(memory.exported_shards);
  r.exported_allocations = static_cast<uint32_t>(memory.exported_allocations);
  r.peer_mappings = static_cast<uint32_t>(memory.peer_mappings);
  r.mode = static_cast<uint8_t>(mode);
  trace(trace::RecordType::Window, &r, sizeof(r));
  for (const ce::WindowMemory::Refusal& refusal : memory.refusals) {
    trace::WindowRefusalRecord why{};
    why.comm_id = stamp.comm_id;
    why.bytes = refusal.bytes;
    why.first = refusal.first;
    why.round = stamp.round;
    why.rank = stamp.rank;
    why.shards = static_cast<uint32_t>(refusal.shards);
    why.text_bytes = static_cast<uint32_t>(std::min<size_t>(refusal.why.size(), 1024));
    std::vector<uint8_t> payload(sizeof(why) + why.text_bytes);
    std::memcpy(payload.data(), &why, sizeof(why));
    std::memcpy(payload.data() + sizeof(why), refusal.why.data(), why.text_bytes);
    trace(trace::RecordType::WindowRefusal, payload.data(), static_cast<uint32_t>(payload.size()));
  }
}

}  // namespace magi::rewrite
