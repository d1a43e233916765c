# shellcheck shell=bash disable=SC2154  # build, here, work, pass, fail, skip: from run.sh
# Sourced by tests/gpu/run.sh (under MPS, started there): unmodified PyTorch at world 2, 4 and 8 on
# ONE GPU with the NCCL stand-in as its NCCL (tests/gpu/torch_standin.py: FSDP2 inference, DTensor
# full_tensor(), torch.cuda.graph after three eager warm-ups, torch.compile(mode="reduce-overhead")).
# Each world runs twice: the stand-in alone (LD_PRELOAD of it, so PyTorch loads no other NCCL), and
# libmagice.so in front of it; every program's saved results must be bitwise equal between the two,
# rank by rank (compare_results.py), and each program checks its own results too. The share of
# gathers the library moved is read from its end-of-communicator lines (MAGI_LOG=INFO: "A of B
# all-gathers (...) served off NCCL"), and of the gathers captured into graphs from the traces
# (with MAGI_CE_FORCE=1 in TORCH_STANDIN_MAGI, torch.cuda.graph's must move, 90 % at least). Each
# world also runs torch.cuda.graph with wide layers (shards of 1 MiB and more) under the library's
# default settings: agreed at the capture by the size rule, 90 % moved. A run that cannot start is a FAIL with the end of its log;
# a program this PyTorch cannot run ("unavailable") is a SKIP with the reason.
# Environment (all optional):
#   TORCH_STANDIN_WORLDS  the world sizes (default "2 4 8"; empty: none, the machines job alone)
#   TORCH_STANDIN_MAGI    more KEY=VALUE settings of the library for the runs with it
#   PYTHON                the interpreter that holds PyTorch (default python3)
#   TORCH_STANDIN_WRAPPER a command each rank runs under (as_machines.sh: ranks on "machines")

# torch_standin_launch NAME WORLD SIDE PROGRAMS LIMIT_S [ARGS...]: one job of WORLD ranks
# (torchrun, started as "$python -m torch.distributed.run") running PROGRAMS with the script's
# ARGS; SIDE "plain" (the stand-in alone), "magi" (the library in front with TORCH_STANDIN_MAGI,
# logging at INFO, a trace per rank) or "magi-defaults" (the same without TORCH_STANDIN_MAGI).
# Only the ranks get the preloads (torchrun --no-python runs `env ... python3 SCRIPT`). Output in
# $work/NAME/log, the exit status in $work/NAME/rc (124: past LIMIT_S), results in $work/NAME/out.
torch_standin_launch() {
  local name=$1 world=$2 side=$3 programs=$4 limit=$5
  shift 5
  local dir="$work/$name" standin="$build/tests/support/libnccl.so.2"
  mkdir -p "$dir/trace" "$dir/out"
  local envs=(TORCH_STANDIN_NCCL="$standin")
  # Inductor says why it skips its CUDA graphs only among its performance hints.
  [ "$programs" = compile ] && envs+=(TORCH_LOGS=perf_hints)
  if [ "$side" != plain ]; then
    envs+=(LD_PRELOAD="$build/libmagice.so $standin" MAGI_LOG=INFO MAGI_TRACE_DIR="$dir/trace")
    # shellcheck disable=SC2206  # the settings, word by word
    [ "$side" = magi ] && [ -n "${TORCH_STANDIN_MAGI:-}" ] && envs+=($TORCH_STANDIN_MAGI)
  else
    envs+=(LD_PRELOAD="$standin")
  fi
  local began=$SECONDS
  (
    cd "$here" || exit 2
    timeout -k 20 "$limit" "$torch_python" -m torch.distributed.run --standalone \
      --nproc_per_node "$world" --no_python env "${envs[@]}" \
      ${TORCH_STANDIN_WRAPPER:+"$TORCH_STANDIN_WRAPPER"} "$torch_python" \
      "$here/torch_standin.py" --out "$dir/out" --programs "$programs" "$@" >"$dir/log" 2>&1
  )
  echo $? >"$dir/rc"
  echo $((SECONDS - began)) >"$dir/seconds"
}

# torch_standin_ran NAME WHAT: PASS when the job exited 0; else FAIL with why and the end of its log.
torch_standin_ran() {
  local name=$1 what=$2 rc took
  rc=$(cat "$work/$name/rc" 2>/dev/null || echo "?")
  took=$(cat "$work/$name/seconds" 2>/dev/null || echo "?")
  grep "^torch_standin: " "$work/$name/log" | sed 's/^/  /'
  if [ "$rc" = 0 ]; then
    pass "$name: $what ($took s)"
    return 0
  fi
  local why="exit $rc"
  [ "$rc" = 124 ] && why="timed out after $took s"
  fail "$name: $what ($why)"
  grep -E "FAILED|Error|error|standin: " "$work/$name/log" | grep -v "^torch_standin: world" |
    head -n 12 | sed 's/^/  /'
  tail -n 8 "$work/$name/log" | sed 's/^/  /'
  return 1
}

