# shellcheck shell=bash disable=SC2154  # build, here, work, pass, fail, skip: from run.sh
# Sourced by tests/gpu/run.sh: gathers captured into CUDA graphs (issue 23).
#  - graph_torch_runs: PyTorch at world size 1 (real NCCL), a step run eagerly and then captured
#    with torch.cuda.graph and replayed into poisoned buffers; bitwise equal with and without
#    the shim. With static weights the captured gathers move (the log says so, the trace marks
#    them moved), also with PyTorch's expandable segments; in the default mode they move on a
#    plan with graph slots agreed at the capture, and with MAGI_GRAPH_SLOTS=always on the eager
#    plan, the weights rewritten before each replay.
#  - graph_standin_runs (under MPS, from standin_mps_runs): ranks of the weights program over the
#    stand-in, which records a captured collective into the graph (a copy to pinned staging, a
#    host node that runs it with the peers at each replay, a copy back): gathers that move, and
#    gathers that stay on NCCL (MAGI_CAPTURE_WAIT_MS=0) or run with no library at all, replayed by the
#    stand-in. Every byte of every replay is checked by the program.
#  - graph_real_nccl_runs: the same program at world size 1 over the real NCCL, as nccl-tests -G
#    runs: N gathers captured once, the graph replayed, every byte of every replay checked; also
#    in the default mode with graph slots, the shards rewritten before every replay.

# graph_torch_run NAME [KEY=VALUE...]: the program under the shim with the settings given.
# graph_torch_run NAME REWRITE [KEY=VALUE...] (REWRITE: --rewrite, or "").
graph_torch_run() {
  local name=$1 rewrite=$2 d="$work/$1"
  shift 2
  mkdir -p "$d/trace"
  env LD_PRELOAD="$build/libmagice.so" MAGI_TRACE_DIR="$d/trace" MAGI_LOG=INFO MAGI_CE_FORCE=1 "$@" \
    python3 "$here/torch_graphs.py" "$d/out.pt" $rewrite >"$d/log" 2>&1
}

