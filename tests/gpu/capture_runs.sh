# shellcheck shell=bash disable=SC2154  # build, work, pass, fail, skip: from run.sh
# Rounds at a graph capture (rewrite/capture_rounds.cc): programs that capture after one or two
# eager steps, as real ones do, get their gathers moved inside the graph, agreed at the capture
# itself on every rank, with every byte of every replay checked by the workload. Sourced by
# run.sh after standin_runs.sh (standin_run, standin_log_check, launch_ranks) under MPS.

# capture_round_runs: the weights program captures its gathers at step K (K eager steps before;
# its step of 7 calls is found at call 14, the third step's first, so K = 2 is the earliest whose
# every captured gather a plan can cover), static weights and the default mode's graph slots, and once
# untimed without MAGI_CE_FORCE (shards of 1 MiB: the size rule moves them).
capture_round_runs() {
  local name mode
  for k in 2 3; do
    for mode in static slots; do
      name=mps-capture-after-$k-$mode
      if [ $mode = static ]; then
        standin_run "$name" 3 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- weights --device 1 \
          --layers 6 --steps 12 --program swap --swap-step 100 --graph-step $k --report-slowest 1
      else
        standin_run "$name" 3 MAGI_CE_FORCE=1 -- weights --device 1 --layers 6 --steps 12 \
          --program swap --swap-step 100 --graph-step $k --graph-rewrite 1 --report-slowest 1
      fi
      standin_log_check "$name" "the plan is agreed at the capture, by MAGI_CE_FORCE" \
        "agreed at a CUDA graph capture .*decided by MAGI_CE_FORCE=1"
      standin_log_check "$name" "the end line counts the 6 captured gathers moved" \
        "served off NCCL, .*; 6 of them captured into CUDA graphs"
      standin_log_check "$name" "no WARN" " MAGI WARN " absent
      grep -m 1 "agreed at a CUDA graph capture" "$work/$name/log" | sed 's/^/  /'
      # The eager step before the capture, the captured one, a late replay: host time a gather.
      grep -E "rank 0: step ($((k - 1))|$k|11):" "$work/$name/log" | sed 's/^/  /'
    done
  done
  # Six layers, so that the step (7 calls) is found at the second step's all-reduce: a step
  # shorter than 8 calls is found 8 calls into its second run (capture/skeleton.h), and the
  # gathers captured before that stay on NCCL.
  name=mps-capture-untimed-rule
  standin_run "$name" 3 MAGI_STATIC_WEIGHTS=1 -- weights --device 1 --layers 6 --steps 8 \
    --shard-elements 262144 --program swap --swap-step 100 --graph-step 2
  standin_log_check "$name" "untimed, the size rule moves shards of 1 MiB" \
    "agreed at a CUDA graph capture .*decided by the size rule"
  standin_log_check "$name" "the end line counts the 6 captured gathers moved" \
    "served off NCCL, .*; 6 of them captured into CUDA graphs"
}

