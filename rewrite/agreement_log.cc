#include "rewrite/agreement_log.h"

#include <cstdio>
#include <string>
#include <utility>

namespace magi::rewrite {
namespace {

std::string named(Reason why) { return std::string(trace::reason_name(why)); }

}  // namespace

void AgreementLog::why_no_agreement(Reason never, bool hello_owed, bool nonblocking,
                                    bool transport_nccl, bool takes_part) const {
  if (never == Reason::SingleRank)
    MAGI_INFO(Rewrite,
              "comm %012llx: one rank: NCCL's all-gather is one local copy there, which the copy "
              "engine cannot beat; no agreement on this communicator (MAGI_CE_FORCE=1 moves its "
              "gathers anyway)",
              short_id(comm_));
  else if (!hello_owed)
    MAGI_INFO(Rewrite, "comm %012llx: no agreement on this communicator (%s)", short_id(comm_),
              nonblocking ? "non-blocking communicator" : "ncclCommInitAll or unknown");
  else if (transport_nccl)
    MAGI_INFO(Rewrite,
              "comm %012llx: no agreement on this communicator (MAGI_TRANSPORT=nccl); its first "
              "collective still tells the peers so, with one small all-gather",
              short_id(comm_));
  else if (!takes_part)
    // The hello tells the peers, which then stay on NCCL too.
    MAGI_INFO(Rewrite,
              "comm %012llx: no agreement: MAGI_BACKEND=cuda and the program has not "
              "loaded the CUDA driver (MAGI_BACKEND=host serves host buffers)",
              short_id(comm_));
}

void AgreementLog::phase(Phase from, Phase to, uint64_t seq) const {
  if (from == to) return;
  MAGI_TRACE(Rewrite, "comm %012llx: phase %s -> %s at collective #%llu", short_id(comm_),
             phase_name(from), phase_name(to), static_cast<unsigned long long>(seq));
}

void AgreementLog::cannot_prepare_round(const char* what) const {
  // Rare and serious (no memory for a few kilobytes): without a round of our own the peers'
  // round would meet the program's next call, so said loudly.
  MAGI_WARN(Rewrite, "comm %012llx: cannot prepare an agreement round (%s); peers may wait for it",
            short_id(comm_), what);
}

void AgreementLog::nccl_refused_round(int result) const {
  MAGI_WARN(Rewrite,
            "comm %012llx: NCCL refused an agreement round (%d); no agreement on this "
            "communicator from now on",
            short_id(comm_), result);
}

void AgreementLog::hello_refused(const std::string& why, bool first_warning) const {
  if (first_warning)
    MAGI_WARN(Rewrite, "comm %012llx: %s", short_id(comm_), why.c_str());
  else
    MAGI_INFO(Rewrite, "comm %012llx: %s", short_id(comm_), why.c_str());
}

void AgreementLog::early_capture(uint64_t seq) {
  if (std::exchange(early_capture_said_, true)) return;
  MAGI_INFO(Rewrite,
            "comm %012llx: a gather captured into a CUDA graph at collective #%llu, before any "
            "plan was active: that graph keeps its gathers on NCCL at every replay (no round at "
            "the capture moved it: a line before says why)",
            short_id(comm_), static_cast<unsigned long long>(seq));
}

void AgreementLog::no_capture_round(uint64_t seq, const char* why, bool abandoned) {
  if (std::exchange(no_capture_round_said_, true)) return;
  if (abandoned)
    MAGI_WARN(Rewrite,
              "comm %012llx: a round at a CUDA graph capture (collective #%llu) was abandoned: %s. "
              "Every rank keeps this communicator's captured gathers on NCCL from here (did every "
              "rank capture the same calls?)",
              short_id(comm_), static_cast<unsigned long long>(seq), why);
  else
    MAGI_INFO(Rewrite,
              "comm %012llx: the gathers captured into a CUDA graph from collective #%llu are "
              "agreed at the capture, and stay on NCCL: %s",
              short_id(comm_), static_cast<unsigned long long>(seq), why);
}

void AgreementLog::agreed_at_capture(uint32_t round, uint64_t seq, uint32_t moved, size_t gathers,
                                     const char* decided_by, double ms) const {
  MAGI_INFO(Rewrite,
            "comm %012llx: round %u agreed at a CUDA graph capture (collective #%llu): %u of %zu "
            "gathers of the step leave NCCL from here, in this graph and after it; untimed, "
            "decided by %s; rounds and set-up took %.1f ms, once for this graph",
            short_id(comm_), round, static_cast<unsigned long long>(seq), moved, gathers,
            decided_by, ms);
}

void AgreementLog::captured(bool moves, bool bound, bool dry, bool slots_never) {
  bool& said = moves ? captured_moves_said_ : captured_stays_said_;
  if (std::exchange(said, true)) return;
  if (moves && bound)
    MAGI_INFO(Rewrite,
              "comm %012llx: gathers captured into a CUDA graph move with the plan (static "
              "weights): each replay reads the peers' shards where they lie, with no handshake; "
              "the mappings live as long as the graph",
              short_id(comm_));
  else if (moves)
    MAGI_INFO(Rewrite,
              "comm %012llx: gathers captured into a CUDA graph move with the plan, on its graph "
              "slots: each replay stages this rank's shards and reads the peers', ordered by "
              "latches that the replay leaves as it found them; the window lives as long as the "
              "graph",
              short_id(comm_));
  else
    MAGI_INFO(Rewrite,
              "comm %012llx: gathers captured into a CUDA graph stay on NCCL on every rank: %s",
              short_id(comm_),
              dry ? "MAGI_DRY_RUN=1"
              : slots_never
                  ? "MAGI_GRAPH_SLOTS=never (the default mode's eager handshake counts buckets, "
                    "which a replay would repeat)"
                  : "the plan has no graph slots; the next plan agreed has them, unless a rank "
                    "sets MAGI_GRAPH_SLOTS=never (a graph captured before keeps NCCL: "
                    "MAGI_GRAPH_SLOTS=always gives them from the first plan, "
                    "MAGI_STATIC_WEIGHTS=1 needs none)");
}

void AgreementLog::refined(uint32_t round, uint32_t period, uint32_t shape_steps) const {
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: the step is %u collectives (%u shape steps): each gather "
            "keeps its own position",
            short_id(comm_), round, period, shape_steps);
}

