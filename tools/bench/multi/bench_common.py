"""What the multi-GPU benchmarks share: the process group (tests/gpu/multi/dist_env.py), sizes,
medians, and one CSV row per measurement appended by rank 0.

Each configuration (NCCL alone, the shim in default or static mode, ...) is its own process,
because the shim reads its options once per process; run.sh interleaves those processes over
repetitions, so drift of the machine falls on every configuration alike.
"""
import csv
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "tests", "gpu", "multi"))

import dist_env  # noqa: E402  (after the path above)


def sizes(min_kib: int, max_mib: int):
    out, nbytes = [], min_kib << 10
    while nbytes <= max_mib << 20:
        out.append(nbytes)
        nbytes *= 4
    return out


def median(values):
    return statistics.median(values) if values else float("nan")


def append_rows(path: str, rows) -> None:
    """Appends dict rows to a CSV, writing the header when the file is new."""
    if not rows:
        return
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        if new:
            w.writeheader()
        w.writerows(rows)


def add_common_args(p) -> None:
    p.add_argument("--config", required=True, help="label of this process's configuration")
    p.add_argument("--rep", type=int, default=1, help="repetition number (for the CSV)")
    p.add_argument("--csv", required=True, help="rank 0 appends its rows here")


__all__ = ["dist_env", "sizes", "median", "append_rows", "add_common_args"]
