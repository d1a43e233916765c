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
  trace=$(ls "$work"/trace/*.trace 2>/dev/null | head -1)
  if [ -n "$trace" ] && "$build/magice-trace" dump "$trace" >"$work/dump.txt" 2>&1; then
    ok=1
    for op in AllGather AllReduce ReduceScatter Broadcast; do
      grep -q "$op" "$work/dump.txt" || { echo "trace lacks $op"; ok=0; }
    done
    [ "$ok" = 1 ] && pass "trace shows AllGather, AllReduce, ReduceScatter, Broadcast" \
                  || fail "trace shows AllGather, AllReduce, ReduceScatter, Broadcast"
    echo "calls recorded: $(grep -cE 'AllGather|AllReduce|ReduceScatter|Broadcast' "$work/dump.txt")"
    "$build/magice-trace" skeleton "$trace" | head -12
  else
    fail "trace written and readable"; cat "$work/dump.txt" 2>/dev/null | tail -5
  fi
else
  fail "torch collectives run without the shim (environment problem)"; tail -20 "$work/plain.log"
fi

echo "gpu-tests: $passed passed, $failed failed"
[ "$failed" = 0 ]
