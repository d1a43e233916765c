#!/usr/bin/env bash
# make demo: a 4-rank FSDP-style inference program, unmodified, under the shim with tracing on;
# then what the traces say: each rank's repeating step, and whether the ranks agree.
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
traces=$(mktemp -d /tmp/magice-demo.XXXXXX)
ranks=4

echo "== 1. the program, $ranks ranks, under LD_PRELOAD=$build/libmagice.so (MAGI_TRACE_DIR=$traces)"
"$build/tests/support/magi-launch" -n "$ranks" --timeout 120 \
  --env LD_PRELOAD="$build/libmagice.so" --env MAGI_TRACE_DIR="$traces" \
  -- "$build/magice-demo"

echo
first=$(ls "$traces"/*.trace | head -1)
echo "== 2. the repeating step rank 0's communicator settled into (magice-trace skeleton $(basename "$first"))"
"$build/magice-trace" skeleton "$first"

echo
echo "== 3. do the ranks issue the same collectives from the same call sites? (magice-trace diff)"
"$build/magice-trace" diff "$traces"/*.trace && echo "(exit 0: the ranks agree)"

echo
echo "Traces kept in $traces — try: $build/magice-trace dump --frames $traces/*.trace | less"
echo "                         or:  $build/magice-trace export --chrome $traces/*.trace -o demo.json (open in Perfetto)"
