#!/usr/bin/env bash
# The all-gather benchmark at world size 1 on a GPU with the real NCCL: nccl-tests' sizes (4 KiB
# to 256 MiB by 4), device memory, the library with its defaults, plain NCCL against the library
# in ROUNDS interleaved rounds; then the FSDP-like pool program. Builds nothing: it runs from a
# build directory made elsewhere and carried (libmagice.so, libunwind.so.8, magice-trace and the
# libraries beside it, magice-allgather-bench, tests/support/magi-launch).
#   tools/bench/run-allgather-bench-gpu.sh [BUILD_DIR] [NCCL_LIBRARY_DIR]
#   env: ROUNDS (7) MAX (256M) ITERS (40) KEEP (a directory for every launch's output)
# NCCL: the directory given, else the loader's (ldconfig), else the one PyTorch's wheel ships.
set -euo pipefail
build=${1:-build}
here=$(cd "$(dirname "$0")" && pwd)
nccl=${2:-}
if [ -z "$nccl" ]; then
  if ldconfig -p | grep -q 'libnccl\.so\.2 '; then
    nccl=system
  else
    nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' \
      2>/dev/null) || { echo "run-allgather-bench-gpu: no libnccl.so.2 found; pass its directory" >&2; exit 2; }
  fi
fi
keep=()
[ -n "${KEEP:-}" ] && keep=(--keep "$KEEP")
exec python3 "$here/allgather_bench.py" "$build" --nccl "$nccl" --memory device --ranks 1 \
  --rounds "${ROUNDS:-7}" --perf "-b 4K -e ${MAX:-256M} -f 4 -n ${ITERS:-40} -w 1" \
  --fsdp "--layers 10 --block-kib 4096 --steps 64 --frames 3" "${keep[@]}"
