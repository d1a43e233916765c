#!/usr/bin/env bash
# The multi-GPU benchmarks (issue 5): all-gather bandwidth against size, GEMM interference and
# the FSDP inference step, NCCL against the shim, one torchrun process per configuration and
# repetition, configurations interleaved (their order rotates each repetition); then NCCL's own
# copy-engine path (nccl_ce_allgather.cc, built here with nvcc). Writes CSVs, results.md
# (markdown tables) and PNG plots into OUT_DIR, per-run logs into OUT_DIR/logs.
# Usage: tools/bench/multi/run.sh LIB_DIR OUT_DIR   (LIB_DIR holds libmagice.so)
# Environment (all optional):
#   BENCH_NPROC     ranks (default: the GPUs nvidia-smi lists)
#   BENCH_REPS      repetitions (default 5)
#   BENCH_MIN_KIB, BENCH_MAX_MIB   all-gather sizes per rank, by powers of 4 (default 4 KiB .. 1 GiB)
#   BENCH_CONFIGS   all-gather configurations (default "nccl shim shim_static torch_lc"; also
#                   shim_force: the shim with MAGI_CE_FORCE=1, every agreed gather moved;
#                   shim_nocallsite: the shim with MAGI_CALLSITES=0, what call sites cost)
#   BENCH_PARTS     which parts (default "allgather ce gemm fsdp")
#   BENCH_TIMEOUT_S each run's limit (default 900)
#   BENCH_GEMM_ARGS, BENCH_FSDP_ARGS   extra arguments for gemm_interference.py / fsdp_step.py
#   TORCHRUN, PYTHON, NVCC
set -u
lib=$(cd "${1:?usage: run.sh LIB_DIR OUT_DIR}" && pwd)
mkdir -p "${2:?usage: run.sh LIB_DIR OUT_DIR}/logs"
out=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$lib/libmagice.so" ] || { echo "no $lib/libmagice.so"; exit 2; }
# NVLink multicast stays off: a program that uses it can take a shared host's GPUs down.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
n=${BENCH_NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
reps=${BENCH_REPS:-5}
min_kib=${BENCH_MIN_KIB:-4}
max_mib=${BENCH_MAX_MIB:-1024}
read -r -a configs <<<"${BENCH_CONFIGS:-nccl shim shim_static torch_lc}"
parts=" ${BENCH_PARTS:-allgather ce gemm fsdp} "
limit=${BENCH_TIMEOUT_S:-900}
torchrun=${TORCHRUN:-torchrun}
python=${PYTHON:-python3}
notes="$out/notes.txt"
failures=0
echo "bench multi: $n rank(s), $reps repetition(s), $(date -u +%FT%TZ)" | tee "$notes"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /' | tee -a "$notes"

# The environment of each configuration: the shim's options are read once per process.
config_env() {
  case $1 in
    nccl | torch_lc) ;;
    shim) echo "LD_PRELOAD=$lib/libmagice.so MAGI_LOG=INFO" ;;
    shim_force) echo "LD_PRELOAD=$lib/libmagice.so MAGI_LOG=INFO MAGI_CE_FORCE=1" ;;
    shim_nocallsite) echo "LD_PRELOAD=$lib/libmagice.so MAGI_LOG=INFO MAGI_CALLSITES=0" ;;
    shim_static) echo "LD_PRELOAD=$lib/libmagice.so MAGI_LOG=INFO MAGI_STATIC_WEIGHTS=1" ;;
    *) echo "unknown configuration $1" >&2; return 1 ;;
  esac
}

# bench SCRIPT CONFIG REP [ARGS...]: one process per rank, the shim only in the ranks.
bench() {
  local script=$1 config=$2 rep=$3
  shift 3
  local log="$out/logs/${script%.py}.$config.$rep.log" envs
  envs=$(config_env "$config") || return 1
  # shellcheck disable=SC2086  # the configuration's VAR=VALUE words
  timeout -k 30 "$limit" "$torchrun" --standalone --nproc_per_node "$n" --no_python \
    env $envs "$python" "$here/$script" --config "$config" --rep "$rep" \
    --csv "$out/${script%.py}.csv" "$@" >"$log" 2>&1
  local rc=$?
  grep -E "^(allgather_bw|gemm_interference|fsdp_step) " "$log" | head -1
  if [ $rc != 0 ]; then
    failures=$((failures + 1))
    echo "FAILED: $script $config rep $rep (exit $rc), see logs/$(basename "$log")" | tee -a "$notes"
    grep -v " MAGI INFO " "$log" | tail -n 8 | sed 's/^/  /'
  fi
  # What the shim did: its agreement rounds, and what each cost round measured and chose (rank
  # 0's log; every rank reads the same round), as its log states them.
  if [ -n "$envs" ]; then
    echo "$script $config rep $rep: $(grep -c 'REWRITE.*moving' "$log") round(s) moved gathers;" \
      "$(grep -c '\[0\] MAGI INFO REWRITE .* -> NCCL' "$log") of rank 0's cost rounds keep a bucket on NCCL" >>"$notes"
    grep "\[0\] MAGI INFO REWRITE .*cost on the slowest rank" "$log" | sed 's/.*REWRITE /  /' >>"$notes"
  fi
}

