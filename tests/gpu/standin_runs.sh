# shellcheck shell=bash disable=SC2154  # build, work, pass, fail, skip: from run.sh
# Sourced by tests/gpu/run.sh: ranks of magi-workload on one GPU over the NCCL stand-in, under
# the shim. Uses run.sh's build, work, pass, fail and skip. Each launch has a timeout, and a collective
# that blocks gives up sooner (STANDIN_TIMEOUT_S), so a hang fails a check instead of stalling.
support="$build/tests/support"
launch="$support/magi-launch"
workload="$support/magi-workload"
export STANDIN_TIMEOUT_S=60

standin_programs_present() {
  [ -x "$launch" ] && [ -x "$workload" ] && [ -e "$support/libnccl.so.2" ] &&
    [ -e "$support/libworkload.so" ] && [ -x "$build/magice-trace" ]
}

# launch_ranks NAME N WRAPPER [KEY=VALUE...] -- SCENARIO ARGS...
# N ranks of `WRAPPER magi-workload SCENARIO ARGS` (WRAPPER "" for none) under the shim, with
# MAGI_LOG=INFO and a trace directory; output in $work/NAME/log. Returns the launcher's status.
launch_ranks() {
  local name=$1 n=$2 wrapper=$3
  shift 3
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    envs+=(--env "$1")
    shift
  done
  shift
  local dir="$work/$name"
  mkdir -p "$dir/trace"
  # shellcheck disable=SC2086  # the wrapper is a command line of its own
  "$launch" -n "$n" --timeout 120 --env LD_PRELOAD="$build/libmagice.so" --env MAGI_LOG=INFO \
    --env MAGI_TRACE_DIR="$dir/trace" ${envs[@]+"${envs[@]}"} -- $wrapper "$workload" "$@" \
    >"$dir/log" 2>&1
}

