"""What the shim did in a run, read from its traces with magice-trace; exits 1 if not as expected.

    trace_check.py MAGICE_TRACE TRACE_DIR [--moved] [--mode identical|slot|abort] [--comms K]

Prints one line: the communicators that ran agreement rounds, the modes their rounds reached, and
how many calls each served off NCCL. Always requires `magice-trace decisions` to find the same
verdict on every rank. --moved: some call was served off NCCL. --mode: some round of some
communicator reached that mode. --comms: at least K communicators ran agreement rounds.
"""
import argparse
import glob
import json
import re
import subprocess
import sys
from collections import Counter

CALL = re.compile(r"^\s+([0-9a-f]{12})\s+(\d+)\s+([A-Z]\w*)\s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tool")
    p.add_argument("trace_dir")
    p.add_argument("--moved", action="store_true")
    p.add_argument("--mode", choices=("identical", "slot", "abort"))
    p.add_argument("--comms", type=int, default=0)
    args = p.parse_args()

    traces = sorted(glob.glob(f"{args.trace_dir}/*.trace"))
    if not traces:
        print(f"trace_check: no traces in {args.trace_dir}")
        return 1
    decided = subprocess.run([args.tool, "decisions", "--all", "--json", *traces],
                             capture_output=True, text=True)
    if decided.returncode not in (0, 1):
        print(f"trace_check: magice-trace decisions failed: {decided.stderr.strip()[:300]}")
        return 1
    report = json.loads(decided.stdout)
    modes = {c["comm"]: sorted({r["mode"] for r in c["rounds"]}) for c in report["communicators"]}
    agreeing = {comm: m for comm, m in modes.items() if m}

    dump = subprocess.run([args.tool, "dump", *traces], capture_output=True, text=True)
    moved = Counter()
    for line in dump.stdout.splitlines():
        m = CALL.match(line)
        if m and line.rstrip().endswith(" moved"):
            moved[m.group(1)] += 1

    # dump and decisions name a communicator alike: the 12 hex digits its log lines show
    per_comm = "; ".join(f"{c}: modes {'/'.join(m)}, {moved[c]} calls moved"
                         for c, m in agreeing.items())
    print(f"trace_check: {len(traces)} traces, {len(agreeing)} communicators agreeing "
          f"({per_comm or 'none'}); ranks {'agree' if report['agree'] else 'DISAGREE'}")
    problems = []
    if not report["agree"] or decided.returncode != 0:
        problems.append("ranks disagree: " + "; ".join(
            d for c in report["communicators"] for d in c["disagreements"])[:400])
    if args.moved and sum(moved.values()) == 0:
        problems.append("no call was served off NCCL")
    if args.mode and not any(args.mode in m for m in agreeing.values()):
        problems.append(f"no round reached mode {args.mode}")
    if len(agreeing) < args.comms:
        problems.append(f"{len(agreeing)} communicators ran agreement rounds, expected {args.comms}")
    for problem in problems:
        print(f"trace_check: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
