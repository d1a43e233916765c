# shellcheck shell=bash disable=SC2154  # build, here, work, pass, fail, skip: from run.sh
# Sourced by tests/gpu/run.sh: communicators that span machines (issue 35), on the CUDA backend,
# as several processes on one GPU under MPS over the NCCL stand-in. Each rank is given a machine
# (MAGI_INJECT_HOST, by as_machines.sh); a moved gather then runs in two levels: the stand-in's
# all-gather between machines on a sub-communicator, written straight into the rank's staging
# slot, then copy-engine reads inside each machine. Every byte of every gather is checked by the
# program; the traces must agree; the log must say two levels.
#  - 2 x 2 consecutive, a,b,a,b numbering, 4 x 2 and 2 x 4: weights rewritten every step;
#  - static weights: the network crossed once a gather, the machines' shards held in the window;
#    a rank whose shard changes after the other machines took it (a broken promise) is told by
#    the sampled check of its own piece, says so, and the gather goes back to NCCL;
#  - gathers captured into CUDA graphs, replayed from rewritten shards: they move on the eager
#    plan's graph slots, NCCL's part recorded in the graph;
#  - a rank killed on another machine while gathers move: no survivor hangs;
#  - figures (not checks): wall time of the same program on NCCL alone and in two levels.

as_machines="$here/as_machines.sh"

# machines_run NAME MACHINES [KEY=VALUE...] -- SCENARIO ARGS...: standin_run with the ranks on
# MACHINES (comma-separated, one entry a rank).
machines_run() {
  local name=$1 machines=$2
  shift 2
  local n
  n=$(tr ',' '\n' <<<"$machines" | wc -l)
  if launch_ranks "$name" "$n" "$as_machines" AS_MACHINES="$machines" "$@"; then
    pass "$name: $n ranks on machines $machines, every byte right, every rank exit 0"
  else
    fail "$name: $n ranks on machines $machines, every byte right, every rank exit 0"
    grep -v " MAGI INFO " "$work/$name/log" | tail -n 20 | sed 's/^/  /'
    return 1
  fi
  check_decisions "$name" 4
}

# The two levels' end line on every rank: "two levels: G gathers moved, C of them crossed ...".
machines_moved_check() {
  local name=$1 n=$2 log="$work/$1/log" ranks
  ranks=$(grep -cE "MAGI INFO TRANSPORT comm [0-9a-f]+: two levels: [1-9][0-9]* gathers moved" "$log")
  if [ "$ranks" -ge "$n" ] && grep -q "each moved gather runs in two levels" "$log"; then
    pass "$name: every rank moved gathers in two levels ($ranks end lines)"
  else
    fail "$name: every rank moved gathers in two levels ($ranks of $n end lines)"
    grep -E " MAGI (WARN|INFO) .*(two levels|stays on NCCL|reason|refus)" "$log" | head -n 6 |
      sed 's/^/  /'
  fi
  grep -m 2 -E "two levels: [0-9]+ gathers moved|sub-communicator of local index [0-9]+ formed" \
    "$log" | sed 's/^vm:[0-9:]* //; s/^/  /'
}

