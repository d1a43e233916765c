"""All-gather time per call and bus bandwidth against message size, for one configuration.

    torchrun --nproc-per-node N allgather_bw.py --config NAME --csv F [--method collective|torch_lc]

--method collective: dist.all_gather_into_tensor, out of place, bf16: NCCL alone, or the shim
when the process runs under LD_PRELOAD (run.sh sets the environment per configuration).
--method torch_lc: PyTorch's torch.ops.symm_mem._low_contention_all_gather (copy-engine reads
of symmetric memory) where this PyTorch has it; a row with status "skipped" where not.

Per size: --warmup calls first (the shim finds a step of one gather after 9 calls, agrees about 4
later and times both routes for 6 more), then --samples samples of k back-to-back calls timed by
CUDA events on the calling stream; the median sample gives the time per call. The slowest rank's
median is reported. busbw = bytes per rank x (N - 1) / time, as nccl-tests counts it.
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist

from bench_common import add_common_args, append_rows, dist_env, median, sizes

SAMPLE_BYTES = 512 << 20  # output bytes per timed sample: long enough for events, short overall
SIZE_MARK = "allgather_bw: size"


def lc_gather_factory(env, count):
    """Returns a no-argument gather through _low_contention_all_gather, or raises why not."""
    import torch.distributed._symmetric_memory as symm
    if not hasattr(torch.ops.symm_mem, "_low_contention_all_gather"):
        raise RuntimeError("torch.ops.symm_mem._low_contention_all_gather is missing")
    group_name = dist.group.WORLD.group_name
    if hasattr(symm, "enable_symm_mem_for_group"):
        symm.enable_symm_mem_for_group(group_name)
    inp = symm.empty(count, dtype=torch.bfloat16, device=env.device)
    symm.rendezvous(inp, group_name)
    inp.normal_()
    return lambda: torch.ops.symm_mem._low_contention_all_gather(inp, group_name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--method", choices=("collective", "torch_lc"), default="collective")
    p.add_argument("--min-kib", type=int, default=4)
    p.add_argument("--max-mib", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--samples", type=int, default=5)
    args = p.parse_args()

    env = dist_env.init()
    world = env.world
    all_sizes = sizes(args.min_kib, args.max_mib)
    times = torch.full((len(all_sizes),), float("nan"), dtype=torch.float64, device=env.device)
    skipped = ""
    began = time.time()
    for i, nbytes in enumerate(all_sizes):
        count = nbytes // 2
        # Where this size begins in the log: report.py files the shim's cost lines that follow
        # (what its cost round measured and kept) under it.
        env.log(f"{SIZE_MARK} {nbytes}")
        if args.method == "torch_lc":
            try:
                gather = lc_gather_factory(env, count)
                gather()
                torch.cuda.synchronize()
            except Exception as e:  # every rank fails alike: the op or symmetric memory is missing
                skipped = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                break
        else:
            inp = torch.randn(count, dtype=torch.bfloat16, device=env.device)
            out = torch.empty(count * world, dtype=torch.bfloat16, device=env.device)

            def gather(out=out, inp=inp):
                dist.all_gather_into_tensor(out, inp)
        for _ in range(args.warmup):
            gather()
        k = max(5, min(200, SAMPLE_BYTES // (nbytes * world)))
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(args.samples):
            torch.cuda.synchronize()
            start.record()
            for _ in range(k):
                gather()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) * 1e3 / k)  # microseconds per call
        times[i] = median(samples)
    if skipped:
        env.log(f"allgather_bw {args.config}: skipped: {skipped}")
    # The slowest rank's median: one collective after all timing, so it changes no step timed.
    times = torch.nan_to_num(times, nan=-1.0)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    rows = []
    for nbytes, t in zip(all_sizes, times.tolist()):
        ok = t > 0
        rows.append({"bench": "allgather_bw", "config": args.config, "rep": args.rep, "world": world,
                     "bytes_per_rank": nbytes, "time_us": f"{t:.3f}" if ok else "",
                     "algbw_GBps": f"{nbytes * world / t / 1e3:.3f}" if ok else "",
                     "busbw_GBps": f"{nbytes * (world - 1) / t / 1e3:.3f}" if ok else "",
                     "status": "ok" if ok else ("skipped: " + skipped if skipped else "missing")})
    if env.rank == 0:
        append_rows(args.csv, rows)
    done = [r for r in rows if r["status"] == "ok"]
    env.log(f"allgather_bw {args.config} rep {args.rep}: {len(done)} sizes in {time.time() - began:.1f} s"
            + "".join(f"\n  {r['bytes_per_rank'] >> 10:>8} KiB  {float(r['time_us']):10.1f} us  "
                      f"algbw {float(r['algbw_GBps']):7.1f}  busbw {float(r['busbw_GBps']):7.1f} GB/s"
                      for r in done))
    dist_env.finish(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
