// Which bytes a static binding's check compares (both backends). Private to ce_transport/.
//
// A check never compares a whole shard: at 1 GiB that is two shard-sized copies to the host on
// the program's stream (40 ms). It compares lines of kLine bytes of the shard with the same lines
// of its binding. For a shard of B bytes:
//  - L = min(kMaxLines, ceil(B / kLine)) lines per set, at stride S = ceil(B / L) rounded up to
//    kLine (so L·S >= B); line i of a set lies at phase + i·S, clipped at B: the last line may be
//    short, and lines past B are empty. A set is at most kMaxSetBytes (64 KiB), and is one strided
//    copy for the CUDA backend (pitch S, width kLine, height: its full lines) plus one for a
//    short line.
//  - The anchor set (phase 0) is compared at every check: a bulk rewrite (an optimizer step, a
//    reload) touches it, and is caught at the next check.
//  - The sweep set of the binding's k-th check (k from 0) is at phase (k mod P)·kLine, P = S /
//    kLine: any P consecutive checks compare every byte of the shard once. So a rewrite that
//    touches an anchor line is caught at the next check, and any other rewrite (down to one byte)
//    within P checks. At phase 0 the sweep is the anchor itself and is not compared twice.
//    (The CUDA backend compares a check at a later call, once its copies have run: a change is
//    reported there.)
// Per check, anchor and sweep compare (the CUDA backend copies that many bytes of the shard, and
// as many of the binding, to pinned host memory; half of it when the sweep is the anchor):
//   shard        compared         P (checks that cover the shard)
//   <= 64 KiB    the whole shard  1
//   1 MiB        128 KiB          16
//   16 MiB       128 KiB          256
//   256 MiB      128 KiB          4096
//   1 GiB        128 KiB          16384
// Checks run on a binding's first calls and every MAGI_VERIFY_EVERY calls (verify_schedule.h).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace magi::ce {

// One set: `rows` full lines at first, first + stride, ..., then, where the shard ends inside the
// next line, one short line of `tail_bytes` right after them.
struct SampleSet {
  static constexpr size_t kLine = 256;
  size_t first = 0;
  size_t stride = kLine;
  size_t rows = 0;
  size_t tail_bytes = 0;

  size_t lines() const { return rows + (tail_bytes != 0 ? 1 : 0); }
  size_t offset(size_t line) const { return first + line * stride; }
  size_t line_bytes(size_t line) const { return line < rows ? kLine : tail_bytes; }
  size_t bytes() const { return rows * kLine + tail_bytes; }
};

class SamplePlan {
 public:
  static constexpr size_t kLine = SampleSet::kLine;
  static constexpr size_t kMaxLines = 256;
  static constexpr size_t kMaxSetBytes = kLine * kMaxLines;

  explicit SamplePlan(size_t shard_bytes)
      : bytes_(shard_bytes),
        lines_(std::min(kMaxLines, ceil_div(shard_bytes, kLine))),
        stride_(lines_ == 0 ? kLine : ceil_div(ceil_div(shard_bytes, lines_), kLine) * kLine) {}

  size_t lines() const { return lines_; }
  size_t stride() const { return stride_; }
  // P: checks after which every byte of the shard was compared (by the sweep) at least once.
  uint64_t sweep_period() const { return stride_ / kLine; }

  SampleSet anchor() const { return at_phase(0); }
  // The sweep set of the binding's `ordinal`-th check (from 0); first == 0: the anchor itself.
  SampleSet sweep(uint64_t ordinal) const {
    return at_phase(static_cast<size_t>(ordinal % sweep_period()) * kLine);
  }

 private:
  static constexpr size_t ceil_div(size_t a, size_t b) { return a / b + (a % b != 0 ? 1 : 0); }

  SampleSet at_phase(size_t phase) const {
    SampleSet set;
    set.first = phase;
    set.stride = stride_;
    if (phase >= bytes_) return set;
    // Full lines: those with phase + i·S + kLine <= B, i < L.
    set.rows =
        bytes_ - phase < kLine ? 0 : std::min(lines_, (bytes_ - phase - kLine) / stride_ + 1);
    if (set.rows < lines_) {
      const size_t tail_at = set.offset(set.rows);
      if (tail_at < bytes_) set.tail_bytes = bytes_ - tail_at;  // < kLine: it is not a full line
    }
    return set;
  }

  size_t bytes_;
  size_t lines_;
  size_t stride_;
};

// Whether `a` and `b` (a shard and its binding) hold the same bytes on every line of `set`.
inline bool same_lines(const uint8_t* a, const uint8_t* b, const SampleSet& set) {
  for (size_t i = 0; i < set.lines(); ++i) {
    const size_t at = set.offset(i);
    if (std::memcmp(a + at, b + at, set.line_bytes(i)) != 0) return false;
  }
  return true;
}

}  // namespace magi::ce
