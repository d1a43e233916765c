"""Turns the multi-GPU benchmark CSVs into markdown tables and PNG plots.

    report.py DIR     (reads DIR/allgather_bw.csv, gemm_interference.csv, fsdp_step.csv and
                       the shim runs' logs in DIR/logs; writes DIR/results.md and, where
                       matplotlib imports, DIR/*.png)

Figures are medians over repetitions; a ratio between two configurations is the median of the
per-repetition ratios (the runs of one repetition ran back to back, so they share the machine's
state). The goals are issue 5's; at world size 1 nothing crosses NVLink and none applies.
"""
import csv
import glob
import os
import re
import statistics
import sys
from collections import defaultdict

LIMIT_GBPS = 450.0  # NVLink, per direction per GPU (H200)
BASE = "nccl"       # PyTorch's all_gather_into_tensor on NCCL, no shim


def read(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def med(values):
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def fmt(v, digits=1):
    return "—" if v != v else f"{v:.{digits}f}"


def size_text(nbytes):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def ordered(configs):
    order = ["nccl", "nccl_ring", "nccl_symm", "nccl_ce", "torch_lc", "shim", "shim_nocallsite",
             "shim_force", "shim_static"]
    return sorted(configs, key=lambda c: (order.index(c) if c in order else len(order), c))


def by_config(rows):
    """The rows of each configuration, and the configurations in report order."""
    by = defaultdict(list)
    for r in rows:
        by[r["config"]].append(r)
    return by, ordered(by)


def allgather_section(rows, lines, plots):
    ok = [r for r in rows if r["status"] == "ok"]
    skipped = sorted({(r["config"], r["status"]) for r in rows if r["status"] != "ok"})
    if not ok:
        lines.append("No all-gather measurements.\n")
        return
    world = int(ok[0]["world"])
    metric = "busbw_GBps" if world > 1 else "algbw_GBps"
    t = defaultdict(dict)       # (config, size) -> rep -> time
    bw = defaultdict(dict)
    for r in ok:
        key = (r["config"], int(r["bytes_per_rank"]))
        t[key][r["rep"]] = float(r["time_us"])
        bw[key][r["rep"]] = float(r[metric])
    configs = ordered({c for c, _ in t})
    size_list = sorted({s for _, s in t})
    reps = max(len(v) for v in t.values())
    lines.append(f"World size {world}; {reps} repetition(s); "
                 f"{'bus' if world > 1 else 'algorithm'} bandwidth in GB/s (time per call in µs); "
                 f"× = median of per-repetition speed ratios against `{BASE}`.\n")
    lines.append("| per rank | " + " | ".join(f"`{c}`" for c in configs) + " |")
    lines.append("| ---: |" + " ---: |" * len(configs))
    for s in size_list:
        cells = []
        for c in configs:
            if (c, s) not in t:
                cells.append("—")
                continue
            cell = f"{fmt(med(bw[(c, s)].values()))} ({fmt(med(t[(c, s)].values()))} µs)"
            if c != BASE and (BASE, s) in t:
                ratios = [t[(BASE, s)][rep] / v for rep, v in t[(c, s)].items() if rep in t[(BASE, s)]]
                cell += f" {fmt(med(ratios), 2)}×"
            cells.append(cell)
        lines.append(f"| {size_text(s)} | " + " | ".join(cells) + " |")
    for config, status in skipped:
        lines.append(f"\n`{config}`: {status}")
    if world > 1:
        top = size_list[-1]
        lines.append("\nGoals (issue 5): the shim at least as fast as NCCL from 8 MiB per rank; "
                     f"≥ 88% of {LIMIT_GBPS:.0f} GB/s at the largest size.")
        for c in ("shim", "shim_static"):
            if (c, top) in bw:
                b = med(bw[(c, top)].values())
                slower = [size_text(s) for s in size_list if s >= 8 << 20 and (c, s) in t
                          and (BASE, s) in t and med(t[(c, s)].values()) > med(t[(BASE, s)].values())]
                lines.append(f"- `{c}`: {fmt(b)} GB/s at {size_text(top)} = {fmt(100 * b / LIMIT_GBPS)}% "
                             f"of the limit; slower than `{BASE}` at ≥ 8 MiB: {', '.join(slower) or 'none'}")
    lines.append("")
    plots.append(("allgather_bw.png", lambda plt: plot_allgather(plt, t, bw, configs, size_list, world)))


def plot_allgather(plt, t, bw, configs, size_list, world):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in configs:
        xs = [s for s in size_list if (c, s) in t]
        ax1.plot(xs, [med(bw[(c, s)].values()) for s in xs], marker="o", label=c)
        ax2.plot(xs, [med(t[(c, s)].values()) for s in xs], marker="o", label=c)
    if world > 1:
        ax1.axhline(LIMIT_GBPS, color="grey", linestyle="--", linewidth=1, label="NVLink limit")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank")
        ax.grid(True, alpha=0.3)
    ax1.set_ylabel("bus bandwidth, GB/s" if world > 1 else "algorithm bandwidth, GB/s")
    ax2.set_yscale("log")
    ax2.set_ylabel("time per call, µs")
    ax1.legend(fontsize=8)
    fig.suptitle(f"all-gather, {world} GPU(s), bf16" + (" (world size 1: smoke test)" if world == 1 else ""))
    fig.tight_layout()


SIZE_MARK = re.compile(r"^allgather_bw: size (\d+)$")
COST_LINE = re.compile(r"\[0\] MAGI INFO REWRITE comm \w+ round \d+: cost on the slowest rank "
                       r"\(median per call\): bucket 0: copy engine ([\d.]+) us, NCCL ([\d.]+) us -> (.+?)(;|$)")


def routes_kept(log_path):
    """size -> (copy-engine us, NCCL us, route) of the last cost round rank 0 logged for it."""
    kept, size = {}, None
    with open(log_path, errors="replace") as f:
        for line in f:
            m = SIZE_MARK.match(line.strip())
            if m:
                size = int(m.group(1))
                continue
            m = COST_LINE.search(line)
            if m and size is not None:
                kept[size] = (float(m.group(1)), float(m.group(2)), m.group(3))
    return kept


def routes_section(d, lines):
    """What each shim run's cost rounds measured and kept, size by size (repetition 1)."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(d, "logs", "allgather_bw.shim*.1.log"))):
        config = os.path.basename(path)[len("allgather_bw."):-len(".1.log")]
        kept = routes_kept(path)
        if kept:
            runs[config] = kept
    if not runs:
        return
    configs = ordered(runs)
    size_list = sorted({s for kept in runs.values() for s in kept})
    lines.append("Route each shim run's cost round kept, per size (repetition 1, rank 0's log: the "
                 "slowest rank's median per call on the copy engine and on NCCL):\n")
    lines.append("| per rank | " + " | ".join(f"`{c}`" for c in configs) + " |")
    lines.append("| ---: |" + " --- |" * len(configs))
    for s in size_list:
        cells = []
        for c in configs:
            if s not in runs[c]:
                cells.append("—")
                continue
            ce, nccl, route = runs[c][s]
            cells.append(f"{route} ({fmt(ce)} / {fmt(nccl)} µs)")
        lines.append(f"| {size_text(s)} | " + " | ".join(cells) + " |")
    lines.append("")


def gemm_section(rows, lines, plots):
    if not rows:
        lines.append("No GEMM interference measurements.\n")
        return
    by, configs = by_config(rows)
    r0 = rows[0]
    lines.append(f"World size {r0['world']}; {r0['gemms']} GEMMs of {r0['dim']}³ bf16 per batch; "
                 f"gathers of {r0['gather_mib']} MiB per rank on another stream. Medians over "
                 f"repetitions.\n")
    lines.append("| config | GEMM alone, ms | with gathers, ms | slowdown | GEMM TFLOP/s alone | gather busbw meanwhile, GB/s |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
    slow = {}
    for c in configs:
        rs = by[c]
        slow[c] = med([float(r["slowdown_pct"]) for r in rs])
        lines.append(f"| `{c}` | {fmt(med([float(r['gemm_alone_ms']) for r in rs]), 2)} | "
                     f"{fmt(med([float(r['gemm_overlapped_ms']) for r in rs]), 2)} | {fmt(slow[c])}% | "
                     f"{fmt(med([float(r['gemm_tflops_alone']) for r in rs]), 0)} | "
                     f"{fmt(med([float(r['gather_busbw_GBps_overlapped']) for r in rs]))} |")
    if BASE in slow and "shim" in slow and r0["world"] != "1":
        lines.append(f"\nGoal (issue 5): the shim's slowdown ≤ one third of NCCL's: "
                     f"{fmt(slow['shim'])}% against {fmt(slow[BASE])}% "
                     f"({'met' if slow['shim'] <= slow[BASE] / 3 else 'not met'}).")
    lines.append("")

    def plot(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(configs, [slow[c] for c in configs], color="tab:orange")
        ax.set_ylabel("GEMM slowdown with gathers alongside, %")
        ax.set_title(f"GEMM interference, {r0['world']} GPU(s)")
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
    plots.append(("gemm_interference.png", plot))


def fsdp_section(rows, lines, plots):
    if not rows:
        lines.append("No FSDP step measurements.\n")
        return
    by, configs = by_config(rows)
    r0 = rows[0]
    lines.append(f"World size {r0['world']}; {r0['layers']} layers of hidden {r0['hidden']}, "
                 f"{r0['tokens']} tokens per rank, {r0['weights_MiB']} MiB of weights gathered per "
                 f"step; FSDP2 with forward prefetch. Medians over repetitions.\n")
    lines.append("| config | step, ms | compute alone, ms | gathers alone, ms | exposed, ms | gather time hidden | step vs `nccl` |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    step = {}
    reps = defaultdict(dict)
    for c in configs:
        rs = by[c]
        step[c] = med([float(r["step_ms"]) for r in rs])
        for r in rs:
            reps[c][r["rep"]] = float(r["step_ms"])
    for c in configs:
        rs = by[c]
        ratio = med([reps[BASE][rep] / v for rep, v in reps[c].items() if rep in reps.get(BASE, {})])
        lines.append(f"| `{c}` | {fmt(step[c], 2)} | {fmt(med([float(r['compute_ms']) for r in rs]), 2)} | "
                     f"{fmt(med([float(r['gathers_ms']) for r in rs]), 2)} | "
                     f"{fmt(med([float(r['exposed_ms']) for r in rs]), 2)} | "
                     f"{fmt(med([float(r['gathers_hidden_pct']) for r in rs]), 0)}% | {fmt(ratio, 3)}× |")
    if BASE in step and "shim" in step and r0["world"] != "1":
        gain = 100 * (step[BASE] / step["shim"] - 1)
        lines.append(f"\nGoal (issue 5): the shim's step ≥ 10% faster: {fmt(gain)}% "
                     f"({'met' if gain >= 10 else 'not met'}).")
    lines.append("")

    def plot(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        phases = ["step_ms", "compute_ms", "gathers_ms", "exposed_ms"]
        width = 0.8 / len(phases)
        for i, ph in enumerate(phases):
            ax.bar([x + i * width for x in range(len(configs))],
                   [med([float(r[ph]) for r in by[c]]) for c in configs], width, label=ph[:-3])
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(configs))], configs)
        ax.set_ylabel("ms")
        ax.set_title(f"FSDP inference step, {r0['world']} GPU(s)")
        ax.legend(fontsize=8)
        fig.tight_layout()
    plots.append(("fsdp_step.png", plot))


def main() -> int:
    d = sys.argv[1]
    lines, plots = ["# Multi-GPU benchmarks (tools/bench/multi)\n"], []
    lines.append("## All-gather bandwidth against message size\n")
    allgather_section(read(os.path.join(d, "allgather_bw.csv")), lines, plots)
    routes_section(d, lines)
    lines.append("## GEMM interference\n")
    gemm_section(read(os.path.join(d, "gemm_interference.csv")), lines, plots)
    lines.append("## FSDP inference step\n")
    fsdp_section(read(os.path.join(d, "fsdp_step.csv")), lines, plots)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        for name, draw in plots:
            draw(plt)
            plt.savefig(os.path.join(d, name), dpi=110)
            plt.close("all")
        lines.append("Plots: " + ", ".join(name for name, _ in plots) + ".")
    except ImportError:
        lines.append("matplotlib is not installed here: CSV only, no plots.")
    with open(os.path.join(d, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
