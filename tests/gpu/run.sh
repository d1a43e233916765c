#!/usr/bin/env bash
# make gpu-test: everything that needs a GPU. Prints one closing line "gpu-tests: N passed, M failed".
# Usage: tests/gpu/run.sh BUILD_DIR
set -u
build=$(cd "${1:-build}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0; failed=0
pass() { echo "PASS $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; failed=$((failed + 1)); }

[ -f "$build/libmagice.so" ] || { echo "no $build/libmagice.so: run make first"; exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)

# 1. PyTorch at world size 1: the same bytes with and without the shim, and the trace shows the calls.
if python3 "$here/torch_collectives.py" "$work/plain.pt" >"$work/plain.log" 2>&1; then
  mkdir -p "$work/trace"
  if LD_PRELOAD="$build/libmagice.so" MAGI_TRACE_DIR="$work/trace" MAGI_LOG=INFO \
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL \
      python3 "$here/torch_collectives.py" "$work/shim.pt" >"$work/shim.log" 2>&1; then
    pass "torch collectives run under the shim"
    grep " MAGI " "$work/shim.log" | head -5
  else
    fail "torch collectives run under the shim"; tail -20 "$work/shim.log"
  fi
  if python3 "$here/compare_results.py" "$work/plain.pt" "$work/shim.pt"; then
    pass "results bitwise equal with and without the shim"
  else
    fail "results bitwise equal with and without the shim"
  fi
  # The trace must hold exactly the collectives NCCL itself logged (NCCL_DEBUG_SUBSYS=COLL):
  # PyTorch turns some calls at world size 1 into local copies, so compare with NCCL, not torch.
  trace=$(ls "$work"/trace/*.trace 2>/dev/null | head -1)
  if [ -n "$trace" ] && "$build/magice-trace" dump "$trace" >"$work/dump.txt" 2>&1; then
    sed -n 's/.*NCCL INFO \([A-Za-z]*\): opCount.*/\1/p' "$work/shim.log" | sort | uniq -c >"$work/nccl-ops.txt"
    awk 'length($1) == 12 && $1 ~ /^[0-9a-f]+$/ && $2 ~ /^[0-9]+$/ {print $3}' "$work/dump.txt" | sort | uniq -c >"$work/trace-ops.txt"
    echo "NCCL's own log:  $(tr -s ' \n' ' ' <"$work/nccl-ops.txt")"
    echo "magice's trace:  $(tr -s ' \n' ' ' <"$work/trace-ops.txt")"
    if [ -s "$work/trace-ops.txt" ] && cmp -s "$work/nccl-ops.txt" "$work/trace-ops.txt"; then
      pass "trace holds every collective NCCL ran, op by op"
    else
      fail "trace holds every collective NCCL ran, op by op"
    fi
    "$build/magice-trace" skeleton "$trace" | head -12
  else
    fail "trace written and readable"; tail -5 "$work/dump.txt" 2>/dev/null
  fi
else
  fail "torch collectives run without the shim (environment problem)"; tail -20 "$work/plain.log"
fi

echo "gpu-tests: $passed passed, $failed failed"
[ "$failed" = 0 ]
