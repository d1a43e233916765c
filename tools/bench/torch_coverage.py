#!/usr/bin/env python3
"""Coverage with PyTorch and the real NCCL at world size 1 (needs a GPU): how many of an
all_gather_into_tensor loop's calls leave NCCL, phase by phase.

The loop is nccl-tests' shape, in PyTorch: for each size, out of place then in place (the
input a view of the output's own chunk), 1 warmup call, N timed calls and 1 check call, each
from a line of its own. The driver runs it under LD_PRELOAD=BUILD/libmagice.so with a trace,
reads the trace back with magice-trace dump, and prints the timed calls moved in each phase;
it also checks the check call's bytes.

  tools/bench/torch_coverage.py BUILD_DIR [--iters N] [--warmup-steps W]
"""
import os
import re
import subprocess
import sys
import tempfile

SIZES = [1 << 12, 1 << 16, 1 << 20, 1 << 24]  # bytes gathered in all


def loop(iters: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dev = torch.device("cuda:0")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    for size in SIZES:
        for in_place in (False, True):
            out = torch.empty(size // 4, dtype=torch.float32, device=dev)
            shard = out if in_place else torch.empty(size // 4, dtype=torch.float32, device=dev)
            shard.copy_(torch.arange(size // 4, dtype=torch.float32, device=dev))
            dist.all_gather_into_tensor(out, shard)  # warmup
            for _ in range(iters):
                dist.all_gather_into_tensor(out, shard)  # timed
            shard.add_(1.0)
            expected = shard.clone()
            dist.all_gather_into_tensor(out, shard)  # check
            torch.cuda.synchronize()
            if not torch.equal(out, expected):
                raise SystemExit(f"wrong bytes at {size} bytes, in place {in_place}")
    dist.destroy_process_group()


def main() -> None:
    if sys.argv[1] == "--loop":
        loop(int(sys.argv[2]))
        return
    build = os.path.abspath(sys.argv[1])
    iters = int(sys.argv[sys.argv.index("--iters") + 1]) if "--iters" in sys.argv else 40
    warmup = sys.argv[sys.argv.index("--warmup-steps") + 1] if "--warmup-steps" in sys.argv else "3"
    with tempfile.TemporaryDirectory() as trace_dir:
        env = dict(os.environ, LD_PRELOAD=f"{build}/libmagice.so", MAGI_TRACE_DIR=trace_dir,
                   MAGI_CE_FORCE="1", MAGI_WARMUP_STEPS=warmup, MAGI_LOG="INFO",
                   MAGI_LOG_SUBSYS="REWRITE")
        done = subprocess.run([sys.executable, __file__, "--loop", str(iters)], env=env,
                              capture_output=True, text=True)
        log = [l for l in done.stderr.splitlines() if "MAGI" in l and "served off NCCL" in l]
        if done.returncode != 0:
            sys.exit(f"the loop failed:\n{done.stderr[-3000:]}")
        gathers = []
        for trace in os.listdir(trace_dir):
            dump = subprocess.run([f"{build}/magice-trace", "dump", os.path.join(trace_dir, trace)],
                                  capture_output=True, text=True, check=True).stdout
            for line in dump.splitlines():
                f = line.split()
                if len(f) > 3 and re.fullmatch(r"[0-9a-f]{12}", f[0]) and f[1].isdigit() and \
                        f[2] == "AllGather":
                    gathers.append(f[-1] == "moved")
    per_phase = iters + 2
    phases = len(gathers) // per_phase
    moved = [sum(gathers[p * per_phase + 1: p * per_phase + 1 + iters]) for p in range(phases)]
    print(f"PyTorch all_gather_into_tensor, world size 1, real NCCL, MAGI_WARMUP_STEPS={warmup}, "
          f"{iters} timed calls a phase ({len(gathers)} all-gathers traced)")
    for p, m in enumerate(moved):
        size = SIZES[p // 2] if p // 2 < len(SIZES) else 0
        print(f"  {size:>9} bytes {'in place    ' if p % 2 else 'out of place'}: {m} of {iters} "
              f"timed calls moved")
    if moved:
        print(f"  worst {100 * min(moved) / iters:.0f}%, mean {100 * sum(moved) / len(moved) / iters:.0f}%")
    for line in log:
        print("  " + line.split("MAGI INFO REWRITE ")[-1])


if __name__ == "__main__":
    main()
