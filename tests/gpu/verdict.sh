# shellcheck shell=bash
# Sourced by tests/gpu/run.sh and tests/gpu/multi/run.sh: every check ends in one PASS, FAIL or
# SKIP line and is counted; the closing line "NAME: N passed, M failed, K skipped" is the run's
# only verdict. A check whose prerequisite is missing (no MPS, no compute-sanitizer, no nsys, no
# real NCCL, one GPU) is a SKIP, never silence; a run in which no check ran at all (every one
# skipped, or none selected) proves nothing and fails. tests/gpu/verdict_test.py checks this
# file on a machine without a GPU.
passed=0
failed=0
skipped=0
pass() { echo "PASS $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; failed=$((failed + 1)); }
skip() { echo "SKIP $1"; skipped=$((skipped + 1)); }

# add_counts NAME LOG: adds the counts of a nested run's closing line ("NAME: N passed, M failed"
# or "..., K skipped") found in LOG; false, counting nothing, when LOG has no such line.
add_counts() {
  local counts
  counts=$(sed -nE "s/^$1: ([0-9]+) passed, ([0-9]+) failed(, ([0-9]+) skipped)?$/\1 \2 \4/p" \
    "$2" 2>/dev/null | tail -n 1)
  [ -n "$counts" ] || return 1
  local p f s
  read -r p f s <<<"$counts"
  passed=$((passed + p))
  failed=$((failed + f))
  skipped=$((skipped + ${s:-0}))
}

# closing_line NAME: prints the closing line and returns the verdict: true only when some check
# passed and none failed.
closing_line() {
  [ $((passed + failed)) -gt 0 ] ||
    fail "no check ran ($skipped skipped): a run that tests nothing cannot pass"
  echo "$1: $passed passed, $failed failed, $skipped skipped"
  [ "$failed" = 0 ]
}
