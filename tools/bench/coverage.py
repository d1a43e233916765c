#!/usr/bin/env python3
"""How much of each program's all-gather traffic leaves NCCL, and how soon.

Runs the stand-in programs of tests/support (N processes on host memory, MAGI_BACKEND=host,
MAGI_CE_FORCE=1) under the shim with a trace, reads rank 0's trace back with magice-trace dump,
and prints one Markdown table row per program:

  - moved: all-gathers served off NCCL, of all the program's all-gathers;
  - once stable: the same, counted from the step where the program's buffers have settled
    (step 0, or --settle-step) plus MAGI_WARMUP_STEPS + 4;
  - first moved: the step of the first call served off NCCL, and how many steps that is after the
    buffers settled.

The nccl-tests-like loop (perf) is counted per phase instead: the timed calls moved in each
phase (size x in place or not), the worst phase and the mean.

  tools/bench/coverage.py BUILD_DIR [--ranks N]
"""
import os
import re
import subprocess
import sys
import tempfile

build = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build")
ranks = int(sys.argv[sys.argv.index("--ranks") + 1]) if "--ranks" in sys.argv else 2
WARMUP = 3


def run(args, env_extra=None):
    """Runs the program on `ranks` ranks; returns rank 0's collectives as (op, moved) in order."""
    with tempfile.TemporaryDirectory() as trace_dir:
        env = dict(os.environ, LD_PRELOAD=f"{build}/libmagice.so", MAGI_BACKEND="host",
                   MAGI_CE_FORCE="1", MAGI_TRACE_DIR=trace_dir, MAGI_WARMUP_STEPS=str(WARMUP))
        env.update(env_extra or {})
        subprocess.run([f"{build}/tests/support/magi-launch", "-n", str(ranks), "--",
                        f"{build}/tests/support/magi-workload"] + args, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        traces = sorted(os.path.join(trace_dir, f) for f in os.listdir(trace_dir))
        calls = []
        for trace in traces:
            dump = subprocess.run([f"{build}/magice-trace", "dump", trace], check=True,
                                  capture_output=True, text=True).stdout
            if not re.search(r"^\s+[0-9a-f]{12}\s+0/", dump, re.M):
                continue  # not rank 0's
            for line in dump.splitlines():
                f = line.split()
                if len(f) > 3 and re.fullmatch(r"[0-9a-f]{12}", f[0]) and f[1].isdigit() and \
                        f[2][0].isupper():
                    calls.append((f[2], f[-1] == "moved"))
            break
        return [c for c in calls if c[0] not in ("Send", "Recv")]


def steps_row(name, args, per_step, prologue, settle=0, env=None):
    calls = run(args, env)
    gathers = [(i, moved) for i, (op, moved) in enumerate(calls) if op == "AllGather"]
    step_of = lambda i: (i - prologue) // per_step
    moved = sum(m for _, m in gathers)
    first = next((step_of(i) for i, m in gathers if m), None)
    stable_from = settle + WARMUP + 4
    late = [m for i, m in gathers if step_of(i) >= stable_from]
    share = f"{100 * sum(late) / len(late):.0f}%" if late else "-"
    first_text = f"step {first} ({first - settle} after settling)" if first is not None else "none"
    print(f"| {name} | {moved} of {len(gathers)} ({100 * moved / len(gathers):.0f}%) | {share} | "
          f"{first_text} |")


def perf_row(iters, sizes):
    calls = run(["perf", "--sizes", ",".join(map(str, sizes)), "--iters", str(iters)])
    per_phase = iters + 2
    shares = []
    for p in range(len(calls) // per_phase):
        timed = calls[p * per_phase + 1: p * per_phase + 1 + iters]
        shares.append(sum(m for _, m in timed))
    print(f"| nccl-tests-like loop ({len(sizes)} sizes, {iters} timed calls a phase) | "
          f"timed calls moved per phase: {', '.join(map(str, shares))} of {iters} | worst "
          f"{100 * min(shares) / iters:.0f}%, mean {100 * sum(shares) / len(shares) / iters:.0f}% "
          f"| after each size change: call {iters - min(shares) + 1} of the phase |")


print(f"Coverage on the stand-in, {ranks} ranks, MAGI_WARMUP_STEPS={WARMUP}, MAGI_CE_FORCE=1\n")
print("| program | all-gathers moved | once stable | first moved |")
print("|---|---|---|---|")
perf_row(40, [4096, 65536, 1048576])
perf_row(20, [4096, 65536, 1048576])
FSDP = ["fsdp", "--layers", "5", "--rewrite", "1"]
steps_row("FSDP-style, 5 layers (pairs grouped), 32 steps", FSDP + ["--steps", "32"], 6, 1)
steps_row("the same, MAGI_WARMUP_STEPS=1", FSDP + ["--steps", "32"], 6, 1,
          env={"MAGI_WARMUP_STEPS": "1"})
steps_row("a step that is one group, 32 steps", FSDP + ["--steps", "32", "--step-group", "1"], 6, 1)
steps_row("buffers that settle after 15 steps, 48 steps",
          FSDP + ["--steps", "48", "--settle-step", "15"], 6, 1, settle=15)
steps_row("identical shapes (5 layers, one shard size, nothing else), 32 steps",
          FSDP + ["--steps", "32", "--uniform", "1"], 5, 1)