void AgreementLog::stopped(uint32_t round, Reason why) const {
  MAGI_INFO(Rewrite, "comm %012llx round %u: %s: no more agreement rounds on this communicator",
            short_id(comm_), round, named(why).c_str());
}

void AgreementLog::transient(uint32_t round, const Decision& d) const {
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: static weights: gather at position %lld is transient on "
            "rank %d (%s): the plan stages instead of binding",
            short_id(comm_), round, static_cast<long long>(d.transient_position), d.transient_rank,
            d.transient_flags & kEntryBufferReused ? "buffer reused" : "in place");
}

void AgreementLog::two_levels(uint32_t round, const Decision& d, int rank) const {
  const Machines& m = d.machines;
  const size_t r = static_cast<size_t>(rank);
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: the ranks span %d machines of %d: each moved gather runs "
            "in two levels, NCCL between machines on the sub-communicator of local index %d "
            "(this rank is machine %d), then the transport inside the machine%s",
            short_id(comm_), round, m.count, m.per_machine, m.local_of[r], m.machine_of[r],
            d.network_once ? "; MAGI_STATIC_WEIGHTS=1: the other machines' shards cross the "
                             "network once, then are held"
            : d.static_across_machines
                ? "; MAGI_STATIC_WEIGHTS=1 across machines: the plan stages (the other machines' "
                  "shards arrive at every call: holding them all would pass some rank's "
                  "MAGI_BIND_MAX_MIB)"
                : "");
  if (d.network_once)
    MAGI_INFO(Transport,
              "comm %012llx round %u: holds %.1f KiB of its machines' static shards (its own "
              "included), within MAGI_BIND_MAX_MIB",
              short_id(comm_), round, static_cast<double>(d.held_bytes) / 1024);
}

void AgreementLog::not_timed_again(uint32_t round) const {
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: every moving bucket is as large as one the copy engine "
            "already won: not timed again",
            short_id(comm_), round);
}

void AgreementLog::cannot_prepare_window(const char* what) {
  if (!std::exchange(prepare_unsaid_, false)) return;
  MAGI_WARN(Transport, "comm %012llx: cannot prepare a window: %s; everything stays on NCCL",
            short_id(comm_), what);
}

void AgreementLog::staging_window(size_t window, size_t slot_bytes, uint32_t gathers) {
  if (!std::exchange(prepare_unsaid_, false)) return;
  MAGI_INFO(Transport,
            "comm %012llx: window of %zu bytes (two staging slots of %zu) for %u gathers",
            short_id(comm_), window, slot_bytes, gathers);
}

