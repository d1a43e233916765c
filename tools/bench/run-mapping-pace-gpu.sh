#!/usr/bin/env bash
# How to pace the reader's half of a static-weights set-up (BENCHMARKS.md, "Pacing the mappings"):
# magice-mapping-pace under each pacing and thread count, REPS times each, with the ranks as MPS
# clients and then (NO_MPS=1) without MPS.
# Usage: [PAUSES="none ratio:1 ..."] [THREADS="1 2 4"] [GATES="0 1"] [CONCURRENT="0 2 4"] [REPS=1] [NO_MPS=1] \
#        tools/bench/run-mapping-pace-gpu.sh BUILD_DIR [RANKS] [ALLOCATIONS] [MIB]
set -u
build=$(cd "${1:?usage: $0 BUILD_DIR [RANKS] [ALLOCATIONS] [MIB]}" && pwd)
ranks=${2:-8} allocations=${3:-500} mib=${4:-2}
pauses=${PAUSES:-none ratio:1 ratio:0.5 ratio:0.25 fixed:20} threads_list=${THREADS:-1 2 4}
bench="$build/magice-mapping-pace"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sweep() {
  local pause threads gate concurrent rep
  for threads in $threads_list; do
    for gate in ${GATES:-0}; do
      for concurrent in ${CONCURRENT:-0}; do
        for pause in $pauses; do
          for rep in $(seq "${REPS:-1}"); do
            timeout 120 "$bench" --ranks "$ranks" --allocations "$allocations" --mib "$mib" \
              --pause "$pause" --threads "$threads" --gate "$gate" --concurrent "$concurrent" \
              2>"$work/last.err" || { echo "failed: pause $pause threads $threads gate $gate" \
              "concurrent $concurrent"; tail -3 "$work/last.err"; }
          done
        done
      done
    done
  done
}
if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  export CUDA_MPS_PIPE_DIRECTORY=$work/mps-pipe CUDA_MPS_LOG_DIRECTORY=$work/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if timeout 20 nvidia-cuda-mps-control -d; then
    echo "## MPS clients"
    sweep
    echo quit | timeout 20 nvidia-cuda-mps-control >/dev/null
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
[ "${NO_MPS:-1}" = 1 ] || exit 0
echo "## without MPS (the ranks time-slice the GPU)"
sweep
