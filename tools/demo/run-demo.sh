#!/usr/bin/env bash
# make demo: a 4-rank FSDP-style inference program, unmodified, first straight on the NCCL
# stand-in, then under the shim with tracing on: the ranks agree on which gathers leave NCCL,
# the output must not change by a bit, and the traces show the step, the cross-rank diff and
# every decision.
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
traces=$(mktemp -d /tmp/magice-demo.XXXXXX)
ranks=4
steps=28

echo "== 1. the program alone, $ranks ranks on the NCCL stand-in"
reference=$("$build/tests/support/magi-launch" -n "$ranks" --timeout 120 -- "$build/magice-demo" --steps "$steps" | tail -1)
echo "$reference"

echo
echo "== 2. the same program under LD_PRELOAD=$build/libmagice.so"
echo "   (MAGI_BACKEND=host: the stand-in's buffers are host memory; MAGI_LOG=INFO shows rank 0's decisions)"
output=$("$build/tests/support/magi-launch" -n "$ranks" --timeout 120 \
  --env LD_PRELOAD="$build/libmagice.so" --env MAGI_TRACE_DIR="$traces" \
  --env MAGI_BACKEND=host --env MAGI_LOG=INFO --env MAGI_LOG_SUBSYS=REWRITE,TRANSPORT \
  -- "$build/magice-demo" --steps "$steps" 2> >(grep ' \[0\] ' >&2))
shimmed=$(echo "$output" | tail -1)
echo "$shimmed"
if [ "$shimmed" != "$reference" ]; then
  echo "the output changed under the shim" >&2
  exit 1
fi
echo "(same output as without the shim)"

echo
first=$(ls "$traces"/*.trace | head -1)
echo "== 3. the repeating step rank 0's communicator settled into (magice-trace skeleton $(basename "$first"))"
"$build/magice-trace" skeleton "$first"

echo
echo "== 4. do the ranks issue the same collectives from the same call sites? (magice-trace diff)"
"$build/magice-trace" diff "$traces"/*.trace && echo "(exit 0: the ranks agree)"

echo
echo "== 5. what left NCCL, per gather and rank (magice-trace decisions); reductions and the"
echo "   broadcast are not gathers: they always stay on NCCL"
"$build/magice-trace" decisions "$traces"/*.trace

echo
echo "Traces kept in $traces — try: $build/magice-trace dump $traces/*.trace | less"
echo "                         or:  $build/magice-trace export --chrome $traces/*.trace -o demo.json (open in Perfetto)"
