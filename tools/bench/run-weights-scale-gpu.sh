#!/usr/bin/env bash
# Static weights at scale on one GPU (BENCHMARKS.md, "Static weights at scale"): N ranks of the
# weights workload as MPS clients over the NCCL stand-in, every shard its own cudaMalloc, run once
# plain and once under the library (MAGI_STATIC_WEIGHTS=1 MAGI_CE_FORCE=1). Prints, per shape,
# what the library said of the set-up (exports, mappings, where and how long) and each run's
# slowest gather call, gathers moved and device memory taken.
# Usage: [STEPS=30] [PLAIN=1] [MIXED=0] [CHECK_EVERY=1] [RECV_BUFFERS=0] [WORK_DIR=DIR] \
#        tools/bench/run-weights-scale-gpu.sh BUILD_DIR [RANKSxALLOCATIONSxKIB ...]
#   default shapes: 4x256x4096 8x1000x64 8x128x4096; PLAIN=0 skips the runs without the library;
#   MIXED=1: shards of 1 to 32 times KIB, 4 times on average (the workload's --mixed 1);
#   CHECK_EVERY=K checks the received bytes every K-th step and the last; RECV_BUFFERS=N gathers
#   into N buffers taken in turn. The issue's proof, 8 ranks of 1,000 allocations of 2 to 64 MiB
#   (8 GiB a rank): MIXED=1 CHECK_EVERY=16 RECV_BUFFERS=2 PLAIN=0 STEPS=12 ... 8x1000x2048
#   (on the stand-in a step of those 1,000 gathers takes ~25 s on NCCL's path; the gathers move
#   at step 10, so the run needs most of a 10-minute device call)
set -u
build=$(cd "${1:?usage: $0 BUILD_DIR [RANKSxALLOCATIONSxKIB ...]}" && pwd)
shift
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(4x256x4096 8x1000x64 8x128x4096)
launch="$build/tests/support/magi-launch"
workload="$build/tests/support/magi-workload"
# WORK_DIR=DIR keeps each run's log in DIR (a run cut short by a timeout still leaves its log).
work=${WORK_DIR:-$(mktemp -d)}
mkdir -p "$work"
mps=0
stop_mps() { [ "$mps" = 1 ] && echo quit | timeout 20 nvidia-cuda-mps-control >/dev/null; }
trap 'stop_mps; [ -n "${WORK_DIR:-}" ] || rm -rf "$work"' EXIT
# The stand-in stages each device gather through host memory: pinned blocks kept from call to
# call (STANDIN_PINNED_STAGING=1) instead of fresh pageable memory, for steps of many GiB.
export STANDIN_TIMEOUT_S=120 STANDIN_PINNED_STAGING=${STANDIN_PINNED_STAGING:-1}
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=$work/mps-pipe CUDA_MPS_LOG_DIRECTORY=$work/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  timeout 20 nvidia-cuda-mps-control -d && mps=1
fi
[ "$mps" = 1 ] || echo "note: no MPS daemon: the ranks time-slice the GPU"

# run NAME N ALLOCATIONS KIB PRELOAD: one launch; its log in $work/NAME.log.
run() {
  local name=$1 n=$2 allocations=$3 kib=$4 preload=$5 envs=()
  [ "$preload" = 1 ] && envs=(--env LD_PRELOAD="$build/libmagice.so" --env MAGI_LOG=INFO
    --env MAGI_STATIC_WEIGHTS=1 --env MAGI_CE_FORCE=1 --env MAGI_LOG_SUBSYS=REWRITE,TRANSPORT)
  "$launch" -n "$n" --timeout 580 "${envs[@]}" -- "$workload" weights --device 1 --arena 1 \
    --arenas "$allocations" --layers "$allocations" --steps "${STEPS:-30}" --program swap \
    --swap-step 100000 --shard-elements $((kib * 256)) --report-slowest 1 --report-memory 1 \
    --mixed "${MIXED:-0}" --check-every "${CHECK_EVERY:-1}" --recv-buffers "${RECV_BUFFERS:-0}" \
    >"$work/$name.log" 2>&1
  echo "$name: launcher exit $?"
}

summary() {
  local log=$1
  grep -E "exported in place|cannot be read in place|mapped [0-9]+ allocations|served off NCCL" \
    "$log" | sed -E 's/^[^[]*//; s/^/    /' | head -n 40
  sed -nE 's/.*slowest gather call: ([0-9.]+) us \(step ([0-9]+)\).*/\1 \2/p' "$log" | sort -n |
    awk '{v = v sprintf(" %.2f ms (step %s)", $1 / 1000, $2)} END {print "    slowest gather call of each rank:" v}'
  local before after
  before=$(sed -nE 's/.*device memory free before: ([0-9]+).*/\1/p' "$log" | head -n 1)
  after=$(sed -nE 's/.*device memory free after: ([0-9]+).*/\1/p' "$log" | head -n 1)
  [ -n "$before" ] && [ -n "$after" ] &&
    awk -v b="$before" -v a="$after" 'BEGIN {printf "    device memory taken by the job: %.1f MiB\n", (b - a) / 1048576}'
}

for shape in "${shapes[@]}"; do
  IFS=x read -r n allocations kib <<<"$shape"
  echo "== $n ranks x $allocations allocations of $kib KiB (steps ${STEPS:-30})"
  if [ "${PLAIN:-1}" = 1 ]; then
    run "plain-$shape" "$n" "$allocations" "$kib" 0
    summary "$work/plain-$shape.log"
  fi
  run "library-$shape" "$n" "$allocations" "$kib" 1
  summary "$work/library-$shape.log"
  grep -v " MAGI INFO " "$work/library-$shape.log" | grep -E "WARN|error|FAIL" | head -n 5
done