# interleave SCRIPT CONFIG... -- ARGS...: every repetition runs every configuration, in an order
# that rotates, so that no configuration always runs first or last.
interleave() {
  local script=$1 list=()
  shift
  while [ "$1" != "--" ]; do list+=("$1"); shift; done
  shift
  local rep i k=${#list[@]}
  for ((rep = 1; rep <= reps; rep++)); do
    for ((i = 0; i < k; i++)); do
      local c=${list[$(((i + rep - 1) % k))]}
      if [ "$c" = torch_lc ]; then
        bench "$script" "$c" "$rep" "$@" --method torch_lc
      else
        bench "$script" "$c" "$rep" "$@"
      fi
    done
  done
}

no_lc=()
for c in "${configs[@]}"; do [ "$c" = torch_lc ] || no_lc+=("$c"); done

if [[ $parts == *" allgather "* ]]; then
  echo "== all-gather bandwidth: ${configs[*]}"
  interleave allgather_bw.py "${configs[@]}" -- --min-kib "$min_kib" --max-mib "$max_mib"
fi

if [[ $parts == *" ce "* ]]; then
  echo "== NCCL's own paths: ring, symmetric kernels, copy engine (CTA policy zero)"
  # The headers and library of one NCCL: PyTorch's (pip) first, then the system's.
  pip_nccl=$("$python" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
  inc="" libdir=""
  for prefix in $pip_nccl /usr /usr/local/cuda; do
    [ -f "$prefix/include/nccl.h" ] || continue
    for d in "$prefix/lib" "$prefix/lib64" /usr/lib/x86_64-linux-gnu; do
      if ls "$d"/libnccl.so* >/dev/null 2>&1; then inc="$prefix/include"; libdir=$d; break 2; fi
    done
  done
  if [ -z "$inc" ]; then
    echo "SKIP nccl_ce: no NCCL headers with a library found" | tee -a "$notes"
  elif ! grep -q ncclCommWindowRegister "$inc/nccl.h" || ! grep -q NCCL_CTA_POLICY_ZERO "$inc/nccl.h"; then
    echo "SKIP nccl_ce: $inc/nccl.h ($(grep -m1 '#define NCCL_VERSION_CODE' "$inc/nccl.h")) has no" \
      "ncclCommWindowRegister / NCCL_CTA_POLICY_ZERO" | tee -a "$notes"
  else
    echo "nccl_ce: $inc/nccl.h ($(sed -n 's/#define NCCL_\(MAJOR\|MINOR\|PATCH\) //p' "$inc/nccl.h" | tr '\n' '.' | sed 's/\.$//')), library in $libdir" | tee -a "$notes"
    mkdir -p "$out/build"
    lib_so=libnccl.so.2
    [ -e "$libdir/$lib_so" ] || lib_so=libnccl.so
    if "${NVCC:-nvcc}" -O2 -std=c++17 -I"$inc" -o "$out/build/nccl_ce_allgather" \
        "$here/nccl_ce_allgather.cc" -L"$libdir" -l:"$lib_so" -Xlinker -rpath="$libdir" \
        >"$out/logs/nccl_ce_build.log" 2>&1; then
      if timeout -k 30 "$limit" "$out/build/nccl_ce_allgather" -n "$n" --csv "$out/allgather_bw.csv" \
          --min-kib "$min_kib" --max-mib "$max_mib" --reps "$reps" >"$out/logs/nccl_ce.log" 2>&1; then
        cat "$out/logs/nccl_ce.log"
      else
        failures=$((failures + 1))
        echo "FAILED: nccl_ce_allgather, see logs/nccl_ce.log" | tee -a "$notes"
        tail -n 8 "$out/logs/nccl_ce.log" | sed 's/^/  /'
      fi
    else
      failures=$((failures + 1))
      echo "FAILED: building nccl_ce_allgather, see logs/nccl_ce_build.log" | tee -a "$notes"
      tail -n 8 "$out/logs/nccl_ce_build.log" | sed 's/^/  /'
    fi
  fi
fi

if [[ $parts == *" gemm "* ]]; then
  echo "== GEMM interference: ${no_lc[*]}"
  # shellcheck disable=SC2086  # user-given extra arguments
  interleave gemm_interference.py "${no_lc[@]}" -- ${BENCH_GEMM_ARGS:-}
fi

if [[ $parts == *" fsdp "* ]]; then
  echo "== FSDP inference step: ${no_lc[*]}"
  # shellcheck disable=SC2086  # user-given extra arguments
  interleave fsdp_step.py "${no_lc[@]}" -- ${BENCH_FSDP_ARGS:-}
fi

"$python" "$here/report.py" "$out" >/dev/null && echo "== written: $out/results.md" && cat "$out/results.md"
echo "bench multi: $failures run(s) failed"
[ "$failures" = 0 ]
