#!/usr/bin/env bash
# make gpu-test: everything that needs a GPU. Prints one closing line, its only verdict:
# "gpu-tests: N passed, M failed, K skipped" (tests/gpu/verdict.sh).
# Usage: tests/gpu/run.sh BUILD_DIR
# GPU_WORK=DIR keeps every run's log and traces in DIR (made if missing); else they go with a
# temporary directory at the end.
set -u
build=$(cd "${1:-build}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "${GPU_WORK:-}" ]; then
  work=$GPU_WORK
  mkdir -p "$work"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
# shellcheck source=tests/gpu/verdict.sh
. "$here/verdict.sh"

[ -f "$build/libmagice.so" ] || { echo "no $build/libmagice.so: run make first"; exit 2; }
# shellcheck source=tests/gpu/standin_runs.sh
. "$here/standin_runs.sh"
# shellcheck source=tests/gpu/graph_runs.sh
. "$here/graph_runs.sh"
# shellcheck source=tests/gpu/torch_standin_runs.sh
. "$here/torch_standin_runs.sh"
# shellcheck source=tests/gpu/capture_runs.sh
. "$here/capture_runs.sh"
# shellcheck source=tests/gpu/machines_runs.sh
. "$here/machines_runs.sh"
# GPU_ONLY=graphs: the CUDA-graph runs alone (graph_runs.sh), a few minutes; GPU_ONLY=graphs-mps:
# only those of several ranks under MPS (graph_standin_runs, capture_round_runs);
# GPU_ONLY=capture: the rounds at a capture alone (capture_runs.sh, perf_graph_runs too); GPU_ONLY=torch-standin: only
# PyTorch at world 2, 4 and 8 over the stand-in under MPS (torch_standin_runs.sh);
# GPU_ONLY=machines: communicators spanning machines under MPS (machines_runs.sh). Any other
# value selects nothing, and fails.
if [ -n "${GPU_ONLY:-}" ]; then
  export NCCL_NVLS_ENABLE=0
  echo "== CUDA graphs only (GPU_ONLY=$GPU_ONLY)"
  case $GPU_ONLY in
    graphs)
      graph_torch_runs
      graph_real_nccl_runs
      nccl_tests_capture_runs
      ;;
    graphs-mps | torch-standin | machines) ;;
    capture) nccl_tests_capture_runs ;;
    *) fail "GPU_ONLY=$GPU_ONLY selects nothing (graphs, graphs-mps, capture, torch-standin or machines)" ;;
  esac
  case $GPU_ONLY in
    graphs | graphs-mps | capture)
      if mps_start; then  # else it counted the skip
        [ "$GPU_ONLY" = capture ] || graph_standin_runs
        capture_round_runs
        perf_graph_runs
        mps_stop
      fi
      ;;
    torch-standin)
      if mps_start; then
        torch_standin_runs
        mps_stop
      fi
      ;;
    machines)
      if mps_start; then
        machines_runs
        mps_stop
      fi
      ;;
  esac
  closing_line gpu-tests
  exit
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)

