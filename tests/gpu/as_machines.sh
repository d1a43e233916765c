#!/bin/bash
# Runs a command as a rank of one "machine" of several on this one: AS_MACHINES names each
# rank's machine in rank order (e.g. a,a,b,b), and this rank (STANDIN_RANK, from magi-launch)
# takes its entry as MAGI_INJECT_HOST. Used by machines_runs.sh.
IFS=, read -r -a machines <<<"${AS_MACHINES:?AS_MACHINES must name the machine of each rank}"
export MAGI_INJECT_HOST=${machines[${STANDIN_RANK:?}]:?no machine for rank $STANDIN_RANK}
exec "$@"
