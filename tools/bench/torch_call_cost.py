#!/usr/bin/env python3
"""What the flight recorder and Python call sites add to a PyTorch collective (needs a GPU):
dist.all_reduce of a 1-element tensor at world size 1, CALLS calls a run, the best of 5 runs,
each setting its own process (options are read once):

  no shim | shim | shim + MAGI_FLIGHT_RECORDER | + MAGI_PY_CALLSITES=2
  | shim + MAGI_FLIGHT_RECORDER + MAGI_FLIGHT_RECORDER_COMPLETION=1

PyTorch releases the GIL around its collectives, so Python call sites need =2 there. The
settings run in ROUNDS rounds (default 3), one after another in each, and the medians close the
output: between processes the host drifts by microseconds, more than some of these costs. The
calls come from a function a few frames deep, as a model's do. After each recorder run,
`magice-trace hang` must find every call in the files (calls not recorded measure nothing).

  tools/bench/torch_call_cost.py BUILD_DIR [CALLS]
"""
import os
import statistics
import subprocess
import sys
import tempfile


def child(calls: int) -> None:
    import time

    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29543")
    dev = torch.device("cuda:0")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    x = torch.ones(1, device=dev)

    def layer():
        dist.all_reduce(x)

    def step():
        for _ in range(calls):
            layer()

    step()  # warm up: communicator, kernels, call sites seen once
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    dist.destroy_process_group()
    print(best / calls * 1e6)


def run(env: dict, calls: int) -> float:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", str(calls)],
        env={**os.environ, **env}, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(int(sys.argv[2]))
        return 0
    build = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build")
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    rounds = int(os.environ.get("ROUNDS", "3"))
    shim = {"LD_PRELOAD": os.path.join(build, "libmagice.so")}
    recorder = {**shim, "MAGI_FLIGHT_RECORDER": "4096"}
    settings = [("no shim", {}), ("shim", shim), ("shim + recorder", recorder),
                ("shim + recorder + py call sites", {**recorder, "MAGI_PY_CALLSITES": "2"}),
                ("shim + recorder + completion",
                 {**recorder, "MAGI_FLIGHT_RECORDER_COMPLETION": "1"})]
    results = {label: [] for label, _ in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            print(f"round {r + 1}")
            for k, (label, env) in enumerate(settings):
                if "MAGI_FLIGHT_RECORDER" in env:
                    env = {**env, "MAGI_FLIGHT_RECORDER_DIR": os.path.join(tmp, f"{r}.{k}")}
                us = run(env, calls)
                results[label].append(us)
                print(f"  {label:34s} {us:7.2f} us per call")
                if "MAGI_FLIGHT_RECORDER_DIR" in env:
                    where = env["MAGI_FLIGHT_RECORDER_DIR"]
                    files = [os.path.join(where, f) for f in os.listdir(where)]
                    report = subprocess.run([os.path.join(build, "magice-trace"), "hang", *files],
                                            capture_output=True, text=True)
                    first = (report.stdout or report.stderr).splitlines()[:1]
                    print("    " + (first[0] if first else "no report"))
    median = {label: statistics.median(v) for label, v in results.items()}
    print(f"median over {rounds} rounds")
    for label, _ in settings:
        extra = "" if label in ("no shim", "shim") else \
            f"  ({median[label] - median['shim']:+.2f} us over the shim)"
        print(f"  {label:34s} {median[label]:7.2f} us per call{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