graph_torch_runs() {
  local plain rewrite
  for rewrite in "" --rewrite; do
    plain="$work/graphs-plain$rewrite"
    mkdir -p "$plain"
    if ! python3 "$here/torch_graphs.py" "$plain/out.pt" $rewrite >"$plain/log" 2>&1; then
      fail "torch graphs without the shim$rewrite (environment problem)"
      tail -n 10 "$plain/log"
      return
    fi
  done
  local name alloc moved
  for name in graphs-static graphs-static-expandable graphs-default graphs-default-slots; do
    alloc=""
    rewrite=""
    [ "$name" = graphs-static-expandable ] && alloc=expandable_segments:True
    if [ "$name" = graphs-default ]; then
      graph_torch_run "$name" "" ${alloc:+PYTORCH_CUDA_ALLOC_CONF=$alloc}
    elif [ "$name" = graphs-default-slots ]; then
      rewrite=--rewrite
      graph_torch_run "$name" --rewrite MAGI_GRAPH_SLOTS=always
    else
      graph_torch_run "$name" "" MAGI_STATIC_WEIGHTS=1 ${alloc:+PYTORCH_CUDA_ALLOC_CONF=$alloc}
    fi
    plain="$work/graphs-plain$rewrite"
    if python3 "$here/compare_results.py" "$plain/out.pt" "$work/$name/out.pt" >/dev/null 2>&1; then
      pass "$name: eager steps and 5 graph replays bitwise equal with and without the shim"
    else
      fail "$name: eager steps and 5 graph replays bitwise equal with and without the shim"
      grep -v " MAGI INFO " "$work/$name/log" | tail -n 10
    fi
    "$build/magice-trace" dump "$work/$name"/trace/*.trace >"$work/$name/dump.txt" 2>&1
    # Captured calls carry flag C (the dump's tenth column); a moved one ends "moved".
    moved=$(awk 'length($1) == 12 && $2 ~ /^[0-9]+$/ && $3 == "AllGather" && $10 ~ /C/ && $NF == "moved"' \
      "$work/$name/dump.txt" | wc -l)
    if [ "$name" = graphs-default ]; then
      # The eager plan has no graph slots (nothing was captured when it was agreed): the capture
      # ends it and agrees one with them at the captured call.
      if [ "$moved" = 4 ] && grep -q "agreed at a CUDA graph capture" "$work/$name/log"; then
        pass "$name: the 4 captured gathers moved on a plan agreed at the capture (trace, log)"
      else
        fail "$name: the 4 captured gathers moved on a plan agreed at the capture ($moved moved)"
        grep " MAGI " "$work/$name/log" | grep -v "options:" | tail -n 8
      fi
    elif [ "$name" = graphs-default-slots ]; then
      if [ "$moved" = 4 ] && grep -q "captured into a CUDA graph move with the plan, on its graph slots" \
        "$work/$name/log"; then
        pass "$name: the 4 captured gathers moved on graph slots (trace), and the log says so"
      else
        fail "$name: the 4 captured gathers moved on graph slots (trace), and the log says so ($moved moved)"
        grep " MAGI " "$work/$name/log" | grep -v "options:" | tail -n 8
      fi
    elif [ "$moved" = 4 ] && grep -q "captured into a CUDA graph move with the plan" "$work/$name/log"; then
      pass "$name: the 4 captured gathers moved (trace), and the log says so"
    else
      fail "$name: the 4 captured gathers moved (trace), and the log says so ($moved moved)"
      grep " MAGI " "$work/$name/log" | grep -v "options:" | tail -n 8
    fi
  done
}

graph_standin_runs() {
  local name=mps-weights-graph-static
  standin_run "$name" 3 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- weights --device 1 --layers 6 \
    --steps 30 --program swap --swap-step 100 --graph-step 16 --report-slowest 1
  standin_log_check "$name" "the log says the captured gathers move" \
    "captured into a CUDA graph move with the plan"
  standin_log_check "$name" "the window outlives the communicator while the graph lives" \
    "kept, with its 2 peer mappings .* while 1 CUDA graph"
  standin_log_check "$name" "the end line counts the 6 captured gathers apart" \
    "served off NCCL, .*; 6 of them captured into CUDA graphs"
  standin_log_check "$name" "no WARN" " MAGI WARN " absent
  grep -E "rank 0: step (15|16|29):" "$work/$name/log" | sed 's/^/  /'
  # The default mode with graph slots: the captured gathers move, staged at every replay from
  # shards rewritten before it (--graph-rewrite 1); every byte of every replay checked.
  name=mps-weights-graph-slots
  standin_run "$name" 3 MAGI_CE_FORCE=1 MAGI_GRAPH_SLOTS=always -- weights --device 1 --layers 6 \
    --steps 30 --program swap --swap-step 100 --graph-step 16 --graph-rewrite 1 --report-slowest 1
  standin_log_check "$name" "the plan has graph slots" "gathers per step from collective .*; graph slots)"
  standin_log_check "$name" "the log says the captured gathers move on graph slots" \
    "captured into a CUDA graph move with the plan, on its graph slots"
  standin_log_check "$name" "the end line counts the 6 captured gathers apart" \
    "served off NCCL, .*; 6 of them captured into CUDA graphs"
  standin_log_check "$name" "no WARN" " MAGI WARN " absent
  grep -E "rank 0: step (15|16|29):" "$work/$name/log" | sed 's/^/  /'
  # Two graphs on the plan's graph slots, the second capturing the layers in reverse order on a
  # stream of its own; each step launches both with nothing ordering them (as NCCL allows of a
  # communicator's graphs): the library replays them in launch order on every rank, so no graph
  # slot is staged by one graph while a peer reads the other's. Every byte of both checked.
  name=mps-weights-graph-slots-two-streams
  standin_run "$name" 3 MAGI_CE_FORCE=1 MAGI_GRAPH_SLOTS=always -- weights --device 1 --layers 6 \
    --steps 30 --program swap --swap-step 100 --graph-step 16 --graph-rewrite 1 \
    --graph-streams 2 --report-slowest 1
  standin_log_check "$name" "the end line counts the 12 captured gathers apart" \
    "served off NCCL, .*; 12 of them captured into CUDA graphs"
  standin_log_check "$name" "no WARN" " MAGI WARN " absent
  grep -E "rank 0: step (16|17|29):" "$work/$name/log" | sed 's/^/  /'
  # The default mode without graph slots asked for: the capture ends the eager plan (it has
  # none) and agrees one with them at the captured call, on every rank.
  name=mps-weights-graph-default
  standin_run "$name" 3 MAGI_CE_FORCE=1 -- weights --device 1 --layers 6 --steps 30 \
    --program swap --swap-step 100 --graph-step 16 --graph-rewrite 1
  standin_log_check "$name" "the capture agrees a plan with graph slots" \
    "agreed at a CUDA graph capture"
  standin_log_check "$name" "the end line counts the 6 captured gathers apart" \
    "served off NCCL, .*; 6 of them captured into CUDA graphs"
  # MAGI_CAPTURE_WAIT_MS=0 (no rounds at a capture): the captured gathers stay on NCCL on every
  # rank, so the stand-in records them into the graph and runs them at each of the 14 replays,
  # every byte checked.
  name=mps-weights-graph-no-capture-rounds
  launch_ranks "$name" 3 "" MAGI_CE_FORCE=1 MAGI_CAPTURE_WAIT_MS=0 -- weights --device 1 \
    --layers 6 --steps 30 --program swap --swap-step 100 --graph-step 16 --report-slowest 1
  graph_stayed_check "$name" 3 $?
  grep -E "rank 0: step (15|16|29):" "$work/$name/log" | sed 's/^/  /'
  # The stand-in alone, no library: its captured gathers replayed, at 2 and 4 ranks.
  local n
  for n in 2 4; do
    name=mps-standin-graph-$n
    mkdir -p "$work/$name"
    if "$launch" -n "$n" --timeout 120 -- "$workload" weights --device 1 --layers 6 --steps 30 \
      --program swap --swap-step 100 --graph-step 16 --report-slowest 1 >"$work/$name/log" 2>&1; then
      pass "$name: the stand-in alone, 14 replays of 6 captured gathers on $n ranks, every byte right"
    else
      fail "$name: the stand-in alone, 14 replays of 6 captured gathers on $n ranks, every byte right"
      tail -n 10 "$work/$name/log" | sed 's/^/  /'
    fi
  done
}

# graph_stayed_check NAME N STATUS: run NAME's N ranks all ended well (the program checked every
# byte of every replay: exit 0) after the library said the captured gathers stay on NCCL, the
# stand-in ran them at the replays (no rank refused at its capture, none hung: a rank blocked in
# a collective is given up by the stand-in itself, "giving up", long before the launcher's own
# timeout, exit 124 "timed out"), and the traces mark none of the captured gathers moved.
graph_stayed_check() {
  local name=$1 n=$2 status=$3 log="$work/$1/log" refused hung moved captured
  refused=$(grep -c "(captured into a CUDA graph) returned" "$log" 2>/dev/null)
  hung=$(grep -cE "giving up|timed out|a replay of a CUDA graph" "$log" 2>/dev/null)
  # Captured calls carry flag C (the dump's tenth column); a moved one ends "moved".
  captured=$(for t in "$work/$name"/trace/*; do "$build/magice-trace" dump "$t" 2>/dev/null; done |
    awk 'length($1) == 12 && $2 ~ /^[0-9]+$/ && $3 == "AllGather" && $10 ~ /C/' | tee "$work/$name/captured" | wc -l)
  moved=$(awk '$NF == "moved"' "$work/$name/captured" | wc -l)
  if [ "$status" = 0 ] && [ "${hung:-0}" = 0 ] && [ "${refused:-0}" = 0 ] && [ "$moved" = 0 ] &&
      grep -q "captured into a CUDA graph stay on NCCL on every rank" "$log"; then
    pass "$name: captured gathers stay on NCCL on every rank, the stand-in replays them, every byte right ($captured captured calls in the traces, none moved)"
  else
    fail "$name: captured gathers stay on NCCL on every rank, the stand-in replays them, every byte right (launcher status $status, ${refused:-0} ranks refused at capture, ${hung:-0} lines of a rank given up, timed out or a failed replay, $moved of $captured captured calls moved)"
    grep -E "giving up|timed out|returned|a replay of a CUDA graph" "$log" 2>/dev/null | head -n 4 | sed 's/^/  /'
    tail -n 8 "$log" | sed 's/^/  /'
  fi
}

# real_nccl_dir: the folder of a real libnccl.so.2 (PyTorch's, else the system's), or nothing.
real_nccl_dir() {
  local dir
  dir=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' \
    2>/dev/null)
  if [ -z "$dir" ] || [ ! -e "$dir/libnccl.so.2" ]; then
    dir=$(ldconfig -p 2>/dev/null | grep -m 1 'libnccl\.so\.2 ' | sed 's/.*=> //; s/\/libnccl\.so\.2$//')
  fi
  [ -n "$dir" ] && [ -e "$dir/libnccl.so.2" ] && echo "$dir"
}

# graph_real_nccl_runs: the weights program at world size 1 over the real NCCL, as nccl-tests -G
# runs: 16 eager steps of 6 gathers, then the step captured once and replayed 14 times, every
# byte of every replay checked by the program (magi-workload finds the stand-in by its RUNPATH;
# LD_LIBRARY_PATH puts the real library first). MAGI_CE_FORCE=1, as a communicator of one rank
# never explores. Static weights: the captured gathers move on the eager plan; the default mode:
# the capture ends the eager plan (no graph slots) and agrees one with them at the captured call;
# with MAGI_GRAPH_SLOTS=always the eager plan has them already.
graph_real_nccl_runs() {
  local dir name settings
  if ! standin_programs_present; then
    fail "real-nccl graphs: programs missing in $build/tests/support"
    return
  fi
  if ! dir=$(real_nccl_dir); then
    skip "real-nccl graphs: no libnccl.so.2 found (PyTorch's or the system's)"
    return
  fi
  echo "  real NCCL: $dir"
  local rewrite
  for name in real-nccl-graph-static real-nccl-graph-default real-nccl-graph-slots; do
    settings=(LD_LIBRARY_PATH="$dir" NCCL_DEBUG=VERSION MAGI_CE_FORCE=1)
    rewrite=0
    [ "$name" = real-nccl-graph-static ] && settings+=(MAGI_STATIC_WEIGHTS=1)
    [ "$name" = real-nccl-graph-slots ] && settings+=(MAGI_GRAPH_SLOTS=always) && rewrite=1
    if launch_ranks "$name" 1 "" "${settings[@]}" -- weights --device 1 --layers 6 --steps 30 \
      --program swap --swap-step 100 --graph-step 16 --graph-rewrite $rewrite --report-slowest 1; then
      pass "$name: 14 replays of 6 captured gathers, every byte right"
    else
      fail "$name: 14 replays of 6 captured gathers, every byte right"
      grep -v " MAGI INFO " "$work/$name/log" | tail -n 10 | sed 's/^/  /'
      continue
    fi
    standin_log_check "$name" "the real NCCL ran the calls (NCCL_DEBUG=VERSION)" "NCCL version 2\."
    grep -E "rank 0: step (15|16|29):" "$work/$name/log" | sed 's/^/  /'
  done
  standin_log_check real-nccl-graph-static "the log says the captured gathers move" \
    "captured into a CUDA graph move with the plan"
  standin_log_check real-nccl-graph-default "the capture agrees a plan with graph slots" \
    "agreed at a CUDA graph capture"
  standin_log_check real-nccl-graph-default "the captured gathers move on graph slots" \
    "captured into a CUDA graph move with the plan, on its graph slots"
  standin_log_check real-nccl-graph-slots "the captured gathers move on graph slots" \
    "captured into a CUDA graph move with the plan, on its graph slots"
}