# traced_captured NAME: "CAPTURED MOVED", the all-gathers captured into CUDA graphs (flag C in the
# traces of every rank of the run) and how many of them moved; every replay takes its capture's
# route, so MOVED / CAPTURED is the share of replayed gathers moved.
traced_captured() {
  local t c m captured=0 moved=0
  for t in "$work/$1"/trace/*.trace; do
    [ -e "$t" ] || continue
    read -r c m < <("$build/magice-trace" dump "$t" 2>/dev/null |
      awk 'length($1) == 12 && $2 ~ /^[0-9]+$/ && $3 == "AllGather" && $10 ~ /C/ {
        c++; if ($NF == "moved") m++ } END { print c + 0, m + 0 }')
    captured=$((captured + c))
    moved=$((moved + m))
  done
  echo "$captured $moved"
}

# perf_graph_runs: the loop of all_gather_perf -G (tests/support/workload/perf.cc --graph), three
# ranks under MPS: per size and placement one eager call, 50 calls captured into a graph launched
# 5 times, each at one of 4 places inside its allocations in turn, and a check call captured alone,
# every result checked. A size change loses the step (one call), found again 9 calls later, inside
# the out-of-place capture, where the round at the capture agrees a plan that the in-place capture
# and its check find in force: at least 90 % of the captured gathers move, default mode and static.
perf_graph_runs() {
  local mode name captured moved
  for mode in slots static; do
    name=mps-perf-graph-$mode
    if [ $mode = static ]; then
      standin_run "$name" 3 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- perf --device 1 \
        --sizes 4096,262144,4194304 --iters 50 --graph 5 --shift 4
    else
      standin_run "$name" 3 MAGI_CE_FORCE=1 -- perf --device 1 --sizes 4096,262144,4194304 \
        --iters 50 --graph 5 --shift 4
    fi
    read -r captured moved < <(traced_captured "$name")
    if [ "$captured" -gt 0 ] && [ $((moved * 100)) -ge $((captured * 90)) ]; then
      pass "$name: $moved of $captured captured gathers moved (>= 90 %), every replay checked"
    else
      fail "$name: $moved of $captured captured gathers moved (>= 90 % wanted)"
      grep -E "MAGI (WARN|INFO) .*(capture|served off)" "$work/$name/log" | head -n 8 |
        sed 's/^/  /'
    fi
    grep -m 3 "agreed at a CUDA graph capture" "$work/$name/log" | sed 's/^/  /'
  done
  # What a capture of 100 gathers takes with the library (agreed at the capture itself) and
  # without it: figures for BENCHMARKS.md, not a check.
  name=mps-perf-graph-100
  standin_run "$name" 3 MAGI_CE_FORCE=1 -- perf --device 1 --sizes 4194304 --iters 100 --graph 1 \
    --report-capture 1
  mkdir -p "$work/$name-plain"
  "$launch" -n 3 --timeout 120 -- "$workload" perf --device 1 --sizes 4194304 --iters 100 \
    --graph 1 --report-capture 1 >"$work/$name-plain/log" 2>&1
  echo "  a capture of 100 gathers, with the library (MAGI_CE_FORCE=1) and without:"
  grep -h "a capture of" "$work/$name/log" | sed 's/^/    with:    /'
  grep -h "a capture of" "$work/$name-plain/log" | sed 's/^/    without: /'
}

# nccl_tests_capture_runs: nccl-tests' all_gather_perf with -G (per size and placement one eager
# call, then the timed calls captured into a graph and replayed, and the check call captured
# alone) at world size 1 with MAGI_CE_FORCE=1: at least 90 % of the captured gathers move (flag C
# in the trace), none wrong (-c 1 checks every size), static and default mode. NCCL_TESTS_PERF
# names the binary; else it is looked for in PATH and the usual places, and the runs are skipped
# where it is not installed.
nccl_tests_capture_runs() {
  local perf=${NCCL_TESTS_PERF:-}
  [ -n "$perf" ] || perf=$(command -v all_gather_perf 2>/dev/null ||
    find /opt/nccl-tests/build /usr/local/bin -maxdepth 1 -name all_gather_perf 2>/dev/null |
    head -n 1)
  [ -n "$perf" ] || { skip "nccl-tests -G: all_gather_perf is not installed here"; return; }
  local mode env name
  for mode in default static; do
    name=nccl-tests-G-$mode
    env="MAGI_CE_FORCE=1"
    [ $mode = static ] && env="$env MAGI_STATIC_WEIGHTS=1"
    mkdir -p "$work/$name/trace"
    # shellcheck disable=SC2086
    env $env MAGI_LOG=INFO MAGI_TRACE_DIR="$work/$name/trace" LD_PRELOAD="$build/libmagice.so" \
      timeout 300 "$perf" -b 1K -e 64M -f 4 -c 1 -n 50 -G 5 >"$work/$name/log" 2>&1
    local status=$? moved total wrong captured captured_moved
    # size count type redop root | time algbw busbw #wrong (out of place) | the same in place
    wrong=$(awk '$1 ~ /^[0-9]+$/ && NF == 13 {s += $9 + $13} END {print s + 0}' \
      "$work/$name/log")
    read -r moved total < <(grep -oE "[0-9]+ of [0-9]+ all-gathers" "$work/$name/log" |
      awk '{m += $1; t += $3} END {print m + 0, t + 0}')
    read -r captured captured_moved < <(traced_captured "$name")
    if [ $status -eq 0 ] && [ "$wrong" = 0 ] && [ "$captured" -gt 0 ] &&
      [ $((captured_moved * 100)) -ge $((captured * 90)) ]; then
      pass "$name: $captured_moved of $captured captured gathers moved (>= 90 %; $moved of $total in all), 0 wrong"
    else
      fail "$name: exit $status, $captured_moved of $captured captured gathers moved ($moved of $total in all), wrong $wrong"
      tail -n 15 "$work/$name/log" | sed 's/^/  /'
    fi
    grep -m 3 -E "agreed at a CUDA graph capture|no round at|capture" "$work/$name/log" |
      grep " MAGI " | sed 's/^/  /'
  done
}