# torch_standin_compare WORLD PROGRAM PLAIN MAGI: the program's results of every rank bitwise
# equal between the two jobs; a SKIP when the program said it is unavailable.
torch_standin_compare() {
  local world=$1 program=$2 plain=$3 magi=$4 r unequal="" line
  line=$(grep -m 1 "^torch_standin: world $world: $program: unavailable: " "$work/$plain/log" 2>/dev/null)
  if [ -n "$line" ]; then
    skip "torch-standin-$world $program: ${line#*unavailable: }"
    return
  fi
  for r in $(seq 0 $((world - 1))); do
    if ! "$torch_python" "$here/compare_results.py" "$work/$plain/out/$program.rank$r.pt" \
      "$work/$magi/out/$program.rank$r.pt" >"$work/$magi/compare-$program-$r" 2>&1; then
      unequal="$unequal $r"
    fi
  done
  if [ -z "$unequal" ]; then
    pass "torch-standin-$world $program: bitwise equal with and without the library ($world ranks)"
  else
    fail "torch-standin-$world $program: bitwise equal with and without the library (ranks$unequal differ or lack results)"
    tail -n 3 "$work/$magi/compare-$program-${unequal%% *}" 2>/dev/null |
      sed 's/^/  /'
  fi
}

# torch_standin_moved WORLD NAME...: the share of all-gathers the library served off NCCL, summed
# over the end-of-communicator lines of every rank of the jobs named; a FAIL when the library
# wrote no line at all (it was not loaded, or never saw a gather).
torch_standin_moved() {
  local world=$1
  shift
  local logs=() name
  for name in "$@"; do logs+=("$work/$name/log"); done
  local counts
  counts=$(sed -nE 's/.* MAGI INFO .* ([0-9]+) of ([0-9]+) all-gathers \(.*\) served off NCCL.*/\1 \2/p' \
    "${logs[@]}" 2>/dev/null | awk '{m += $1; g += $2; n++} END {if (n) printf "%d %d %d\n", m, g, n}')
  if [ -z "$counts" ]; then
    fail "torch-standin-$world: the library's end-of-communicator lines (MAGI_LOG=INFO: \"... served off NCCL\")"
    return
  fi
  local moved gathers lines
  read -r moved gathers lines <<<"$counts"
  pass "torch-standin-$world: the library moved $moved of $gathers all-gathers off NCCL ($((gathers ? 100 * moved / gathers : 0))%; $lines end-of-communicator lines)"
  grep -h -m 2 "captured into a CUDA graph" "${logs[@]}" 2>/dev/null | sed 's/^/  /'
}

# torch_standin_captured WORLD NAME [MIN_PERCENT]: of the all-gathers captured into CUDA graphs
# (flag C in the traces of every rank of job NAME), how many moved: every replay takes its
# capture's route, so this is the share of replayed gathers moved. A SKIP where nothing was
# captured; a FAIL below MIN_PERCENT where one is given.
torch_standin_captured() {
  local world=$1 name=$2 least=${3:-0} captured moved
  read -r captured moved < <(traced_captured "$name")
  if [ "$captured" = 0 ]; then
    skip "torch-standin-$world: no all-gather was captured into a CUDA graph (traces of $name)"
    return
  fi
  local what="$name: $moved of $captured all-gathers captured into CUDA graphs moved ($((100 * moved / captured))%), at every replay"
  if [ $((moved * 100)) -ge $((captured * least)) ]; then
    pass "$what${3:+ (>= $least % wanted)}"
  else
    fail "$what (>= $least % wanted)"
    grep -h -E " MAGI (INFO|WARN) .*(capture|served off)" "$work/$name/log" | head -n 6 |
      sed 's/^/  /'
  fi
}

# torch_standin_graph_defaults WORLD: torch.cuda.graph after three warm-ups with layers of
# 2048 x 2048 floats (shards of 16 MiB / WORLD) and the library's default settings: the plan is
# agreed at the capture, untimed (the size rule moves shards of 1 MiB and more), and at least 90 %
# of the replayed gathers move, every replay bitwise equal to the stand-in's alone.
torch_standin_graph_defaults() {
  local world=$1 side
  for side in plain magi-defaults; do
    torch_standin_launch "torch-standin-$world-$side-wide" "$world" "$side" graph 240 --hidden 2048
    torch_standin_ran "torch-standin-$world-$side-wide" \
      "graph with 2048-wide layers ran, $world ranks on one GPU$([ $side != plain ] && echo ", the library in front with its defaults")"
  done
  torch_standin_compare "$world" graph "torch-standin-$world-plain-wide" \
    "torch-standin-$world-magi-defaults-wide"
  torch_standin_captured "$world" "torch-standin-$world-magi-defaults-wide" 90
  grep -h -m 1 "agreed at a CUDA graph capture" "$work/torch-standin-$world-magi-defaults-wide/log" |
    sed 's/^/  /'
}

