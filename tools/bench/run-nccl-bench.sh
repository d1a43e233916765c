#!/usr/bin/env bash
# The shim's added cost per call over the real NCCL (needs a GPU), per configuration, each its own
# process (options are read once), pinned to one CPU. A process measures the direct and the shim
# call interleaved, so its "added" figure is relative; between processes a shared host still
# drifts by tens of ns, so the configurations run in ROUNDS rounds (default 3), one after
# another in each round, and the median of each configuration's rounds closes the output.
#   tools/bench/run-nccl-bench.sh BUILD_DIR [LIBNCCL]
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
nccl=${2:-$(ldconfig -p | awk '/libnccl\.so\.2 /{print $NF; exit}')}
[ -n "$nccl" ] || { echo "run-nccl-bench: no libnccl.so.2 found; pass its path" >&2; exit 2; }
rounds=${ROUNDS:-3}
trace_dir=$(mktemp -d)
results=$(mktemp)
trap 'rm -rf "$trace_dir" "$results"' EXIT
run() {  # label, op, env... (bench options in $spaced)
  local label=$1 op=$2 line
  shift 2
  # shellcheck disable=SC2086  # $spaced is a list of options
  line=$(env "$@" taskset -c "${BENCH_CPU:-0}" "$build/magice-nccl-bench" --nccl "$nccl" \
    --shim "$build/libmagice.so" --op "$op" $spaced)
  printf '%-34s %s\n' "$label" "$line"
  printf '%s\t%s\n' "$label" "$(sed -n 's/.*added \([-0-9.]*\) ns.*/\1/p' <<<"$line")" >>"$results"
}
spaced=""
recorder=(MAGI_FLIGHT_RECORDER=1024 MAGI_FLIGHT_RECORDER_DIR="$trace_dir")
echo "Added cost per call over the real NCCL ($nccl), $rounds rounds"
for round in $(seq 1 "$rounds"); do
  echo "round $round"
  run "call sites off, no trace" allreduce MAGI_CALLSITES=0
  run "call sites on, no trace" allreduce MAGI_CALLSITES=1
  run "call sites on, tracing" allreduce MAGI_CALLSITES=1 MAGI_TRACE_DIR="$trace_dir"
  # The flight recorder (MAGI_FLIGHT_RECORDER): its cost is the difference with the rows above.
  run "call sites off, recorder" allreduce MAGI_CALLSITES=0 "${recorder[@]}"
  run "call sites on, recorder" allreduce MAGI_CALLSITES=1 "${recorder[@]}"
  run "every call's site, recorder" allreduce MAGI_CALLSITES=2 "${recorder[@]}"
  # Completion by CUDA events (cuStreamGetCtx, two cuEventRecord and the capture query per
  # call) needs calls spaced as real collectives are: its poller gives events back once a
  # millisecond, and back to back calls would empty the pool and go unwatched (and cheaper).
  spaced="--spacing-ns 4000 --calls 5000"
  run "call sites on, recorder, 4 us apart" allreduce MAGI_CALLSITES=1 "${recorder[@]}"
  run "  + completion, 4 us apart" allreduce MAGI_CALLSITES=1 "${recorder[@]}" \
    MAGI_FLIGHT_RECORDER_COMPLETION=1
  spaced=""
  # A 1-rank communicator never explores (its all-gather is one local copy): with the defaults an
  # all-gather passes straight through. MAGI_CE_FORCE=1 explores it anyway, and MAGI_DRY_RUN=1
  # keeps it on NCCL while the agreement watches it, decides and reports: what watching a
  # gather costs where a communicator may explore.
  run "all-gather, defaults" allgather
  run "all-gather, call sites off" allgather MAGI_CALLSITES=0
  run "all-gather watched (forced, dry run)" allgather MAGI_CE_FORCE=1 MAGI_DRY_RUN=1
done
echo "median added ns over $rounds rounds"
cut -f1 "$results" | awk '!seen[$0]++' | while IFS= read -r label; do
  awk -F'\t' -v l="$label" '$1 == l {print $2}' "$results" | sort -g |
    awk -v l="$label" '{a[NR] = $1} END {printf "  %-34s %7.1f\n", l, a[int((NR + 1) / 2)]}'
done