void AgreementLog::static_window(uint32_t gathers, const ce::WindowMemory& m, size_t window,
                                 double off_ms) {
  if (!std::exchange(prepare_unsaid_, false)) return;
  char where[64] = "";
  if (off_ms >= 0)
    std::snprintf(where, sizeof(where), "; prepared in %.1f ms off the program's calls", off_ms);
  MAGI_INFO(Transport,
            "comm %012llx: static weights: %u gathers: %zu shards exported in place (%zu bytes in "
            "%zu allocations, 0 copied), %zu bound (%zu bytes copied); window %zu bytes (%.1f "
            "MiB)%s",
            short_id(comm_), gathers, m.exported_shards, m.exported_bytes, m.exported_allocations,
            m.bound_shards, m.bound_bytes, window, static_cast<double>(window) / (1 << 20), where);
  // One line per reason (the trace's windows table says the same), each with its count.
  for (const ce::WindowMemory::Refusal& r : m.refusals)
    MAGI_INFO(Transport,
              "comm %012llx: static weights: %zu shards (%zu bytes; the first: gather %lld of the "
              "plan) cannot be read in place (%s); bound instead",
              short_id(comm_), r.shards, r.bytes, static_cast<long long>(r.first), r.why.c_str());
}

void AgreementLog::set_up_done(const ce::WindowMemory& m, double set_up_ms, bool in_background) {
  if (!std::exchange(set_up_unsaid_, false)) return;
  const char* where = in_background ? "off the program's calls" : "at the call";
  if (m.peer_mappings != 0)
    MAGI_INFO(Transport,
              "comm %012llx: static weights: mapped %zu allocations of the peers (set-up %.1f ms, "
              "%s)",
              short_id(comm_), m.peer_mappings, set_up_ms, where);
  else if (in_background)
    MAGI_INFO(Transport, "comm %012llx: opened the peers' windows (set-up %.1f ms, %s)",
              short_id(comm_), set_up_ms, where);
}

void AgreementLog::cannot_open_windows(const std::string& error) const {
  MAGI_WARN(Transport, "comm %012llx: cannot open the peers' windows: %s; everything stays on NCCL",
            short_id(comm_), error.empty() ? "no window" : error.c_str());
}

void AgreementLog::binding_changed(uint32_t round) const {
  MAGI_INFO(Transport,
            "comm %012llx round %u: static weights: a gather's send buffer changed while the "
            "plan was committed; this rank does not confirm it",
            short_id(comm_), round);
}

void AgreementLog::cannot_serve(uint32_t round, Reason why) const {
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: not every rank can serve the plan (%s); everything stays on "
            "NCCL",
            short_id(comm_), round, named(why).c_str());
}

void AgreementLog::not_confirmed(uint32_t round, Reason why) const {
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: the commit was not confirmed by every rank (%s); everything "
            "stays on NCCL",
            short_id(comm_), round, named(why).c_str());
}

void AgreementLog::activated(uint32_t round, bool dry, const Decision& d, uint64_t seq,
                             bool graph_slots) const {
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: %s %u of %zu gathers per step from collective #%llu (%s%s)",
            short_id(comm_), round, dry ? "would move" : "moving", d.moved, d.gathers.size(),
            static_cast<unsigned long long>(seq), std::string(trace::mode_name(d.mode)).c_str(),
            graph_slots ? "; graph slots" : "");
}

void AgreementLog::say_other_source(uint32_t position) const {
  MAGI_INFO(Transport,
            "comm %012llx: static weights: the gather at position %u sends a buffer bound for "
            "another position; it reads that binding on every peer (exact when every rank made "
            "the same change; counted)",
            short_id(comm_), position);
}

void AgreementLog::deactivated(uint64_t seq, Reason why) {
  if (other_source_calls_ != 0)
    MAGI_INFO(Transport,
              "comm %012llx: static weights: %llu moved calls read another position's binding "
              "(their send buffer's) during this plan",
              short_id(comm_), static_cast<unsigned long long>(other_source_calls_));
  other_source_calls_ = 0;
  MAGI_INFO(Rewrite, "comm %012llx: gathers back on NCCL from collective #%llu (%s)",
            short_id(comm_), static_cast<unsigned long long>(seq),
            why == Reason::None ? "a new plan replaces this one" : named(why).c_str());
}

void AgreementLog::costs_kept(uint32_t round, uint32_t moved) const {
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: timed both ways, every moved bucket was as fast or faster off "
            "NCCL: %u gathers keep moving",
            short_id(comm_), round, moved);
}

void AgreementLog::costs_changed(uint32_t round, uint32_t moved, size_t gathers) const {
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: timed both ways: %u of %zu gathers keep moving, the rest were "
            "faster on NCCL",
            short_id(comm_), round, moved, gathers);
}

}  // namespace magi::rewrite
