#!/usr/bin/env bash
# The multi-GPU correctness runs (issue 5) with real NCCL, one process per GPU under torchrun,
# each without and with the shim. Prints PASS/FAIL/SKIP lines and a closing
# "multi: N passed, M failed, K skipped" (tests/gpu/verdict.sh), its only verdict.
# Usage: tests/gpu/multi/run.sh BUILD_DIR   (needs libmagice.so and magice-trace in BUILD_DIR)
# Environment (all optional):
#   MULTI_NPROC     ranks (default: the GPUs nvidia-smi lists)
#   MULTI_MAX_MIB   largest per-rank all-gather of allgather_check (default 1024)
#   MULTI_STEPS     steps per size / inference steps (default 32)
#   MULTI_JOBS      runs at once (default 1; more only where they share GPUs harmlessly, N = 1)
#   MULTI_TIMEOUT_S each run's limit (default 1200): a hang fails its check instead of stalling
#   MULTI_KEEP      keep every run's log and traces in this directory (default: a temporary one)
#   TORCHRUN, PYTHON  the launcher and the interpreter that holds PyTorch
set -u
build=$(cd "${1:-build}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "${MULTI_KEEP:-}" ]; then
  work=$(mkdir -p "$MULTI_KEEP" && cd "$MULTI_KEEP" && pwd)
else
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fi
# shellcheck source=tests/gpu/verdict.sh
. "$here/../verdict.sh"

for f in libmagice.so magice-trace; do
  [ -e "$build/$f" ] || { echo "no $build/$f: build it (make BUILD=$build all)"; exit 2; }
done
# NVLink multicast stays off: a program that uses it can take a shared host's GPUs down.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
n=${MULTI_NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
max_mib=${MULTI_MAX_MIB:-1024}
steps=${MULTI_STEPS:-32}
jobs=${MULTI_JOBS:-1}
limit=${MULTI_TIMEOUT_S:-1200}
torchrun=${TORCHRUN:-torchrun}
python=${PYTHON:-python3}
tool="$build/magice-trace"
[ "$n" -ge 1 ] || { fail "multi: no GPU"; closing_line multi; exit; }
echo "multi: $n rank(s), all-gathers up to $max_mib MiB per rank, $steps steps, $jobs run(s) at once"

# start NAME SHIM(0|1) [VAR=VALUE...] -- SCRIPT ARGS...: one torchrun job in the background.
# Only the ranks get the shim (torchrun --no-python runs `env ... python3 SCRIPT`), with its
# decisions logged and a trace per rank in $work/NAME/trace; its exit status lands in
# $work/NAME/rc, its output in $work/NAME/log.
start() {
  local name=$1 shim=$2
  shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local dir="$work/$name" script="$here/$1"
  shift
  mkdir -p "$dir/trace"
  [ "$shim" = 1 ] && envs+=(LD_PRELOAD="$build/libmagice.so" MAGI_LOG=INFO MAGI_TRACE_DIR="$dir/trace")
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  (
    cd "$here" || exit 2
    local began=$SECONDS
    if [ "$(basename "$script")" = killed_rank.py ]; then
      # Its own launcher: torchrun would tear the survivors down itself when the victim dies.
      timeout -k 30 "$limit" env ${envs[@]+"${envs[@]}"} "$python" "$script" --nproc "$n" "$@" \
        >"$dir/log" 2>&1
    else
      timeout -k 30 "$limit" "$torchrun" --standalone --nproc_per_node "$n" --no_python \
        env ${envs[@]+"${envs[@]}"} "$python" "$script" "$@" >"$dir/log" 2>&1
    fi
    echo $? >"$dir/rc"
    echo $((SECONDS - began)) >"$dir/seconds"
  ) &
}

# ran NAME WHAT: PASS when the job exited 0 (with how long it ran); else FAIL with the end of
# its log. What the job itself skipped (allgather_check's datatypes this PyTorch cannot fill or
# hand to NCCL: "  SKIP float8_e5m2: ...") is counted too, one SKIP each.
ran() {
  local rc took line
  rc=$(cat "$work/$1/rc" 2>/dev/null || echo "?")
  took=$(cat "$work/$1/seconds" 2>/dev/null || echo "?")
  grep -E "^(allgather_check|fsdp_infer|two_comms|killed_rank):|WRONG|DIFFERS" "$work/$1/log" | sed 's/^/  /' | head -20
  while IFS= read -r line; do skip "$1: ${line#  SKIP }"; done < <(grep "^  SKIP " "$work/$1/log")
  if [ "$rc" = 0 ]; then pass "$1: $2 ($took s)"; return 0; fi
  case $rc in 124|137) rc="$rc (timed out after $limit s)" ;; esac
  fail "$1: $2 (exit $rc, $took s)"
  grep -v " MAGI INFO " "$work/$1/log" | grep -v "^  *File \|^  *\^" | tail -n 15 | sed 's/^/  /'
  # What the shim did last, for a run that hung (its rounds and routes, rank by rank).
  grep " MAGI " "$work/$1/log" | grep -v " CAPTURE " | tail -n 12 | sed 's/^/  last: /'
  return 1
}

# traced NAME WHAT [trace_check options]: the traces say what the shim did, the same on every rank.
traced() {
  local name=$1 what=$2
  shift 2
  if "$python" "$here/trace_check.py" "$tool" "$work/$name/trace" "$@" >"$work/$name/check" 2>&1; then
    pass "$name: $what"
  else
    fail "$name: $what"
  fi
  sed 's/^/  /' "$work/$name/check"
}

# bitwise NAME_A NAME_B WHAT: every rank's saved outputs are the same bytes in both runs.
bitwise() {
  local r bad=0
  for ((r = 0; r < n; r++)); do
    "$python" "$here/../compare_results.py" "$work/$1/out/rank$r.pt" "$work/$2/out/rank$r.pt" \
      >"$work/$2/compare.$r" 2>&1 || bad=1
  done
  if [ $bad = 0 ]; then pass "$3"; else fail "$3"; cat "$work/$2"/compare.* | sed 's/^/  /'; fi
}

# The shim's expected agreement mode when odd ranks differ from even ones: none differ at N = 1.
skewed() { if [ "$n" -ge 2 ]; then echo "$1"; else echo identical; fi; }

agc=(allgather_check.py --max-mib "$max_mib" --steps "$steps")
small=(allgather_check.py --max-mib 4 --dtypes "float32,bfloat16" --steps "$steps")
infer=(fsdp_infer.py --steps "$steps")
force=MAGI_CE_FORCE=1  # every agreed gather moves: no trial that could keep NCCL for it

start agc-nccl 0 -- "${agc[@]}"
start agc-shim 1 "$force" -- "${agc[@]}"
start agc-shim-static 1 "$force" MAGI_STATIC_WEIGHTS=1 -- "${agc[@]}" --static
start agc-skew-callsite 1 "$force" -- "${small[@]}" --skew callsite
start agc-skew-grouping 1 "$force" -- "${small[@]}" --skew grouping
# The same skews without the shim: a program NCCL itself cannot run is not the shim's failure.
start agc-skew-callsite-nccl 0 -- "${small[@]}" --skew callsite
start agc-skew-grouping-nccl 0 -- "${small[@]}" --skew grouping
start fsdp-nccl 0 -- "${infer[@]}" --out "$work/fsdp-nccl/out"
start fsdp-shim 1 -- "${infer[@]}" --out "$work/fsdp-shim/out"
start fsdp-shim-static 1 MAGI_STATIC_WEIGHTS=1 -- "${infer[@]}" --out "$work/fsdp-shim-static/out"
start fsdp-manual-nccl 0 -- "${infer[@]}" --sharding manual --out "$work/fsdp-manual-nccl/out"
start fsdp-manual-shim 1 -- "${infer[@]}" --sharding manual --out "$work/fsdp-manual-shim/out"
start fsdp-manual-shim-static 1 MAGI_STATIC_WEIGHTS=1 -- "${infer[@]}" --sharding manual \
  --out "$work/fsdp-manual-shim-static/out"
start two-comms-nccl 0 -- two_comms.py --steps "$steps"
start two-comms-shim 1 -- two_comms.py --steps "$steps"
# A rank SIGKILLed with gathers moving, under PyTorch's watchdog: 1 aborts the communicators and
# ends the process, 2 only aborts them (the blocked main thread must come free). At one rank
# there is no one to kill: the same program runs through once, as a check of the launcher.
kill_args=(killed_rank.py --steps 24 --kill-step 16 --watchdog-s 20 --deadline-s 120)
[ "$n" -ge 2 ] || kill_args+=(--no-kill)
# The launcher checked on its own, two ranks over gloo on the CPU (no NCCL, no shim): survivors
# that gloo frees must count as ended, and survivors that outlive the deadline as HUNG.
start killed-rank-selfcheck-ends 0 -- killed_rank.py --cpu --nproc 2 --steps 24 --kill-step 16 \
  --watchdog-s 10 --deadline-s 60
start killed-rank-selfcheck-hang 0 -- killed_rank.py --cpu --nproc 2 --steps 24 --kill-step 16 \
  --watchdog-s 10 --deadline-s 10 --linger-s 120
for handling in 1 2; do
  start "killed-rank-$handling-nccl" 0 TORCH_NCCL_ASYNC_ERROR_HANDLING=$handling -- "${kill_args[@]}"
  start "killed-rank-$handling-shim" 1 "$force" TORCH_NCCL_ASYNC_ERROR_HANDLING=$handling -- \
    "${kill_args[@]}"
done
wait

echo "== 1. all-gather, every datatype and size, in place and out of place"
ran agc-nccl "NCCL alone: 0 wrong elements"
ran agc-shim "under the shim: 0 wrong elements" && \
  traced agc-shim "gathers agreed (identical) and served off NCCL" --moved --mode identical
ran agc-shim-static "static weights under the shim: 0 wrong elements" && \
  traced agc-shim-static "static weights: gathers served off NCCL" --moved
ran agc-skew-callsite-nccl "NCCL alone, odd ranks gather from another call site: 0 wrong elements"
ran agc-skew-grouping-nccl "NCCL alone, even ranks group their gathers: 0 wrong elements"
ran agc-skew-callsite "odd ranks gather from another call site: 0 wrong elements" && \
  traced agc-skew-callsite "call sites differ: agreement by $(skewed slot)" --mode "$(skewed slot)"
ran agc-skew-grouping "even ranks group their gathers: 0 wrong elements" && \
  traced agc-skew-grouping "grouping differs: agreement reaches $(skewed abort)" --mode "$(skewed abort)"

echo "== 2. FSDP inference through unmodified PyTorch"
# moved RUN WHAT: the trace check that gathers left NCCL. FSDP2 at world size 1 issues no
# all-gather at all (NCCL sees none), so there it has nothing to check.
moved() {
  if [ "$n" = 1 ] && [[ $1 != fsdp-manual-* ]]; then
    skip "$1: $2 (FSDP2 issues no all-gather at world size 1)"
  else
    traced "$1" "$2" --moved
  fi
}
for kind in fsdp fsdp-manual; do
  ran "$kind-nccl" "inference without the shim"
  if ran "$kind-shim" "inference under the shim"; then
    moved "$kind-shim" "the trace shows gathers moved off NCCL"
    bitwise "$kind-nccl" "$kind-shim" "$kind: outputs bitwise equal with and without the shim"
  fi
  if ran "$kind-shim-static" "inference under the shim, static weights"; then
    moved "$kind-shim-static" "static weights: gathers moved"
    bitwise "$kind-nccl" "$kind-shim-static" "$kind static weights: outputs bitwise equal with and without the shim"
  fi
done
for run in fsdp-shim fsdp-manual-shim; do
  traces=$(find "$work/$run/trace" -name '*.trace' 2>/dev/null | sort)
  [ -n "$traces" ] || continue
  echo "  magice-trace decisions ($run), first lines:"
  # shellcheck disable=SC2086  # one trace per rank
  "$tool" decisions $traces 2>&1 | head -n 8 | sed 's/^/    /'
done

echo "== 3. a whole-node communicator and 2-GPU splits at once"
ran two-comms-nccl "NCCL alone: 0 wrong"
ran two-comms-shim "under the shim: 0 wrong" && \
  traced two-comms-shim "both communicators agreed on their own, gathers moved" --comms 2 --moved

echo "== 4. a rank killed while gathers move (its own launcher, not torchrun)"
ran killed-rank-selfcheck-ends "the launcher: survivors that end are seen to end (gloo, 2 ranks)"
if [ "$(cat "$work/killed-rank-selfcheck-hang/rc" 2>/dev/null)" = 1 ] &&
   grep -q "HUNG" "$work/killed-rank-selfcheck-hang/log"; then
  pass "killed-rank-selfcheck-hang: the launcher: a survivor past the deadline is HUNG (gloo, 2 ranks)"
else
  fail "killed-rank-selfcheck-hang: the launcher: a survivor past the deadline is HUNG (gloo, 2 ranks)"
  tail -n 8 "$work/killed-rank-selfcheck-hang/log" | sed 's/^/  /'
fi
victim=$([ "$n" -ge 2 ] && echo "rank $((n - 1)) SIGKILLed at step 16" || echo "no victim at one rank")
for handling in 1 2; do
  what="TORCH_NCCL_ASYNC_ERROR_HANDLING=$handling, $victim"
  ran "killed-rank-$handling-nccl" "NCCL alone, $what: every survivor ends"
  if ran "killed-rank-$handling-shim" "under the shim, $what: every survivor ends"; then
    # The check means something only if the transport held the gathers when the peer died.
    if grep -q " REWRITE .*moving [1-9]" "$work/killed-rank-$handling-shim/log"; then
      pass "killed-rank-$handling-shim: gathers had moved off NCCL before the kill"
    else
      fail "killed-rank-$handling-shim: gathers had moved off NCCL before the kill"
    fi
  fi
done

echo "multi: $SECONDS s in all, with up to $jobs run(s) at once"
closing_line multi