# 1. PyTorch at world size 1: the same bytes with and without the shim, and the trace shows the calls.
# A communicator of one rank never explores (NCCL's all-gather there is one local copy):
# MAGI_CE_FORCE=1 makes it move anyway, so that the transport is exercised; 1a checks the default.
if python3 "$here/torch_collectives.py" "$work/plain.pt" >"$work/plain.log" 2>&1; then
  mkdir -p "$work/trace"
  if LD_PRELOAD="$build/libmagice.so" MAGI_TRACE_DIR="$work/trace" MAGI_LOG=INFO MAGI_CE_FORCE=1 \
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL \
      python3 "$here/torch_collectives.py" "$work/shim.pt" >"$work/shim.log" 2>&1; then
    pass "torch collectives run under the shim"
    grep " MAGI " "$work/shim.log" | grep -v "options:" | head -8
    grep "graph capture" "$work/shim.log"
    # A PyTorch that cannot capture fails alike without the shim (no "graph" results on either
    # side, so the rest still compares); one that captures only without it differs.
    grep -q "graph capture not available" "$work/plain.log" &&
      skip "torch collectives: the CUDA-graph replays ($(grep -m 1 "graph capture not available" "$work/plain.log"))"
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
    # Calls the shim served itself (marked "moved") never reached NCCL: they are counted apart.
    # The agreement rounds are all-gathers of the shim's own through NCCL: counted in, but for
    # those issued at a captured call (flag C), which went through the board, not NCCL.
    awk 'NR == FNR { if (length($1) == 12 && $2 ~ /^[0-9]+$/ && $3 ~ /^[A-Z]/ && $10 ~ /C/) cap[$1 " " $4] = 1; next }
         length($1) == 12 && $1 ~ /^[0-9a-f]+$/ && $2 ~ /^[0-9]+$/ && $3 ~ /^[A-Z]/ && $NF != "moved" {print $3}
         length($1) == 12 && $4 ~ /^(propose|publish|confirm|cost|hello)$/ && $5 == "issued" && !(($1 " " $6) in cap) {print "AllGather"}' \
      "$work/dump.txt" "$work/dump.txt" | sort | uniq -c >"$work/trace-ops.txt"
    moved=$(awk 'length($1) == 12 && $1 ~ /^[0-9a-f]+$/ && $2 ~ /^[0-9]+$/ && $3 ~ /^[A-Z]/ && $NF == "moved"' "$work/dump.txt" | wc -l)
    echo "moved off NCCL by the shim: $moved calls"
    if [ "$moved" -gt 0 ]; then pass "the shim moved PyTorch's gathers at world size 1"; else fail "the shim moved PyTorch's gathers at world size 1"; fi
    echo "NCCL's own log:  $(tr -s ' \n' ' ' <"$work/nccl-ops.txt")"
    echo "magice's trace:  $(tr -s ' \n' ' ' <"$work/trace-ops.txt")"
    if [ -s "$work/trace-ops.txt" ] && cmp -s "$work/nccl-ops.txt" "$work/trace-ops.txt"; then
      pass "trace holds every collective NCCL ran, op by op (the program's not moved, plus agreement rounds)"
    else
      fail "trace holds every collective NCCL ran, op by op (the program's not moved, plus agreement rounds)"
    fi
    "$build/magice-trace" skeleton "$trace" | head -12
    "$build/magice-trace" decisions "$trace" | head -8
  else
    fail "trace written and readable"; tail -5 "$work/dump.txt" 2>/dev/null
  fi
else
  fail "torch collectives run without the shim (environment problem)"; tail -20 "$work/plain.log"
fi

