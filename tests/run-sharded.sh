#!/usr/bin/env bash
# Runs a GoogleTest program as several processes at once, each on its share of the tests, and
# says how they went: each process's GoogleTest summary, the total, the slowest tests, and the
# whole output of any process that failed. Exits non-zero when a process failed or crashed, or
# when the processes together ran fewer tests than the program lists.
#   usage: tests/run-sharded.sh NAME PROCESSES LOGDIR PROGRAM [GTEST_FILTER]
# Most tests start ranks and wait on them, so more processes than cores still pays.
# The shares are given as --gtest_filter lists, not through GTEST_SHARD_INDEX: a test that runs
# its own program again for one test (tests/capture/callsite_test.cc) passes its environment on,
# and a shard index there would filter that one test away.
set -uo pipefail

if [ $# -lt 4 ] || [ $# -gt 5 ]; then
  echo "usage: $0 NAME PROCESSES LOGDIR PROGRAM [GTEST_FILTER]" >&2
  exit 2
fi
name=$1 processes=$2 logdir=$3 program=$4 filter=${5:-*}

# Every test the filter selects, as Suite.Test (parameters' comments dropped), disabled ones out.
listing=$("$program" --gtest_list_tests "--gtest_filter=$filter") || {
  echo "$name: $program --gtest_list_tests failed" >&2
  exit 1
}
mapfile -t tests < <(awk '/^[^ ]/ { suite = $1; next } /^  / { print suite $1 }' <<<"$listing" |
  grep -v -e '^DISABLED_' -e '\.DISABLED_')
if [ ${#tests[@]} = 0 ]; then
  echo "$name: the filter '$filter' selects no test of $program" >&2
  exit 1
fi
[ "$processes" -ge 1 ] 2>/dev/null || processes=1
[ "$processes" -le ${#tests[@]} ] || processes=${#tests[@]}

# Where TEST_TIMES names logs of an earlier run (make test: the plain suite's, for the sanitized
# suites that follow it), the tests are dealt longest first, each to the process with the least
# time so far, so that no process is left with the long ones while the others idle; a test those
# logs lack counts as a short one. Elsewhere they are dealt out in turn, so a suite's tests (often
# alike in length) spread over every process.
shares=()
timing_logs=()
for log in ${TEST_TIMES:-}; do [ -f "$log" ] && timing_logs+=("$log"); done
if [ ${#timing_logs[@]} -gt 0 ]; then
  while read -r p test; do
    shares[p]+="${shares[p]:+:}$test"
  done < <(printf '%s\n' "${tests[@]}" | awk -v processes="$processes" '
    FILENAME != "-" {
      if (match($0, /^\[ *(OK|FAILED) *\] [^ ]+ \([0-9]+ ms\)$/)) {
        split($0, f, /\] | \(| ms\)/); ms[f[2]] = f[3] + 0
      }
      next
    }
    { n++; name[n] = $0; t[n] = ($0 in ms) ? ms[$0] : 100 }
    END {
      # Longest first (an insertion sort: a suite is a few hundred tests).
      for (i = 2; i <= n; i++)
        for (j = i; j > 1 && t[j] > t[j - 1]; j--) {
          x = t[j]; t[j] = t[j - 1]; t[j - 1] = x; y = name[j]; name[j] = name[j - 1]; name[j - 1] = y
        }
      for (i = 1; i <= n; i++) {
        least = 0
        for (p = 1; p < processes; p++) if (load[p] < load[least]) least = p
        load[least] += t[i]; print least, name[i]
      }
    }' "${timing_logs[@]}" -)
else
  for i in "${!tests[@]}"; do
    shares[i % processes]+="${shares[i % processes]:+:}${tests[i]}"
  done
fi

mkdir -p "$logdir"
rm -f "$logdir/$name".*.log
start=$SECONDS
pids=()
for ((p = 0; p < processes; ++p)); do
  "$program" "--gtest_filter=${shares[p]}" </dev/null >"$logdir/$name.$p.log" 2>&1 &
  pids[p]=$!
done
statuses=()
for ((p = 0; p < processes; ++p)); do
  wait "${pids[p]}"
  statuses[p]=$?
done

failed=0 passed=0 failed_tests=0 skipped=0
for ((p = 0; p < processes; ++p)); do
  log="$logdir/$name.$p.log"
  # main.cc's closing line: "tests: N passed, M failed, K skipped".
  np= nf= ns=
  read -r np nf ns < <(
    sed -nE 's/^tests: ([0-9]+) passed, ([0-9]+) failed, ([0-9]+) skipped$/\1 \2 \3/p' "$log" |
      tail -n 1)
  passed=$((passed + ${np:-0}))
  failed_tests=$((failed_tests + ${nf:-0}))
  skipped=$((skipped + ${ns:-0}))
  summary=$(grep -aE '^\[==========\] .* ran\.' "$log" | tail -n 1)
  echo "$name [$p] ${summary:-(no GoogleTest summary)}"
  grep -aE '^\[  (PASSED|FAILED|SKIPPED) +\]' "$log" | grep -avE ' \([0-9]+ ms\)$' |
    sed "s/^/$name [$p] /"
  if [ "${statuses[p]}" != 0 ] || [ -z "${np:-}" ]; then
    failed=1
    echo "---- $name [$p] exited ${statuses[p]}; its whole output ($log):"
    cat "$log"
    echo "---- end of $name [$p]"
  fi
done

ran=$((passed + failed_tests + skipped))
[ "$processes" = 1 ] && in="1 process" || in="$processes processes"
echo "$name: ${#tests[@]} tests in $in, $((SECONDS - start)) s:" \
  "$passed passed, $failed_tests failed, $skipped skipped"
echo "$name: slowest:" $(cat "$logdir/$name".*.log |
  sed -nE 's/^\[       OK \] ([^ ]+) \(([0-9]+) ms\)$/\2 \1/p' | sort -rn | head -n 3 |
  awk '{ printf "%s (%.1f s)  ", $2, $1 / 1000 }')
if [ "$ran" != ${#tests[@]} ]; then
  echo "$name: FAILED: $ran of ${#tests[@]} tests ran (logs: $logdir)"
  exit 1
fi
if [ $failed != 0 ]; then
  # Last, where a reader of only the end of a long output still finds it: each failed test's
  # name and the first lines of each of its failures (a transcript can run to thousands of lines).
  echo "$name: the failures, in short:"
  for ((p = 0; p < processes; ++p)); do
    awk -v limit=12 '
      /^\[ RUN      \] / { test = $4; next }
      / Failure$/ { print "  " test ": " $0; left = limit; next }
      /^Google Test trace:$/ { if (getline line > 0) print "    (trace) " substr(line, 1, 200); next }
      /^\[  FAILED  \] .* \([0-9]+ ms\)$/ { left = 0; next }
      left > 0 { print "    " substr($0, 1, 240); --left }
    ' "$logdir/$name.$p.log" | head -n 120
  done
  echo "$name: FAILED (logs: $logdir)"
  exit 1
fi
