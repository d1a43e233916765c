# shellcheck shell=bash disable=SC2154  # build, here, work, pass, fail, skip: from run.sh
# Sourced by tests/gpu/run.sh (under MPS, started there): unmodified PyTorch at world 2, 4 and 8 on
# ONE GPU with the NCCL stand-in as its NCCL (tests/gpu/torch_standin.py: FSDP2 inference, DTensor
# full_tensor(), torch.cuda.graph after three eager warm-ups, torch.compile(mode="reduce-overhead")).
# Each world runs twice: the stand-in alone (LD_PRELOAD of it, so PyTorch loads no other NCCL), and
# libmagice.so in front of it; every program's saved results must be bitwise equal between the two,
# rank by rank (compare_results.py), and each program checks its own results too. The share of
# gathers the library moved is read from its end-of-communicator lines (MAGI_LOG=INFO: "A of B
# all-gathers (...) served off NCCL"). A run that cannot start is a FAIL with the end of its log;
# a program this PyTorch cannot run ("unavailable") is a SKIP with the reason.
# Environment (all optional):
#   TORCH_STANDIN_WORLDS  the world sizes (default "2 4 8")
#   TORCH_STANDIN_MAGI    more KEY=VALUE settings of the library for the runs with it
#   PYTHON                the interpreter that holds PyTorch (default python3)

# torch_standin_launch NAME WORLD SIDE PROGRAMS LIMIT_S: one job of WORLD ranks (torchrun, started
# as "$python -m torch.distributed.run") running PROGRAMS; SIDE "plain" (the stand-in alone) or
# "magi" (the library in front, logging at INFO, a trace per rank). Only the ranks get the
# preloads (torchrun --no-python runs `env ... python3 SCRIPT`). Output in $work/NAME/log, the
# exit status in $work/NAME/rc (124: past LIMIT_S), results in $work/NAME/out.
torch_standin_launch() {
  local name=$1 world=$2 side=$3 programs=$4 limit=$5
  local dir="$work/$name" standin="$build/tests/support/libnccl.so.2"
  mkdir -p "$dir/trace" "$dir/out"
  local envs=(TORCH_STANDIN_NCCL="$standin")
  # Inductor says why it skips its CUDA graphs only among its performance hints.
  [ "$programs" = compile ] && envs+=(TORCH_LOGS=perf_hints)
  if [ "$side" = magi ]; then
    envs+=(LD_PRELOAD="$build/libmagice.so $standin" MAGI_LOG=INFO MAGI_TRACE_DIR="$dir/trace")
    # shellcheck disable=SC2206  # the settings, word by word
    [ -n "${TORCH_STANDIN_MAGI:-}" ] && envs+=($TORCH_STANDIN_MAGI)
  else
    envs+=(LD_PRELOAD="$standin")
  fi
  local began=$SECONDS
  (
    cd "$here" || exit 2
    timeout -k 20 "$limit" "$torch_python" -m torch.distributed.run --standalone \
      --nproc_per_node "$world" --no_python env "${envs[@]}" "$torch_python" \
      "$here/torch_standin.py" --out "$dir/out" --programs "$programs" >"$dir/log" 2>&1
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

# torch_standin_captured WORLD NAME...: of the all-gathers captured into CUDA graphs (flag C in
# the traces of every rank of the jobs named), how many moved: every replay takes its capture's
# route, so this is the share of replayed gathers moved. A SKIP where nothing was captured.
torch_standin_captured() {
  local world=$1
  shift
  local name t captured=0 moved=0 c m
  for name in "$@"; do
    for t in "$work/$name"/trace/*.trace; do
      [ -e "$t" ] || continue
      read -r c m < <("$build/magice-trace" dump "$t" 2>/dev/null |
        awk 'length($1) == 12 && $2 ~ /^[0-9]+$/ && $3 == "AllGather" && $10 ~ /C/ {
          c++; if ($NF == "moved") m++ } END { print c + 0, m + 0 }')
      captured=$((captured + c))
      moved=$((moved + m))
    done
  done
  if [ "$captured" = 0 ]; then
    skip "torch-standin-$world: no all-gather was captured into a CUDA graph (traces of $*)"
    return
  fi
  pass "torch-standin-$world: $moved of $captured all-gathers captured into CUDA graphs moved ($((100 * moved / captured))%), at every replay"
}

torch_standin_runs() {
  torch_python=${PYTHON:-python3}
  local worlds=${TORCH_STANDIN_WORLDS:-2 4 8}
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
    torch_standin_captured "$world" "torch-standin-$world-magi" "torch-standin-$world-magi-compile"
  done
  if [ -n "$saved_timeout" ]; then export STANDIN_TIMEOUT_S=$saved_timeout; else unset STANDIN_TIMEOUT_S; fi
  unset STANDIN_PINNED_STAGING TORCHINDUCTOR_CACHE_DIR TORCHINDUCTOR_COMPILE_THREADS
}
