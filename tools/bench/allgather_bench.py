#!/usr/bin/env python3
"""The all-gather benchmark's driver: plain NCCL against NCCL with libmagice.so, interleaved.

Runs magice-allgather-bench (tools/bench/allgather_bench.cc) on N ranks under magi-launch, in
ROUNDS rounds of one launch without the library and one with it (LD_PRELOAD), the order swapped
every round, and reports per size the median time per call of each and the median of the
per-round ratios. Then one more launch with the library, traced (MAGI_TRACE_DIR) and logging its
decisions (MAGI_LOG=INFO), counts the calls served off NCCL: rank 0's trace (magice-trace dump,
calls marked "moved") is matched call by call against the plan the program writes (--plan), so
each count is per size, out of place and in place, timed calls only. The end-of-communicator
line ("X of Y all-gathers ... served off NCCL") of the same launch must agree with the trace's
total. The timed launches run neither traced nor logging: what a user runs. The counting launch
is the same program with the same options; with MAGI_CE_FORCE=1 (the stand-in's default here)
what moves does not depend on timing, without it the cost trial's timings decide.

  allgather_bench.py BUILD [--ranks 2,4,8] [--rounds 3] [--nccl standin|system|DIR]
      [--memory host|device] [--perf "-b 4K -e 16M -f 4 -n 40 -w 1"] [--no-perf]
      [--fsdp "--layers 10 --steps 64"] [--fsdp-in-place 1,0] [--no-fsdp] [--no-fsdp-control]
      [--lib-env KEY=VALUE]... [--timeout S] [--keep DIR]

--nccl standin (the default) runs over the stand-in of BUILD/tests/support on host memory with
MAGI_BACKEND=host MAGI_CE_FORCE=1 for the library (at one rank without MAGI_CE_FORCE, which would
make that communicator explore: there the defaults are the do-no-harm case); system runs over the NCCL the loader finds;
DIR puts DIR first on LD_LIBRARY_PATH. --lib-env adds to (or overrides) the library's settings.
Goals printed against: the do-no-harm bound (with the library at most max(2 %, 0.3 us) more per
call than without) wherever nothing moved, next to the noise (the interquartile range of the
rounds without the library: a difference below it says little); >= 75 % of the timed calls
moved at every size >= 4 KiB; the FSDP-like program moving >= 80 % of its gathers. The FSDP-like
program also runs once with one frame (the same buffers every step, --no-fsdp-control leaves it
out): what the library moves when nothing but the pool differs.
"""
import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

MIN_COVERED_SIZE = 4096
PERF_GOAL = 0.75
FSDP_GOAL = 0.80


def allowed_us(without_us):
    """The do-no-harm bound: 2 % or 0.3 us a call, whichever is larger."""
    return max(0.02 * without_us, 0.3)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("build")
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nccl", default="standin")
    p.add_argument("--memory", default=None, help="host (stand-in default) or device")
    p.add_argument("--perf", default="-b 4K -e 16M -f 4 -n 40 -w 1")
    p.add_argument("--no-perf", action="store_true")
    p.add_argument("--fsdp", default="--layers 10 --block-kib 64 --steps 64 --frames 3")
    p.add_argument("--fsdp-in-place", default="1,0")
    p.add_argument("--no-fsdp", action="store_true")
    p.add_argument("--no-fsdp-control", action="store_true")
    p.add_argument("--lib-env", action="append", default=[])
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--keep", default=None, help="keep every launch's output and trace here")
    return p.parse_args()


