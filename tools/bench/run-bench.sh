#!/usr/bin/env bash
# make bench: the shim's added cost per intercepted call, in pass-through, per configuration.
# Each configuration is its own process (options are read once). Repetitions of the direct and
# the shimmed call are randomly interleaved, on one pinned CPU, so a noisy neighbour hits both
# alike. Reports medians of 15 repetitions and the difference shim - direct.
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
trace_dir=$(mktemp -d)
trap 'rm -rf "$trace_dir"' EXIT
run() {  # label, env...
  local label=$1; shift
  env "$@" taskset -c "${BENCH_CPU:-0}" "$build/magice-bench" --standin "$build/tests/support/libnccl.so.2" --shim "$build/libmagice.so" \
    --benchmark_repetitions=15 --benchmark_min_time=0.2 --benchmark_report_aggregates_only=true \
    --benchmark_enable_random_interleaving=true \
    --benchmark_format=csv 2>/dev/null |
  awk -F, -v label="$label" '
    /_median"?,/ { gsub(/"/, "", $1); t[$1] = $3 }
    END {
      d = t["BM_DirectAllReduce_median"]; s = t["BM_ShimAllReduce_median"];
      printf "%-34s direct %7.1f ns   shim %7.1f ns   added %6.1f ns\n", label, d, s, s - d
    }'
}
echo "Added cost per intercepted call (median of 15 repetitions; stand-in ncclAllReduce, 1 float, 1 rank)"
run "call sites off, no trace"         MAGI_CALLSITES=0
run "call sites on (depth 16), no trace" MAGI_CALLSITES=1
run "call sites on, tracing"           MAGI_CALLSITES=1 MAGI_TRACE_DIR="$trace_dir"
run "call sites off, flight recorder 1024" MAGI_CALLSITES=0 MAGI_FLIGHT_RECORDER=1024 \
  MAGI_FLIGHT_RECORDER_DIR="$trace_dir"
run "call sites on, flight recorder 1024" MAGI_CALLSITES=1 MAGI_FLIGHT_RECORDER=1024 \
  MAGI_FLIGHT_RECORDER_DIR="$trace_dir"
run "call sites off, recorder + completion" MAGI_CALLSITES=0 MAGI_FLIGHT_RECORDER=1024 \
  MAGI_FLIGHT_RECORDER_COMPLETION=1 MAGI_FLIGHT_RECORDER_DIR="$trace_dir"
