#!/bin/bash
# Runs a command as a rank of one "machine" of several on this one: AS_MACHINES names each
# rank's machine in rank order (e.g. a,a,b,b), and this rank (STANDIN_RANK from magi-launch, or
# RANK from torchrun) takes its entry as MAGI_INJECT_HOST. Used by machines_runs.sh and
# torch_standin_runs.sh.
IFS=, read -r -a machines <<<"${AS_MACHINES:?AS_MACHINES must name the machine of each rank}"
rank=${STANDIN_RANK:-${RANK:?neither STANDIN_RANK nor RANK names this rank}}
export MAGI_INJECT_HOST=${machines[$rank]:?no machine for rank $rank}
exec "$@"