class Runner:
    def __init__(self, args):
        self.build = os.path.abspath(args.build)
        self.args = args
        self.memory = args.memory or ("host" if args.nccl == "standin" else "device")
        base = dict(os.environ)
        for key in list(base):
            if key.startswith("MAGI_") or key == "LD_PRELOAD":
                del base[key]  # the library's settings are this driver's to give
        library_path = {"standin": f"{self.build}/tests/support", "system": ""}.get(
            args.nccl, os.path.abspath(args.nccl))
        if library_path:
            base["LD_LIBRARY_PATH"] = ":".join(
                p for p in (library_path, base.get("LD_LIBRARY_PATH", "")) if p)
        self.base_env = base
        self.lib_env = {"MAGI_BACKEND": "host", "MAGI_CE_FORCE": "1"} if args.nccl == "standin" \
            else {}
        for item in args.lib_env:
            key, _, value = item.partition("=")
            self.lib_env[key] = value
        # One rank never explores unless forced (its all-gather is one local copy): there the
        # library runs with its defaults, the do-no-harm case, unless --lib-env forces it.
        self.unforced_at_one_rank = args.nccl == "standin" and not any(
            item.startswith("MAGI_CE_FORCE=") for item in args.lib_env)
        self.keep = args.keep
        self.launches = 0
        if self.keep:
            os.makedirs(self.keep, exist_ok=True)

    def launch(self, ranks, program_args, with_library, extra_env=None):
        """Runs one launch; returns rank 0's stdout and every rank's stderr."""
        env = dict(self.base_env)
        if with_library:
            env.update(self.lib_env)
            if ranks == 1 and self.unforced_at_one_rank:
                env.pop("MAGI_CE_FORCE", None)
            env["LD_PRELOAD"] = f"{self.build}/libmagice.so"
        env.update(extra_env or {})
        cmd = [f"{self.build}/tests/support/magi-launch", "-n", str(ranks), "--timeout",
               str(self.args.timeout), "--", f"{self.build}/magice-allgather-bench"] + program_args
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        self.launches += 1
        if self.keep:
            name = f"{self.keep}/launch{self.launches:03d}-{ranks}r-{'with' if with_library else 'without'}"
            with open(name + ".txt", "w") as f:
                f.write(f"$ {shlex.join(cmd)}\n# library env: "
                        f"{self.lib_env if with_library else {}} {extra_env or {}}\n"
                        f"--- stdout\n{done.stdout}--- stderr\n{done.stderr}")
        if done.returncode != 0:
            sys.exit(f"allgather_bench: {shlex.join(cmd)} failed ({done.returncode}):\n"
                     f"{done.stdout}{done.stderr}")
        return done.stdout, done.stderr

    def counted_launch(self, ranks, program_args):
        """The traced launch: rank 0's all-gathers in order, each (count, moved), the plan, and
        rank 0's end-of-communicator totals (moved, all)."""
        with tempfile.TemporaryDirectory() as scratch:
            trace_dir = f"{scratch}/trace"
            os.mkdir(trace_dir)
            plan = f"{scratch}/plan"
            _, err = self.launch(ranks, program_args + ["--plan", plan], True, {
                "MAGI_TRACE_DIR": trace_dir, "MAGI_LOG": "INFO", "MAGI_LOG_SUBSYS": "REWRITE"})
            with open(plan) as f:
                plan_lines = [line.split() for line in f]
            calls = rank0_gathers(self.build, trace_dir)
            if self.keep:
                kept = f"{self.keep}/launch{self.launches:03d}-{ranks}r-counted"
                os.makedirs(kept, exist_ok=True)
                subprocess.run(["cp", "-r", trace_dir, plan, kept], check=False)
        totals = None
        rounds = set()  # rank 0's agreement rounds: each is one more all-gather on NCCL
        for line in err.splitlines():
            m = re.search(r"\[0\] MAGI INFO REWRITE comm \w+: (\d+) of (\d+) all-gathers", line)
            if m:
                totals = (int(m.group(1)), int(m.group(2)))
            m = re.search(r"\[0\] MAGI INFO REWRITE comm \w+ round (\d+):", line)
            if m:
                rounds.add(int(m.group(1)))
        if len(calls) != len(plan_lines):
            sys.exit(f"allgather_bench: rank 0's trace holds {len(calls)} all-gathers, the plan "
                     f"{len(plan_lines)}")
        for (count, _), line in zip(calls, plan_lines):
            if count != int(line[-1]):
                sys.exit(f"allgather_bench: call {line[0]} gathers {count} elements in the trace, "
                         f"{line[-1]} in the plan")
        moved_total = sum(m for _, m in calls)
        check = "?" if totals is None else ("agrees" if totals == (moved_total, len(calls)) else
                                            f"DISAGREES: log says {totals[0]} of {totals[1]}")
        return calls, plan_lines, (f"{moved_total} of {len(calls)} moved (end-of-comm line "
                                   f"{check}), {len(rounds)} agreement rounds")


