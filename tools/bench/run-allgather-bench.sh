#!/usr/bin/env bash
# make bench's all-gather part, on the CPU: the nccl-tests-like loop and the FSDP-like pool
# program over the NCCL stand-in (host memory, MAGI_BACKEND=host MAGI_CE_FORCE=1) at 1, 2, 4 and
# 8 ranks, plain NCCL against the library, interleaved (tools/bench/allgather_bench.py). One rank
# is the quiet case: every call is this process's own host work, so the library's added cost
# shows there best. Sizes stop at 16 MiB here (MAX): on two shared cores 8 ranks copy every byte
# several times.
#   tools/bench/run-allgather-bench.sh [BUILD_DIR]
#   env: RANKS (1,2,4,8) ROUNDS (5) MAX (16M) ITERS (40) KEEP (a directory for every launch's output)
set -euo pipefail
build=${1:-build}
here=$(cd "$(dirname "$0")" && pwd)
keep=()
[ -n "${KEEP:-}" ] && keep=(--keep "$KEEP")
exec python3 "$here/allgather_bench.py" "$build" --nccl standin --ranks "${RANKS:-1,2,4,8}" \
  --rounds "${ROUNDS:-5}" --perf "-b 4K -e ${MAX:-16M} -f 4 -n ${ITERS:-40} -w 1" \
  --fsdp "--layers 10 --block-kib 64 --steps 64 --frames 3" "${keep[@]}"
