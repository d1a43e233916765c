#!/usr/bin/env bash
# The shim's added cost per call over the real NCCL (needs a GPU), per configuration, each its own
# process (options are read once), pinned to one CPU.
#   tools/bench/run-nccl-bench.sh BUILD_DIR [LIBNCCL]
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
nccl=${2:-$(ldconfig -p | awk '/libnccl\.so\.2 /{print $NF; exit}')}
[ -n "$nccl" ] || { echo "run-nccl-bench: no libnccl.so.2 found; pass its path" >&2; exit 2; }
trace_dir=$(mktemp -d)
trap 'rm -rf "$trace_dir"' EXIT
run() {  # label, op, env...
  local label=$1 op=$2; shift 2
  printf '%-30s ' "$label"
  env "$@" taskset -c "${BENCH_CPU:-0}" "$build/magice-nccl-bench" --nccl "$nccl" \
    --shim "$build/libmagice.so" --op "$op"
}
echo "Added cost per call over the real NCCL ($nccl)"
run "call sites off, no trace" allreduce MAGI_CALLSITES=0
run "call sites on, no trace" allreduce MAGI_CALLSITES=1
run "call sites on, tracing" allreduce MAGI_CALLSITES=1 MAGI_TRACE_DIR="$trace_dir"
# A 1-rank all-gather would be moved off NCCL once agreed: MAGI_DRY_RUN=1 keeps it on NCCL while
# the agreement watches it, decides and reports, which is what passing it through costs.
run "call sites off, dry run" allgather MAGI_CALLSITES=0 MAGI_DRY_RUN=1
run "call sites on, dry run" allgather MAGI_CALLSITES=1 MAGI_DRY_RUN=1
# The flight recorder, and its completion by CUDA events (cuStreamGetCtx and two cuEventRecord
# per call). NCCL launches nothing for this call, so each event is done at once; but the poller
# hands events back only every millisecond, so calls beyond 512 in that millisecond find the
# pool empty and go unwatched (cheaper): the figure of a watched call is the one with calls
# spaced by at least 2 us, as real collectives are.
run "call sites off, recorder 1024" allreduce MAGI_CALLSITES=0 MAGI_FLIGHT_RECORDER=1024 \
  MAGI_FLIGHT_RECORDER_DIR="$trace_dir"
run "call sites off, + completion" allreduce MAGI_CALLSITES=0 MAGI_FLIGHT_RECORDER=1024 \
  MAGI_FLIGHT_RECORDER_DIR="$trace_dir" MAGI_FLIGHT_RECORDER_COMPLETION=1