def rank0_gathers(build, trace_dir):
    """(count, moved) of each all-gather in rank 0's trace, in call order."""
    for name in sorted(os.listdir(trace_dir)):
        dump = subprocess.run([f"{build}/magice-trace", "dump", "--no-symbols",
                               f"{trace_dir}/{name}"], check=True, capture_output=True,
                              text=True).stdout
        if not re.search(r"^\s+[0-9a-f]{12}\s+0/", dump, re.M):
            continue  # another rank's
        if re.search(r"^dropped: ", dump, re.M):
            sys.exit(f"allgather_bench: rank 0's trace lost records (raise MAGI_TRACE_BUFFER_KIB "
                     "with --lib-env)")
        calls = []
        section = None
        for line in dump.splitlines():
            if not line.startswith(" "):
                section = line.split()[0] if line.split() else None
                continue
            f = line.split()
            # comm, call, op, collective, dtype, count, ...
            if section == "calls" and len(f) > 5 and f[2] == "AllGather" and f[1].isdigit():
                calls.append((int(f[5]), "moved" in f[6:]))
        return calls
    sys.exit(f"allgather_bench: no trace of rank 0 in {trace_dir}")


def spread(values):
    """How far apart the rounds of one configuration lie: the interquartile range."""
    if len(values) < 2:
        return float("nan")
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q3 - q1


def median(values):
    return statistics.median(values) if values else float("nan")