machines_runs() {
  local m name
  for m in a,a,b,b a,b,a,b a,a,b,b,c,c,d,d a,a,a,a,b,b,b,b; do
    name=mps-machines-${m//,/}
    machines_run "$name" "$m" MAGI_CE_FORCE=1 -- fsdp --device 1 --layers 6 --steps 40 \
      --rewrite 1 && machines_moved_check "$name" "$(tr ',' '\n' <<<"$m" | wc -l)"
  done
  name=mps-machines-static
  machines_run "$name" a,a,b,b MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- fsdp --device 1 \
    --layers 6 --steps 40 && machines_moved_check "$name" 4
  standin_log_check "$name" "the plan holds the other machines' shards" \
    "the other machines' shards cross the network once, then are held"
  standin_log_check "$name" "each of the 6 gathers crossed machines once" \
    "two levels: [0-9]+ gathers moved, 6 of them crossed machines"
  standin_log_check "$name" "no WARN" " MAGI WARN " absent
  name=mps-machines-static-broken
  machines_run "$name" a,a,b,b MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 MAGI_REAGREE_STEPS=2 \
    MAGI_VERIFY_EVERY=16 -- \
    fsdp --device 1 --layers 5 --steps 200 --static-change-rank 2 --static-change-step 120
  standin_log_check "$name" "the rank whose shard changed says so" \
    "\\[2\\] MAGI WARN .*changed after the other machines took it"
  if "$build/magice-trace" decisions "$work/$name"/trace/* 2>&1 |
    grep -q "rank 2 gather #0 (pos 0, .*stays: static weights changed after binding"; then
    pass "$name: its gather went back to NCCL (magice-trace decisions)"
  else
    fail "$name: its gather went back to NCCL (magice-trace decisions)"
  fi
  # Captured gathers: the eager plan of a spanning communicator has graph slots.
  name=mps-machines-graph
  local captured moved
  if machines_run "$name" a,a,b,b MAGI_CE_FORCE=1 -- weights --device 1 --layers 6 --steps 30 \
    --program swap --swap-step 100 --graph-step 16 --graph-rewrite 1; then
    read -r captured moved < <(traced_captured "$name")
    if [ "$captured" -gt 0 ] && [ "$moved" = "$captured" ]; then
      pass "$name: $moved of $captured captured gathers moved in two levels, every replay checked"
    else
      fail "$name: $moved of $captured captured gathers moved in two levels"
      grep -E " MAGI (WARN|INFO) .*(capture|graph)" "$work/$name/log" | head -n 6 | sed 's/^/  /'
    fi
    standin_log_check "$name" "no WARN" " MAGI WARN " absent
  fi
  # A rank killed on machine b while gathers move: every survivor ends (an error or NCCL's own),
  # none hangs.
  name=mps-machines-killed
  launch_ranks "$name" 4 "$as_machines" AS_MACHINES=a,a,b,b MAGI_CE_FORCE=1 -- fsdp \
    --device 1 --layers 6 --steps 60 --rewrite 1 --die-rank 2 --die-step 30 --watchdog-s 5 \
    --watchdog-grace-s 30
  local status=$? summary
  summary=$(launch_summary "$name")
  if [ "$status" != 124 ] && [[ $summary =~ "rank 2 killed by signal 9" ]] &&
    ! [[ $summary =~ "timed out" ]]; then
    pass "$name: ${summary#magi-launch: *: }"
  else
    fail "$name: launcher status $status, ${summary:-no summary}"
    grep -v " MAGI INFO " "$work/$name/log" | tail -n 15 | sed 's/^/  /'
  fi
  machines_figures
}

# Wall time of one program, 4 ranks as 2 x 2, on NCCL alone (no library), with the library's
# defaults, and with every gather moved (MAGI_CE_FORCE=1); the weights rewritten every step, or
# static and promised so: figures for BENCHMARKS.md.
machines_figures() {
  local how name args=(fsdp --device 1 --layers 12 --steps 300)
  echo "  4 ranks as 2 x 2 machines, ${args[*]} (--rewrite 1 but static-*): wall time, best of 3"
  for how in nccl default force static-nccl static-force; do
    local best="" t r
    for r in 1 2 3; do
      name=mps-machines-figures-$how-$r
      mkdir -p "$work/$name"
      case $how in
        nccl) "$launch" -n 4 --timeout 120 -- "$workload" "${args[@]}" --rewrite 1 \
          >"$work/$name/log" 2>&1 ;;
        default) launch_ranks "$name" 4 "$as_machines" AS_MACHINES=a,a,b,b -- "${args[@]}" \
          --rewrite 1 ;;
        force) launch_ranks "$name" 4 "$as_machines" AS_MACHINES=a,a,b,b MAGI_CE_FORCE=1 \
          -- "${args[@]}" --rewrite 1 ;;
        static-nccl) "$launch" -n 4 --timeout 120 -- "$workload" "${args[@]}" \
          >"$work/$name/log" 2>&1 ;;
        static-force) launch_ranks "$name" 4 "$as_machines" AS_MACHINES=a,a,b,b MAGI_CE_FORCE=1 \
          MAGI_STATIC_WEIGHTS=1 -- "${args[@]}" ;;
      esac
      # "4 ranks exited 0 in 0.30 s", or "... (0.30 s)"
      t=$(launch_summary "$name" | grep -oE '[0-9]+\.[0-9]+ s\)?$' | grep -oE '[0-9]+\.[0-9]+')
      [ -n "$t" ] && { [ -z "$best" ] || awk "BEGIN{exit !($t < $best)}"; } && best=$t
    done
    echo "    $how: ${best:-?} s; $(grep -h -m 1 -oE "two levels: [0-9]+ gathers moved, [0-9]+ of them crossed machines \([0-9]+ bytes" \
      "$work/mps-machines-figures-$how-1/log" || echo "nothing moved in two levels")"
  done
}