# 1a. The same program with the defaults: one rank, so no agreement round and nothing moved; the
# log says why, and the trace holds exactly the collectives NCCL ran.
if [ -s "$work/plain.pt" ]; then
  d="$work/defaults"
  mkdir -p "$d/trace"
  LD_PRELOAD="$build/libmagice.so" MAGI_TRACE_DIR="$d/trace" MAGI_LOG=INFO \
    python3 "$here/torch_collectives.py" "$d/out.pt" >"$d/log" 2>&1
  "$build/magice-trace" dump "$d"/trace/*.trace >"$d/dump.txt" 2>&1
  moved=$(awk 'length($1) == 12 && $2 ~ /^[0-9]+$/ && $3 ~ /^[A-Z]/ && $NF == "moved"' "$d/dump.txt" | wc -l)
  rounds=$(awk 'length($1) == 12 && $4 ~ /^(propose|publish|confirm|cost|hello)$/ && $5 == "issued"' "$d/dump.txt" | wc -l)
  if python3 "$here/compare_results.py" "$work/plain.pt" "$d/out.pt" >/dev/null &&
      grep -q "one rank: NCCL's all-gather is one local copy" "$d/log" &&
      [ "$moved" = 0 ] && [ "$rounds" = 0 ]; then
    pass "world size 1 with the defaults: bytes equal, no round, nothing moved, the log says why"
  else
    fail "world size 1 with the defaults: bytes equal, no round, nothing moved, the log says why ($moved moved, $rounds rounds)"
    grep " MAGI " "$d/log" | head -5
  fi
fi

# 1b. The same program with the flight recorder, its completion by CUDA events and Python call
# sites on (MAGI_PY_CALLSITES=1 and =2: PyTorch releases the GIL around its collectives, where
# only =2 walks): the bytes stay the same, the trace names a Python line of torch_collectives.py
# for the program's calls, and the recorder's files, read by magice-trace hang, show no hang and
# every collective completed on the GPU.
if [ -s "$work/plain.pt" ]; then
  for py in 1 2; do
    d="$work/py$py"
    mkdir -p "$d/trace" "$d/flight"
    if LD_PRELOAD="$build/libmagice.so" MAGI_TRACE_DIR="$d/trace" MAGI_FLIGHT_RECORDER=4096 \
        MAGI_FLIGHT_RECORDER_DIR="$d/flight" MAGI_PY_CALLSITES=$py MAGI_FLIGHT_RECORDER_COMPLETION=1 \
        python3 "$here/torch_collectives.py" "$d/out.pt" >"$d/log" 2>&1 &&
        python3 "$here/compare_results.py" "$work/plain.pt" "$d/out.pt" >/dev/null; then
      pass "torch collectives with the recorder and MAGI_PY_CALLSITES=$py: bytes equal"
    else
      fail "torch collectives with the recorder and MAGI_PY_CALLSITES=$py: bytes equal"
      tail -n 10 "$d/log"
    fi
    "$build/magice-trace" dump "$d"/trace/*.trace >"$d/dump.txt" 2>&1
    calls=$(awk 'length($1) == 12 && $1 ~ /^[0-9a-f]+$/ && $2 ~ /^[0-9]+$/ && $3 ~ /^[A-Z]/' "$d/dump.txt" | wc -l)
    named=$(awk 'length($1) == 12 && $1 ~ /^[0-9a-f]+$/ && $2 ~ /^[0-9]+$/ && $3 ~ /^[A-Z]/ && /torch_collectives\.py:[0-9]+ in /' "$d/dump.txt" | wc -l)
    echo "MAGI_PY_CALLSITES=$py: $named of $calls calls in the trace name their Python line"
    grep -o "torch_collectives\.py:[0-9]* in [A-Za-z_<>]*" "$d/dump.txt" | sort | uniq -c | head -n 6
    "$build/magice-trace" hang "$d"/flight/*.flight >"$d/hang.txt" 2>&1
    status=$?
    sed 's/^/  /' "$d/hang.txt" | head -n 6
    # Completed on the GPU: every collective, those captured into the CUDA graph too (watched at
    # each replay by host nodes). Were a captured one not watched, the report would name it so.
    line=$(grep -m 1 "^  rank 0: issued" "$d/hang.txt")
    issued=$(sed -n 's/.*issued \([0-9]*\), returned from \1,.*/\1/p' <<<"$line")
    done_=$(sed -n 's/.* completed \([0-9]*\) collectives.*/\1/p' <<<"$line")
    captured=$(sed -n 's/.*then \([0-9]*\) not watched (\1 captured into a CUDA graph).*/\1/p' <<<"$line")
    if [ "$status" = 0 ] && grep -q "no hang seen" "$d/hang.txt" && [ -n "$issued" ] &&
        [ -n "$done_" ] && [ "$done_" = "$issued" ] && [ -z "$captured" ]; then
      pass "MAGI_PY_CALLSITES=$py: magice-trace hang: no hang; $done_ of $issued collectives completed on the GPU, the captured ones at their replays"
    else
      fail "MAGI_PY_CALLSITES=$py: magice-trace hang: no hang, every collective completed on the GPU, the captured ones at their replays (exit $status: $line)"
    fi
  done
  if [ "$named" -gt 0 ] && [ "$named" = "$calls" ]; then
    pass "MAGI_PY_CALLSITES=2: every call of the trace names its Python line"
  else
    fail "MAGI_PY_CALLSITES=2: every call of the trace names its Python line ($named of $calls)"
  fi