def perf_rows(stdout):
    """{size: (oop_us, ip_us, oop_wrong, ip_wrong)} from rank 0's table."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        f = line.split()
        rows[int(f[0])] = (float(f[3]), float(f[7]), int(f[6]), int(f[10]))
    return rows


def fsdp_row(stdout):
    for line in stdout.splitlines():
        if not line.startswith("#") and line.strip():
            f = line.split()
            return float(f[4]), float(f[5]), int(f[6])
    sys.exit("allgather_bench: no fsdp result line")


def header_of(stdout):
    return next((line for line in stdout.splitlines() if line.startswith("# magice")), "")


def interleaved_rounds(runner, ranks, program, parse):
    """ROUNDS rounds of a launch without and one with the library, the order swapped every
    round; returns each side's parsed results and the program's header line."""
    without, with_lib = [], []
    header = ""
    for r in range(runner.args.rounds):
        for library in ((False, True) if r % 2 == 0 else (True, False)):
            out, _ = runner.launch(ranks, program, library)
            header = header or header_of(out)
            (with_lib if library else without).append(parse(out))
    return without, with_lib, header


def run_perf(runner, ranks, perf_args):
    program = ["perf", "--memory", runner.memory] + perf_args
    without, with_lib, header = interleaved_rounds(runner, ranks, program, perf_rows)
    calls, plan, totals = runner.counted_launch(ranks, program)
    moved = {}  # (size, in_place) -> (moved timed calls, timed calls)
    for (_, was_moved), line in zip(calls, plan):
        if line[1] != "timed":
            continue
        key = (int(line[2]), line[3] == "1")
        m, n = moved.get(key, (0, 0))
        moved[key] = (m + was_moved, n + 1)

    print(f"\n### perf, {ranks} ranks, {runner.args.rounds} rounds\n")
    print(f"`{header[2:]}`; library settings: {lib_text(runner)}; counted launch: {totals}\n")
    print("| size | out of place: without | with | ratio | moved | in place: without | with | "
          "ratio | moved | do-no-harm (where nothing moved) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    verdicts = {"harm": [], "coverage": []}
    for size in sorted(without[0]):
        cells, bound = [], []
        for slot, in_place in ((0, False), (1, True)):
            w = [rows[size][slot] for rows in without]
            l = [rows[size][slot] for rows in with_lib]
            ratio = median([b / a for a, b in zip(w, l) if a > 0])
            m, n = moved.get((size, in_place), (0, 0))
            mw, ml = median(w), median(l)
            cells += [f"{mw:.2f} µs", f"{ml:.2f} µs", f"{ratio:.3f}", f"{m}/{n}"]
            place = "ip" if in_place else "oop"
            if m == 0:
                ok = ml <= mw + allowed_us(mw)
                bound.append(f"{place} {'ok' if ok else 'OVER'} ({ml - mw:+.2f} µs, allowed "
                             f"+{allowed_us(mw):.2f}, noise {spread(w):.2f})")
                verdicts["harm"].append(ok)
            if size >= MIN_COVERED_SIZE:
                verdicts["coverage"].append(n > 0 and m >= PERF_GOAL * n)
        wrong = sum(max(rows[size][2], 0) + max(rows[size][3], 0)  # -1: not checked (-c 0)
                    for rows in without + with_lib)
        if wrong:
            bound.append(f"WRONG ELEMENTS {wrong}")
        print(f"| {human(size)} | " + " | ".join(cells) + f" | {'; '.join(bound) or '—'} |")
    print(goal_line(verdicts))
    print("\n<details><summary>Per round (µs, out of place / in place, without → with)</summary>"
          "\n")
    for size in sorted(without[0]):
        per_round = ", ".join(f"{a[size][0]:.2f}/{a[size][1]:.2f} → {b[size][0]:.2f}/{b[size][1]:.2f}"
                              for a, b in zip(without, with_lib))
        print(f"- {human(size)}: {per_round}")
    print("\n</details>")


def goal_line(verdicts):
    harm = verdicts["harm"]
    cover = verdicts["coverage"]
    harm_text = "no cell" if not harm else \
        f"{'met' if all(harm) else 'NOT met'} ({sum(harm)} of {len(harm)} cells)"
    return (f"\nGoals: do-no-harm where nothing moved: {harm_text}; "
            f">= {PERF_GOAL:.0%} of timed calls moved at every size >= 4 KiB: "
            f"{'met' if cover and all(cover) else 'NOT met'} ({sum(cover)} of {len(cover)} cells)")


def run_fsdp(runner, ranks, fsdp_args, in_place, control=False):
    """One row: the pool program, or with control=True the same with one frame (the same
    buffers every step), which shows what the pool alone costs the library."""
    program = ["fsdp", "--memory", runner.memory, "--in-place", in_place] + fsdp_args + \
        (["--frames", "1"] if control else [])
    without, with_lib, header = interleaved_rounds(runner, ranks, program, fsdp_row)
    calls, plan, totals = runner.counted_launch(ranks, program)
    warmup = int(runner.lib_env.get("MAGI_WARMUP_STEPS", "3"))
    stable = [m for (_, m), line in zip(calls, plan) if int(line[1]) >= warmup + 4]
    moved = sum(m for _, m in calls)
    share = moved / len(calls) if calls else 0
    ratio = median([b[0] / a[0] for a, b in zip(without, with_lib)])
    late_ratio = median([b[1] / a[1] for a, b in zip(without, with_lib)])
    wrong = sum(r[2] for r in without + with_lib)
    variant = "in place (FSDP2)" if in_place == "1" else "own copy-in buffer"
    if control:
        variant += ", control: one frame, the same buffers every step"
    print(f"| {ranks} | {variant} | "
          f"{median([r[0] for r in without]):.1f} µs | {median([r[0] for r in with_lib]):.1f} µs | "
          f"{ratio:.3f} | {late_ratio:.3f} | {moved} of {len(calls)} ({share:.0%}) | "
          f"{sum(stable)} of {len(stable)} | {'met' if share >= FSDP_GOAL else 'NOT met'}"
          f"{'; WRONG ELEMENTS' if wrong else ''} |")
    return header, totals


def lib_text(runner):
    return " ".join(f"{k}={v}" for k, v in sorted(runner.lib_env.items())) or "defaults"


def human(size):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def main():
    args = parse_args()
    runner = Runner(args)
    ranks_list = [int(r) for r in args.ranks.split(",")]
    try:  # a machine the tree was copied to may have no git, or no .git
        commit = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)),
                                 "describe", "--always", "--dirty"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    print(f"## all-gather benchmark: library {commit or '?'}, NCCL {args.nccl}, "
          f"{runner.memory} memory, {args.rounds} rounds")
    if not args.no_perf:
        for ranks in ranks_list:
            run_perf(runner, ranks, shlex.split(args.perf))
    if not args.no_fsdp:
        print(f"\n### FSDP-like program (`{args.fsdp}`), {args.rounds} rounds\n")
        print("| ranks | copy-in | step without | step with | ratio | ratio, second half | "
              "gathers moved | moved from step MAGI_WARMUP_STEPS + 4 | >= 80 % |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        notes = []
        for ranks in ranks_list:
            for in_place in args.fsdp_in_place.split(","):
                header, totals = run_fsdp(runner, ranks, shlex.split(args.fsdp), in_place)
                notes.append(f"- `{header[2:]}`: {totals}")
            if not args.no_fsdp_control:
                header, totals = run_fsdp(runner, ranks, shlex.split(args.fsdp), "1", True)
                notes.append(f"- `{header[2:]}`: {totals}")
        print("\nLibrary settings: " + lib_text(runner) + "\n" + "\n".join(notes))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