# The traces of a run must read, with the same verdict on every rank (decisions exits 0).
check_decisions() {
  local name=$1 lines=$2 dir="$work/$1"
  if "$build/magice-trace" decisions "$dir"/trace/* >"$dir/decisions" 2>&1; then
    pass "$name: magice-trace decisions (every rank the same verdict)"
    head -n "$lines" "$dir/decisions" | sed 's/^/  /'
  else
    fail "$name: magice-trace decisions (every rank the same verdict)"
    head -n 20 "$dir/decisions" | sed 's/^/  /'
  fi
}

# standin_run NAME N [KEY=VALUE...] -- SCENARIO ARGS...: every rank exits 0, traces agree.
standin_run() {
  local name=$1 n=$2
  shift 2
  if launch_ranks "$name" "$n" "" "$@"; then
    pass "$name: $n ranks on one GPU, every byte right, every rank exit 0"
  else
    fail "$name: $n ranks on one GPU, every byte right, every rank exit 0"
    grep -v " MAGI INFO " "$work/$name/log" | tail -n 20 | sed 's/^/  /'
    return
  fi
  grep -m 2 " REWRITE .*round" "$work/$name/log" | sed 's/^/  /'
  case $name in agree-*) check_decisions "$name" 2 ;; *) check_decisions "$name" 6 ;; esac
}

sanitizer_binary() {
  command -v compute-sanitizer 2>/dev/null ||
    { [ -x /usr/local/cuda/bin/compute-sanitizer ] && echo /usr/local/cuda/bin/compute-sanitizer; }
}

# The same run with every rank under compute-sanitizer's memcheck (leaks too): no rank's error
# summary may count an error.
standin_sanitized_run() {
  local name=$1 n=$2
  shift 2
  local sanitizer
  sanitizer=$(sanitizer_binary) ||
    { skip "$name: compute-sanitizer is neither in PATH nor in /usr/local/cuda/bin"; return; }
  launch_ranks "$name" "$n" "$sanitizer --tool memcheck --leak-check full" "$@"
  local status=$? log="$work/$name/log"
  if grep -q "Device not supported\|device is not supported" "$log"; then
    skip "$name: compute-sanitizer cannot run on this machine's GPU:"
    grep -m 3 "=========" "$log" | sed 's/^/  /'
    return
  fi
  local clean summaries
  clean=$(grep -c "ERROR SUMMARY: 0 errors" "$log")
  summaries=$(grep -c "ERROR SUMMARY:" "$log")
  if [ "$status" = 0 ] && [ "$summaries" = "$n" ] && [ "$clean" = "$n" ]; then
    pass "$name: compute-sanitizer memcheck --leak-check full, $n ranks, no errors"
  else
    fail "$name: compute-sanitizer memcheck --leak-check full, $n ranks, no errors (launcher status $status, $clean of $summaries summaries clean)"
    grep "=========" "$log" | grep -v "^========= *$" | head -n 30 | sed 's/^/  /'
  fi
}

# Kernel launches per rank under Nsight Systems, when it is installed (optional: only printed).
standin_profiled_run() {
  local name=$1 n=$2
  shift 2
  if ! command -v nsys >/dev/null 2>&1; then
    skip "$name: nsys is not in PATH, kernel launches not counted"
    return
  fi
  local dir="$work/$name"
  if launch_ranks "$name" "$n" "nsys profile --trace=cuda --output $dir/rank-%p" "$@"; then
    pass "$name: $n ranks under nsys profile, every rank exit 0"
    for report in "$dir"/rank-*.nsys-rep; do
      echo "  $(basename "$report"): $(nsys stats --report cuda_api_sum --format csv "$report" \
        2>/dev/null | grep -i "LaunchKernel" | awk -F, '{gsub(/"/, "", $3); n += $3} END {print n + 0}') kernel launches"
    done
  else
    fail "$name: $n ranks under nsys profile, every rank exit 0"
    tail -n 20 "$dir/log" | sed 's/^/  /'
  fi
}

# The flight recorder with completion (MAGI_FLIGHT_RECORDER_COMPLETION=1) on device memory: the
# driver is in the process, so completion is watched by CUDA events. After a run that finished,
# magice-trace hang must say, for every rank, completed == issued (the poller's last pass at exit
# marks what finished in its last millisecond), and the rings must say "events".
standin_completion_run() {
  local name=completion-fsdp-4 n=4
  local fr="$work/$name/flight"
  mkdir -p "$fr"
  if ! launch_ranks "$name" "$n" "" MAGI_FLIGHT_RECORDER=1024 MAGI_FLIGHT_RECORDER_COMPLETION=1 \
    MAGI_FLIGHT_RECORDER_DIR="$fr" -- fsdp --device 1 --layers 6 --steps 24 --rewrite 1; then
    fail "$name: $n ranks with the recorder's completion, every rank exit 0"
    grep -v " MAGI INFO " "$work/$name/log" | tail -n 20 | sed 's/^/  /'
    return
  fi
  standin_log_check "$name" "completion watched by CUDA events" "completion watched by CUDA events"
  "$build/magice-trace" hang "$fr"/*.flight >"$work/$name/hang" 2>&1
  "$build/magice-trace" hang --json "$fr"/*.flight >"$work/$name/hang.json" 2>&1
  local equal events
  equal=$(grep -cE "^  rank [0-9]+: issued ([0-9]+), returned from \1, completed \1 collectives" \
    "$work/$name/hang")
  events=$(grep -o '"completion":"events"' "$work/$name/hang.json" | wc -l)
  if [ "$equal" = "$n" ] && [ "$events" = "$n" ] && grep -q "no hang seen" "$work/$name/hang"; then
    pass "$name: magice-trace hang: completed == issued on every rank, by CUDA events"
  else
    fail "$name: magice-trace hang: completed == issued on every rank, by CUDA events ($equal of $n ranks equal, $events of $n by events)"
  fi
  sed 's/^/  /' "$work/$name/hang" | head -n 8
}

# Faults with the CUDA transport (issue 6): the launcher's summary line says how each rank ended
# ("rank 2 killed by signal 9 (Killed); rank 0 exited 3 ..."; ranks that exited 0 are not named).
launch_summary() { grep "^magi-launch: " "$work/$1/log" | tail -n 1; }

# standin_fault_run NAME N WANT FORBID LOG_FORBID [KEY=VALUE...] -- SCENARIO ARGS...: passes
# when the summary matches the extended regex WANT and not FORBID, no line of the ranks' output
# matches LOG_FORBID (grep -E; "" for none), and the launcher did not time out.
standin_fault_run() {
  local name=$1 n=$2 want=$3 forbid=$4 log_forbid=$5
  shift 5
  launch_ranks "$name" "$n" "" "$@"
  local status=$? summary
  summary=$(launch_summary "$name")
  if [ "$status" != 124 ] && [[ $summary =~ $want ]] && ! [[ $summary =~ $forbid ]] &&
    { [ -z "$log_forbid" ] || ! grep -qE "$log_forbid" "$work/$name/log"; }; then
    pass "$name: ${summary#magi-launch: *: }"
  else
    fail "$name: launcher status $status, ${summary:-no summary}"
    grep -v " MAGI INFO " "$work/$name/log" | tail -n 25 | sed 's/^/  /'
  fi
  grep -E "watchdog: the main|left allocated|refused" "$work/$name/log" | sed 's/^vm:[0-9:]* //' |
    sort | uniq -c | head -n 8 | sed 's/^/  /'
}

# A run that must end with every rank 0 and no window left behind.
standin_clean_end_run() {
  local name=$1 n=$2
  shift 2
  if launch_ranks "$name" "$n" "" "$@" && ! grep -q "left allocated" "$work/$name/log"; then
    pass "$name: every rank exit 0, every window freed"
  else
    fail "$name: every rank exit 0, every window freed ($(launch_summary "$name"))"
    grep -v " MAGI INFO " "$work/$name/log" | tail -n 20 | sed 's/^/  /'
  fi
}

# allgather_check.py's grouping skew (even ranks group each gather) on device memory: abort, and
# every byte right.
standin_groupskew_run() {
  # NCCL's order within a group (largest first), which the hang on two H200s needed.
  standin_run "groupskew-4" 4 STANDIN_GROUP_ORDER=size -- groupskew --device 1 --configs 12 --steps 16
  # One warmup step: complete where the step is found, in the simulated group, so the anchor is
  # there (with more it is the step's first position).
  standin_run "groupskew-simulated-4" 4 STANDIN_GROUP_ORDER=size MAGI_WARMUP_STEPS=1 -- groupskew \
    --device 1 --configs 4 --steps 16 --simulate 1
}

# standin_log_check NAME WHAT PATTERN [absent]: PASS when some line of run NAME's output matches
# the extended regex PATTERN (with "absent": when none does).
standin_log_check() {
  local name=$1 what=$2 pattern=$3 want=${4:-present} log="$work/$1/log" found=absent
  grep -qE -- "$pattern" "$log" 2>/dev/null && found=present
  if [ "$found" = "$want" ]; then
    pass "$name: $what"
  else
    fail "$name: $what (a line matching '$pattern' is $found)"
    if [ "$found" = present ]; then
      grep -m 3 -E -- "$pattern" "$log" | cut -c1-400 | sed 's/^/  /'
    else
      grep -E " MAGI (WARN|INFO) .*static weights" "$log" 2>/dev/null | head -n 6 | sed 's/^/  /'
    fi
  fi
}

# The static-weights programs (tests/support/workload/weights.cc) with every buffer in device
# memory, as the integration tests run them on host memory: each in the default mode and with
# MAGI_STATIC_WEIGHTS=1. In static mode the plan stages the one reused send buffer (a transient
# buffer is neither read in place nor bound). Every other program's 4 shards are read by the
# peers where they lie: each its own cudaMalloc (4 allocations), or with --arena 1 all in one
# (1 allocation); nothing is bound, and no shard whose bytes stayed the same is reported
# changed. A shard re-homed to other bytes (a broken promise) must be reported by the rank that
# re-homed it: a WARN naming its position (layer 0 is gathered at position 0), and that gather
# back on NCCL in the traces' verdict. Shards in cuMemCreate granules made shareable as POSIX
# file descriptors (--vmm 1, as PyTorch's expandable segments are) are read in place too: legacy
# IPC refuses them, so their owner hands the granules' descriptors to its peers over its
# descriptor channel (ce_transport/fd_channel.h) and each peer maps them contiguously. One
# cuMemCreate allocation made without a shareable handle type (--vmm 2) cannot be mapped by any
# other process: bound instead, and the log says why.
# A static run of 4 gathers whose shards were all read in place: none bound, none refused, no WARN.
standin_all_in_place_checks() {
  standin_log_check "$1" "0 bound" "static weights: 4 gathers: .*, 0 bound \("
  standin_log_check "$1" "no shard refused" "cannot be read in place" absent
  standin_log_check "$1" "no WARN" " MAGI WARN " absent
}

standin_weights_runs() {
  local cases=("reused --steps 24" "swap --steps 40 --swap-step 15"
    "alternate --steps 30 --swap-step 10" "rehome --steps 30 --rehome-rank 1 --rehome-step 15")
  local entry program args name arena allocations
  for entry in "${cases[@]}"; do
    read -r program args <<<"$entry"
    # shellcheck disable=SC2086  # args: the program's own options, word by word
    standin_run "weights-$program" 4 MAGI_CE_FORCE=1 -- weights --device 1 --layers 4 \
      --program "$program" $args
    for arena in 0 1; do
      name=weights-$program-static
      allocations=4
      if [ "$arena" = 1 ]; then
        name=weights-$program-arena-static
        allocations=1
      fi
      # shellcheck disable=SC2086
      standin_run "$name" 4 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- weights --device 1 \
        --arena "$arena" --layers 4 --program "$program" $args
      if [ "$program" = reused ]; then
        standin_log_check "$name" "the plan stages the reused buffer instead of binding" \
          "\(buffer reused\): the plan stages instead of binding"
        standin_log_check "$name" "no shard exported in place" \
          "[1-9][0-9]* shards exported in place" absent
        standin_log_check "$name" "no shard bound" "static weights: .*, [1-9][0-9]* bound \(" absent
      else
        standin_log_check "$name" "4 shards exported in place in $allocations allocations" \
          "static weights: 4 gathers: 4 shards exported in place .* in $allocations allocations"
        standin_log_check "$name" "0 bound" "static weights: 4 gathers: .*, 0 bound \("
      fi
      standin_log_check "$name" "no shard reported changed" "changed after it was bound" absent
    done
  done
  # A shard re-homed to other bytes is a broken promise its peers cannot see: the owner finds it
  # at its moved call, and every rank is told (ncclRemoteError, one WARN), never silent.
  name=weights-rehome-other-static
  standin_run "$name" 4 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 MAGI_REAGREE_STEPS=2 -- weights \
    --device 1 --layers 4 --steps 30 --program rehome --rehome-rank 2 --rehome-step 12 \
    --rehome-other 1 --errors-expected 1
  standin_log_check "$name" "rank 2 finds what its peers read is not what it sends" \
    "rank 2 found, at its moved gather #[0-9]+, that what its peers read for the gather at slot offset 0 is not what it sends there"
  local rank
  for rank in 0 1 2 3; do
    standin_log_check "$name" "rank $rank is told (ncclRemoteError)" \
      "rank $rank: [0-9]+ gathers received wrong bytes, [1-9][0-9]* returned an error; asynchronous error: remote process"
  done
  # Every received byte is checked by the program (exit 0). cuMemCreate granules shareable as
  # descriptors: read in place (4 KiB shards, all in the first 2 MiB granule).
  name=weights-swap-vmm-static
  standin_run "$name" 4 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- weights --device 1 --vmm 1 \
    --layers 4 --steps 40 --program swap --swap-step 15
  standin_log_check "$name" "cuMemCreate shards exported in place (by descriptor)" \
    "static weights: 4 gathers: 4 shards exported in place .* in [0-9]+ allocations"
  standin_all_in_place_checks "$name"
  # Shards of 3 MiB in 2 MiB granules: each spans two or three of them, which the peers map one
  # after the other, so every byte of every shard must read right across the granules' seams.
  name=weights-vmm-in-place-static
  standin_run "$name" 4 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- weights --device 1 --vmm 1 \
    --layers 4 --steps 30 --program swap --swap-step 12 --shard-elements 786432
  standin_log_check "$name" "4 shards of several granules exported in place (by descriptor)" \
    "static weights: 4 gathers: 4 shards exported in place \(12582912 bytes in [0-9]+ allocations"
  standin_all_in_place_checks "$name"
  # One cuMemCreate allocation no other process can map: bound, and the reason is said.
  name=weights-swap-vmm-private-static
  standin_run "$name" 4 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- weights --device 1 --vmm 2 \
    --layers 4 --steps 40 --program swap --swap-step 15
  standin_log_check "$name" "a cuMemCreate allocation without a shareable handle type is bound" \
    "cannot be read in place \(.*without the POSIX file descriptor handle type.*\); bound instead"
  standin_log_check "$name" "0 shards exported in place, 4 bound" \
    "static weights: 4 gathers: 0 shards exported in place .*, 4 bound \("
  standin_weights_one_rank_runs
  standin_weights_move_runs
  standin_weights_memory_run
}

# Every rank moves its weights at step 12 (new blocks, values copied, old ones poisoned and given
# back, so that layer i + 1 lands in layer i's block: tests/support/workload/weights.cc, move).
# Bound shards (--vmm 2: copied into the window): every byte exact at every call. Read in place
# (--arena 1): the block a peer reads may hold another layer; reported on every rank
# (ncclRemoteError), never silent (--errors-expected 1 fails a rank with a wrong byte and no error).
standin_weights_move_runs() {
  standin_run weights-move-vmm-bound-static 4 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- weights \
    --device 1 --vmm 2 --layers 4 --steps 30 --program move --move-step 12
  standin_log_check weights-move-vmm-bound-static "no WARN" " MAGI WARN " absent
  standin_run weights-move-arena-static 4 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- weights \
    --device 1 --arena 1 --layers 4 --steps 30 --program move --move-step 12 --errors-expected 1
  standin_log_check weights-move-arena-static "reported on every rank" \
    "The communicator reports ncclRemoteError"
}

# Changes on one rank that no reader can see at its call (tests/integration/agreement_test.cc,
# OneRankChanges...): rank 1 alone gathers layers 0 and 1 in the other order, or re-homes a
# shard read in place and refills the old block, as a caching allocator gives it to another
# tensor. The program accepts wrong bytes only where it hears of an error, from a gather or from
# ncclCommGetAsyncError (--errors-expected 1: exit 1 on a silent one): every rank must exit 0
# and report the asynchronous error.
standin_weights_one_rank_runs() {
  local entry name args
  for entry in "swap --program swap --swap-rank 1 --swap-step 15" \
    "rehome-reuse --program rehome --rehome-rank 1 --rehome-step 15 --rehome-reuse 1"; do
    read -r name args <<<"$entry"
    name=weights-one-rank-$name-static
    # shellcheck disable=SC2086  # args: the program's own options, word by word
    standin_run "$name" 4 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- weights --device 1 --arena 1 \
      --layers 4 --steps 30 --errors-expected 1 $args
    standin_log_check "$name" "ncclRemoteError reported (WARN)" \
      "MAGI WARN .*The communicator reports ncclRemoteError"
    local rank
    for rank in 0 1 2 3; do
      standin_log_check "$name" "rank $rank hears of it" "rank $rank: [0-9]+ gathers received \
wrong bytes, [1-9][0-9]* returned an error; asynchronous error: remote"
    done
  done
}

# The device memory a static-weights run takes on top of the program's own: every rank reports
# the device's free memory once all have loaded and joined and again after the last step
# (weights --report-memory 1); all ranks share the GPU, so the largest drop any pair of reports
# shows is the whole job's, divided by the rank count per rank. Each rank holds 4 shards of 4 MiB.
# Read in place (--arena 1: one cudaMalloc; --arena 0: one each), a rank takes its window (the
# flags: 2 MiB, rounded) and the agreement's exchange buffers (2 MiB): at most 4 MiB + 64 KiB,
# whatever the shards' size; so in cuMemCreate granules shareable as descriptors (--vmm 1). In
# one cuMemCreate allocation no peer can map (--vmm 2) the shards are bound: the window holds
# their copy too, at least the 16 MiB of shards.
standin_weights_memory_run() {
  local n=4 shard_elements=$((1024 * 1024)) entry kind memory name per_rank
  local read_in_place=$((4 * 1024 * 1024 + 64 * 1024)) shards=$((4 * 4 * 1024 * 1024))
  for entry in "arena --arena 1" "cudamalloc --arena 0" "vmm --vmm 1" "vmm-bound --vmm 2"; do
    read -r kind memory <<<"$entry"
    name=weights-memory-$kind
    # shellcheck disable=SC2086  # memory: the option and its value
    standin_run "$name" "$n" MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- weights --device 1 \
      $memory --report-memory 1 --layers 4 --steps 24 --program swap --swap-step 15 \
      --shard-elements "$shard_elements"
    per_rank=$(awk -v n="$n" '
      /^device memory free before: [0-9]+$/ { if (before == "" || $5 > before) before = $5 }
      /^device memory free after: [0-9]+$/ { if (after == "" || $5 < after) after = $5 }
      END { if (before == "" || after == "") exit 1; d = before - after; if (d < 0) d = 0
            printf "%.0f\n", int(d / n) }' "$work/$name/log") || {
      fail "$name: every rank reports the device's free memory"
      continue
    }
    echo "  $name: $per_rank bytes of device memory per rank ($((per_rank / 1024)) KiB)"
    if [ "$kind" = vmm-bound ]; then
      if [ "$per_rank" -ge "$shards" ]; then
        pass "$name: bound shards take their copy ($per_rank bytes per rank, >= $shards)"
      else
        fail "$name: bound shards take their copy ($per_rank bytes per rank, < $shards)"
      fi
    elif [ "$per_rank" -le "$read_in_place" ]; then
      pass "$name: $per_rank bytes of device memory per rank, at most 4 MiB + 64 KiB"
    else
      fail "$name: $per_rank bytes of device memory per rank, over 4 MiB + 64 KiB"
    fi
  done
}

# A model's shards at scale: 4 ranks of 256 allocations each (cudaMalloc, as the caching allocator
# gives a shard of 10 MiB or more a segment of its own; 256 KiB here, to keep the stand-in's own
# copies short), every one read in place (none bound for lack of room in the publish round), the
# peers' 768 IPC mappings each opened off the program's calls, every byte right.
standin_weights_scale_run() {
  local name=mps-weights-256-allocations-static log
  standin_run "$name" 4 MAGI_CE_FORCE=1 MAGI_STATIC_WEIGHTS=1 -- weights --device 1 --arena 1 \
    --arenas 256 --layers 256 --steps 60 --program swap --swap-step 1000 \
    --shard-elements $((64 * 1024)) --report-memory 1 --report-slowest 1
  log="$work/$name/log"
  standin_log_check "$name" "each rank's exports and window made off the program's calls" \
    "static weights: 256 gathers: .* prepared in [0-9.]+ ms off the program's calls"
  standin_log_check "$name" "every shard read in place" \
    "static weights: 256 gathers: 256 shards exported in place .* in 256 allocations, 0 copied\), 0 bound"
  standin_log_check "$name" "the peers' allocations mapped off the program's calls" \
    "mapped 768 allocations of the peers \(set-up [0-9.]+ ms, off the program's calls\)"
  grep -E "prepared in|mapped 768 allocations|served off NCCL|device memory free|slowest gather" \
    "$log" | head -n 20 | sed 's/^/  /'
}

# What the fsdp program says when a byte it received is wrong (tests/support/workload/fsdp.cc:
# every check of a gathered weight, a logit or an all-reduce fails with "rank R: ...").
fsdp_wrong_bytes='^fsdp: rank [0-9]+: '

standin_fault_runs() {
  local fsdp=(fsdp --device 1 --layers 6 --steps 24)
  # A rank hung (alive) with gathers moving: the others' streams wait on it, as they would in
  # NCCL's kernels; their watchdog thread aborts the communicators, which must free the main
  # thread blocked on the device (exit 3), not leave it blocked (exit 4 after the grace). No cost
  # trial and a step with no agreement round, so nothing but the transport's waits can block
  # (an abort that the stand-in's own collectives noticed would say "refused").
  standin_fault_run "fault-hung-peer" 3 "^magi-launch: .*: rank 0 exited 3; rank 2 exited 3 " \
    "exited 4|signal" "refused" MAGI_CE_FORCE=1 -- "${fsdp[@]}" --comms 2 --stall-rank 1 \
    --stall-step 16 --stall-s 45 --watchdog-s 5 --watchdog-grace-s 30
  # A rank killed with gathers moving, and while rounds are in flight: no survivor hangs (each
  # ends through the stand-in's error or its watchdog's abort, exit 1 or 3), none crashes, none
  # received a wrong byte. Exit 1 is also how the program ends on a wrong byte, so the log tells
  # them apart: fsdp's every check of what it received fails with "fsdp: rank R: ...", an
  # error from the stand-in with "fsdp: ncclAllGather(...) returned ...".
  local survivors_end_1_or_3='^magi-launch: .*: rank 0 exited [13]; rank 1 exited [13]; rank 2 killed by signal 9 \(Killed\); rank 3 exited [13] \('
  for step in 6 14; do
    standin_fault_run "fault-killed-peer-$step" 4 "$survivors_end_1_or_3" "timed out" \
      "$fsdp_wrong_bytes" -- "${fsdp[@]}" \
      --die-rank 2 --die-step "$step" --watchdog-s 5 --watchdog-grace-s 30
  done
  # Abort on every rank mid-run (rounds in flight, gathers moving), two communicators; and a
  # program that never destroys: windows freed, every rank exit 0.
  for step in 6 14; do
    standin_clean_end_run "fault-abort-step-$step" 3 -- "${fsdp[@]}" --comms 2 --abort-step "$step"
  done
  standin_clean_end_run "fault-exit-without-destroy" 3 -- "${fsdp[@]}" --comms 2 --exit-without-destroy 1
}

# The flight recorder and `magice-trace hang` on the device. Rank 2 is SIGKILLed right after its
# layer-0 gather of step 14 returned: by then gathers move, so its copy-engine reads are queued
# and the survivors wait on it in their moved gathers (they end by the stand-in's error or their
# watchdog). From the recorder files alone (the killed rank's trace is lost) the report must name
# rank 2 and the collective after that gather: with 6 layers a step is 7 collectives after one
# prologue all-reduce, so step 14's layer-0 gather is #99 and rank 2 never issued #100.
standin_hang_report_runs() {
  local name=hang-killed-in-moved-gather dir="$work/hang-killed-in-moved-gather"
  mkdir -p "$dir/flight"
  launch_ranks "$name" 3 "" MAGI_CE_FORCE=1 MAGI_FLIGHT_RECORDER=256 \
    MAGI_FLIGHT_RECORDER_COMPLETION=1 MAGI_FLIGHT_RECORDER_DIR="$dir/flight" -- fsdp --device 1 \
    --layers 6 --steps 24 \
    --die-rank 2 --die-step 14 --die-in-gather 1 --watchdog-s 5 --watchdog-grace-s 30
  local summary status moved
  summary=$(launch_summary "$name")
  # The survivors' traces (written at their end) say how gather #99 went.
  moved=$(for t in "$dir"/trace/*; do "$build/magice-trace" dump "$t" 2>/dev/null; done |
    awk '$2 == 99 && $3 == "AllGather" && $NF == "moved"' | wc -l)
  "$build/magice-trace" hang "$dir"/flight/*.flight >"$dir/hang" 2>&1
  status=$?
  if [[ $summary =~ "rank 2 killed by signal 9" ]] && [ "$moved" -ge 1 ]; then
    pass "$name: rank 2 killed after gather #99, which moved (on $moved survivors)"
  else
    fail "$name: rank 2 killed after gather #99, which moved ($summary; moved on $moved)"
  fi
  if [ "$status" = 1 ] && head -n 1 "$dir/hang" | grep -q "rank 2 never issued collective #100 "; then
    pass "$name: magice-trace hang names rank 2 and collective #100 (exit 1)"
  else
    fail "$name: magice-trace hang names rank 2 and collective #100 (exit $status)"
  fi
  head -n 30 "$dir/hang" | grep -v "^      " | sed 's/^/  /'
}

# Some of the same runs with the ranks as MPS clients, when the MPS control daemon is installed:
# they then share one GPU context and their device work truly overlaps, instead of the GPU
# taking turns between their contexts (which hides orderings that one GPU per rank can show, and
# makes every cross-process wait cost a context switch: BENCHMARKS.md, "Under MPS"). The daemon
# gets pipe and log directories of its own and is stopped at the end.
# mps_start: the daemon, with pipe and log directories of its own (false, having counted a SKIP
# that says why, when it cannot run); mps_stop: stops it and checks that the ranks connected to it.
mps_start() {
  if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    skip "MPS runs: nvidia-cuda-mps-control is not in PATH"
    return 1
  fi
  local pipe="$work/mps-pipe" logs="$work/mps-log"
  mkdir -p "$pipe" "$logs"
  if ! CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$logs timeout 20 nvidia-cuda-mps-control -d; then
    skip "MPS runs: the MPS control daemon did not start"
    return 1
  fi
  export CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$logs
}
mps_stop() {
  local logs=$CUDA_MPS_LOG_DIRECTORY
  echo quit | timeout 20 nvidia-cuda-mps-control >/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  local clients
  clients=$(grep -c "Client {PID: [0-9]*, Context ID: [0-9]*} connected" "$logs/server.log" 2>/dev/null)
  if [ "${clients:-0}" -gt 0 ]; then
    pass "MPS runs: the ranks ran as MPS clients ($clients client connections)"
  else
    fail "MPS runs: no rank connected to the MPS daemon (the runs above did not test MPS)"
  fi
}

standin_mps_runs() {
  mps_start || return
  standin_run "mps-fsdp-4" 4 -- fsdp --device 1 --layers 6 --steps 24 --rewrite 1
  for seed in 1 2 3 4 5 6; do
    standin_run "mps-agree-seed-$seed" $((2 + seed % 7)) -- agree --device 1 --seed "$seed" \
      --steps 16 --comms $((1 + (seed + 1) % 2))
  done
  standin_run "mps-fsdp-static-weights" 4 MAGI_STATIC_WEIGHTS=1 -- fsdp --device 1 --layers 6 --steps 24
  standin_weights_scale_run
  standin_fault_run "mps-fault-hung-peer" 3 "^magi-launch: .*: rank 0 exited 3; rank 2 exited 3 " \
    "exited 4|signal" "refused" MAGI_CE_FORCE=1 -- fsdp --device 1 --layers 6 --steps 24 --comms 2 \
    --stall-rank 1 --stall-step 16 --stall-s 40 --watchdog-s 5 --watchdog-grace-s 25
  graph_standin_runs
  capture_round_runs
  perf_graph_runs
  machines_runs
  mps_stop
}