fi

# 1c. The installed prefix: build/ installed by tools/install/install.sh (what make install runs; it
# copies, builds nothing), then PyTorch under the prefix's library and the prefix's magice-trace.
# A GPU node lacks libunwind and libdw: they run only if the prefix carries what they need. A
# library that cannot be preloaded is only skipped by the loader, so the trace must exist too.
prefix="$work/prefix"
echo "== the installed prefix"
ldconfig -p 2>/dev/null | grep -E "(libunwind\.so\.8|libdw\.so\.1|libelf\.so\.1|libbz2\.so\.1\.0) " |
  sed 's/^[[:space:]]*/this machine has its own: /'
if ! DESTDIR='' "$here/../../tools/install/install.sh" "$build" "$prefix" >"$work/install.log" 2>&1; then
  fail "install.sh installs $build into a prefix"; cat "$work/install.log"
else
  ldd "$prefix/lib/libmagice.so" "$prefix/bin/magice-trace" >"$work/ldd.txt" 2>&1
  grep -F "$prefix/" "$work/ldd.txt" | sed 's/^[[:space:]]*/  /; s/ (0x[0-9a-f]*)$//'
  if grep -q "not found" "$work/ldd.txt"; then
    fail "the prefix's library and tool find every library they need (ldd)"; grep "not found" "$work/ldd.txt"
  else
    pass "the prefix's library and tool find every library they need (ldd)"
  fi
  if "$prefix/bin/magice-trace" --help >"$work/help.txt" 2>&1 && grep -q "^usage: magice-trace" "$work/help.txt"; then
    pass "the prefix's magice-trace --help"
  else
    fail "the prefix's magice-trace --help"; head -5 "$work/help.txt"
  fi
  if [ -s "$work/plain.pt" ]; then
    d="$work/installed"
    mkdir -p "$d/trace"
    if LD_PRELOAD="$prefix/lib/libmagice.so" MAGI_TRACE_DIR="$d/trace" \
        python3 "$here/torch_collectives.py" "$d/out.pt" >"$d/log" 2>&1 &&
        python3 "$here/compare_results.py" "$work/plain.pt" "$d/out.pt" >/dev/null; then
      pass "torch collectives under the prefix's library: bytes equal"
    else
      fail "torch collectives under the prefix's library: bytes equal"; tail -n 10 "$d/log"
    fi
    grep -i "cannot be preloaded" "$d/log"
    trace=$(find "$d/trace" -name "*.trace" 2>/dev/null | head -1)
    calls=0
    if [ -n "$trace" ] && "$prefix/bin/magice-trace" dump "$trace" >"$d/dump.txt" 2>&1; then
      calls=$(awk 'length($1) == 12 && $1 ~ /^[0-9a-f]+$/ && $2 ~ /^[0-9]+$/ && $3 ~ /^[A-Z]/' "$d/dump.txt" | wc -l)
    fi
    if [ "$calls" -gt 0 ]; then
      pass "the prefix's library wrote a trace the prefix's magice-trace dumps ($calls calls)"
    else
      fail "the prefix's library wrote a trace the prefix's magice-trace dumps"; tail -n 5 "$d/dump.txt" 2>/dev/null
    fi
  else
    fail "torch collectives under the prefix's library: no run without the shim to compare with"
  fi
fi

# 1c. CUDA graphs at world size 1 (graph_runs.sh): a step captured with torch.cuda.graph, and the
# weights program's step captured as nccl-tests -G does, both over the real NCCL and replayed;
# the captured gathers move with static weights and stay on NCCL in the default mode.
echo "== CUDA graphs, PyTorch at world size 1"
graph_torch_runs
echo "== CUDA graphs, the weights program over the real NCCL at world size 1"
graph_real_nccl_runs
echo "== nccl-tests -G at world size 1: gathers agreed at the capture"
nccl_tests_capture_runs