# torch_standin_machines: FSDP2, DTensor and torch.cuda.graph at world 4 with its ranks made to
# look like two machines of two (a, a, b, b: as_machines.sh), MAGI_CE_FORCE=1: the moved gathers
# run in two levels (NCCL between machines on the sub-communicator, the copy engines inside),
# bitwise equal to the stand-in alone; the share of captured gathers moved is said.
torch_standin_machines() {
  local side
  for side in plain magi; do
    AS_MACHINES=a,a,b,b TORCH_STANDIN_WRAPPER="$here/as_machines.sh" \
      TORCH_STANDIN_MAGI="MAGI_CE_FORCE=1" \
      torch_standin_launch "torch-standin-machines-$side" 4 "$side" fsdp2,dtensor,graph 240
    torch_standin_ran "torch-standin-machines-$side" \
      "fsdp2, dtensor and graph ran, 4 ranks as 2 x 2 machines$([ $side = magi ] && echo ", the library in front")"
  done
  local program
  for program in fsdp2 dtensor graph; do
    torch_standin_compare 4 "$program" torch-standin-machines-plain torch-standin-machines-magi
  done
  if grep -q "each moved gather runs in two levels" "$work/torch-standin-machines-magi/log"; then
    pass "torch-standin-machines: the moved gathers ran in two levels (the log says so)"
  else
    fail "torch-standin-machines: the moved gathers ran in two levels (no such line in the log)"
    grep -h -E " MAGI (WARN|INFO) .*(round|stays|two levels)" \
      "$work/torch-standin-machines-magi/log" | head -n 6 | sed 's/^/  /'
  fi
  torch_standin_moved 4 torch-standin-machines-magi
  torch_standin_captured 4 torch-standin-machines-magi
}

torch_standin_runs() {
  torch_python=${PYTHON:-python3}
  local worlds=${TORCH_STANDIN_WORLDS-2 4 8}
  if [ ! -e "$build/tests/support/libnccl.so.2" ] || [ ! -e "$build/libmagice.so" ]; then
    fail "torch-standin: the stand-in or the library is missing in $build (make all $build/tests/support/libnccl.so.2)"
    return
  fi
  local version
  if ! version=$("$torch_python" -c 'import torch; assert torch.cuda.is_available(), "no CUDA"; print(torch.__version__)' 2>&1); then
    fail "torch-standin: PyTorch with CUDA is not importable by $torch_python: $(tail -n 1 <<<"$version")"
    return
  fi
  echo "  PyTorch $version; worlds $worlds"
  # A slow rank (one compiling) keeps its peers waiting in a collective: the stand-in gives up
  # after STANDIN_TIMEOUT_S, well inside each job's limit. Pinned staging: only faster.
  local saved_timeout=${STANDIN_TIMEOUT_S:-}
  export STANDIN_TIMEOUT_S=120 STANDIN_PINNED_STAGING=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 \
    PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=1
  # One cache for both sides, so the run with the library compiles nothing anew: the same kernels.
  export TORCHINDUCTOR_CACHE_DIR="$work/inductor-cache"
  local world side program
  for world in $worlds; do
    echo "== PyTorch over the stand-in, world $world on one GPU"
    for side in plain magi; do
      torch_standin_launch "torch-standin-$world-$side" "$world" "$side" fsdp2,dtensor,graph 240
      torch_standin_ran "torch-standin-$world-$side" \
        "fsdp2, dtensor and graph ran, $world ranks on one GPU$([ $side = magi ] && echo ", the library in front")"
      torch_standin_launch "torch-standin-$world-$side-compile" "$world" "$side" compile 300
      torch_standin_ran "torch-standin-$world-$side-compile" \
        "compile ran, $world ranks on one GPU$([ $side = magi ] && echo ", the library in front")"
    done
    for program in fsdp2 dtensor graph; do
      torch_standin_compare "$world" "$program" "torch-standin-$world-plain" "torch-standin-$world-magi"
    done
    torch_standin_compare "$world" compile "torch-standin-$world-plain-compile" \
      "torch-standin-$world-magi-compile"
    if grep -q "cudagraphs skipped" "$work/torch-standin-$world-plain-compile/log" 2>/dev/null; then
      skip "torch-standin-$world compile: Inductor skipped its CUDA graphs, so no collective was captured: $(grep -m 1 -o "skipping cudagraphs due to.*" "$work/torch-standin-$world-plain-compile/log" || grep -m 1 -o "cudagraphs skipped.*" "$work/torch-standin-$world-plain-compile/log")"
    fi
    torch_standin_moved "$world" "torch-standin-$world-magi" "torch-standin-$world-magi-compile"
    # With MAGI_CE_FORCE=1 every captured gather of torch.cuda.graph must move.
    local least=""
    [[ " ${TORCH_STANDIN_MAGI:-} " == *" MAGI_CE_FORCE=1 "* ]] && least=90
    torch_standin_captured "$world" "torch-standin-$world-magi" $least
    torch_standin_captured "$world" "torch-standin-$world-magi-compile"
    torch_standin_graph_defaults "$world"
  done
  echo "== PyTorch over the stand-in, world 4 as two machines of two"
  torch_standin_machines
  if [ -n "$saved_timeout" ]; then export STANDIN_TIMEOUT_S=$saved_timeout; else unset STANDIN_TIMEOUT_S; fi
  unset STANDIN_PINNED_STAGING TORCHINDUCTOR_CACHE_DIR TORCHINDUCTOR_COMPILE_THREADS
}