# 2. Multi-process on one GPU with the stand-in. Real NCCL refuses two ranks on one GPU, so these
# runs use the NCCL stand-in (tests/support/standin), which stages device memory through host
# memory. Every rank checks every byte it receives; the shim must leave them right whatever its
# agreement decides, and its traces must read back with the same verdict on every rank.
if [ "$gpus" -lt 1 ]; then
  fail "multi-process on one GPU with the stand-in: no GPU (nvidia-smi -L lists none)"
elif ! standin_programs_present; then
  fail "multi-process on one GPU with the stand-in: programs missing in $build/tests/support"
else
  echo "== multi-process on one GPU with the stand-in"
  for n in 2 4 8; do
    standin_run "fsdp-$n" "$n" -- fsdp --device 1 --layers 6 --steps 24 --rewrite 1
  done
  for seed in $(seq 1 20); do
    standin_run "agree-seed-$seed" $((2 + seed % 7)) -- agree --device 1 --seed "$seed" --steps 16 \
      --comms $((1 + (seed + 1) % 2))
  done
  # Weights that never change (MAGI_STATIC_WEIGHTS; a build without it only warns of the name).
  standin_run "fsdp-static-weights" 4 MAGI_STATIC_WEIGHTS=1 -- fsdp --device 1 --layers 6 --steps 24
  # The static-weights programs (reused, swap, alternate, rehome) on device memory, both modes.
  standin_weights_runs
  standin_groupskew_run
  standin_completion_run
  standin_sanitized_run "fsdp-memcheck" 2 -- fsdp --device 1 --layers 6 --steps 8 --rewrite 1
  standin_profiled_run "fsdp-kernels" 2 -- fsdp --device 1 --layers 6 --steps 24 --rewrite 1
  echo "== faults with the CUDA transport"
  standin_fault_runs
  echo "== the flight recorder on the device"
  standin_hang_report_runs
  echo "== ranks as MPS clients"
  standin_mps_runs
  # PyTorch itself over the stand-in (torch_standin_runs.sh), its ranks as MPS clients of a
  # daemon of their own: its log counts only their connections.
  echo "== PyTorch at world 2, 4 and 8 on one GPU over the stand-in, ranks as MPS clients"
  rm -rf "$work/mps-log"
  if mps_start; then
    torch_standin_runs
    mps_stop
  fi
fi

# The CUDA transport alone under faults (tests/gpu/cuda_transport_faults.cc): its own PASS/FAIL
# lines count here one by one.
faults="$build/tests/gpu/magi-transport-faults"
if [ "$gpus" -lt 1 ]; then
  skip "the CUDA transport under faults: no GPU"
elif [ ! -x "$faults" ]; then
  fail "the CUDA transport under faults: $faults is missing (make BUILD=$build test builds it)"
else
  echo "== the CUDA transport under faults"
  timeout 300 "$faults" >"$work/transport-faults.log" 2>&1
  cat "$work/transport-faults.log"
  add_counts transport-faults "$work/transport-faults.log" ||
    fail "the CUDA transport under faults: ended without its summary line"
fi

# 3. Several GPUs (issue 5): real NCCL, one process per GPU, with and without the shim. Its own
# checks count here one by one; a run that ends without its closing line counts as one failure.
if [ "$gpus" -ge 2 ]; then
  echo "== multi-GPU: $gpus GPUs (tests/gpu/multi/run.sh)"
  "$here/multi/run.sh" "$build" 2>&1 | tee "$work/multi.log"
  add_counts multi "$work/multi.log" || fail "multi-GPU runs ended without their summary line"
else
  skip "multi-GPU: only $gpus GPU(s)"
fi

closing_line gpu-tests
