"""How much all-gathers running on another stream slow a bf16 GEMM, for one configuration.

    torchrun --nproc-per-node N gemm_interference.py --config NAME --csv F [--gather-mib 64]

A batch of --gemms GEMMs (M = N = K = --dim, bf16) runs on one stream; in "overlapped" samples
all-gathers of --gather-mib MiB per rank run on another stream for at least as long (their count,
the same on every rank, is set from the slowest rank's timings before the timed phase). Alone and
overlapped samples alternate; the GEMM batch is timed by CUDA events on its own stream. Reports
the median GEMM batch time alone and overlapped, the slowdown (overlapped / alone - 1), and the
gathers' bus bandwidth while overlapped. Run it once per configuration (NCCL alone, the shim):
NCCL's gather kernels take SMs from the GEMM, copy-engine reads take none, only memory bandwidth.
"""
import argparse
import math
import sys

import torch
import torch.distributed as dist

from bench_common import add_common_args, append_rows, dist_env, median


def timed(stream, fn) -> float:
    """Milliseconds that fn's work takes on stream."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    with torch.cuda.stream(stream):
        fn()
    stop.record(stream)
    stop.synchronize()
    return start.elapsed_time(stop)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--gemms", type=int, default=20)
    p.add_argument("--gather-mib", type=int, default=64)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--samples", type=int, default=7)
    args = p.parse_args()

    env = dist_env.init()
    dev, world = env.device, env.world
    a = torch.randn(args.dim, args.dim, dtype=torch.bfloat16, device=dev)
    b = torch.randn(args.dim, args.dim, dtype=torch.bfloat16, device=dev)
    c = torch.empty(args.dim, args.dim, dtype=torch.bfloat16, device=dev)
    count = (args.gather_mib << 20) // 2
    inp = torch.randn(count, dtype=torch.bfloat16, device=dev)
    out = torch.empty(count * world, dtype=torch.bfloat16, device=dev)
    gemm_stream, gather_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def gemms():
        for _ in range(args.gemms):
            torch.mm(a, b, out=c)

    def gathers(n):
        for _ in range(n):
            dist.all_gather_into_tensor(out, inp)

    # Warm up both; the gathers long enough for the shim to agree on them.
    timed(gemm_stream, gemms)
    timed(gather_stream, lambda: gathers(args.warmup))
    gemm_ms = median([timed(gemm_stream, gemms) for _ in range(3)])
    gather_ms = median([timed(gather_stream, lambda: gathers(10)) / 10 for _ in range(3)])
    # Enough gathers to outlast the GEMM batch, by the slowest rank's figures: one collective
    # before the timed phase, then the gathers' step is found and agreed on again.
    plan = torch.tensor([gemm_ms, gather_ms], dtype=torch.float64, device=dev)
    dist.all_reduce(plan, op=dist.ReduceOp.MAX)
    n_gathers = max(4, math.ceil(1.2 * plan[0].item() / max(plan[1].item(), 1e-3)))
    timed(gather_stream, lambda: gathers(args.warmup))

    alone, overlapped, gather_during = [], [], []
    for _ in range(args.samples):
        torch.cuda.synchronize()
        alone.append(timed(gemm_stream, gemms))
        torch.cuda.synchronize()
        g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g0.record(gather_stream)
        with torch.cuda.stream(gather_stream):
            gathers(n_gathers)
        g1.record(gather_stream)
        overlapped.append(timed(gemm_stream, gemms))
        g1.synchronize()
        gather_during.append(g0.elapsed_time(g1) / n_gathers)

    result = torch.tensor([median(alone), median(overlapped), median(gather_during)],
                          dtype=torch.float64, device=dev)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    t_alone, t_over, t_gather = result.tolist()
    slowdown = t_over / t_alone - 1.0
    tflops = 2 * args.dim ** 3 * args.gemms / (t_alone * 1e-3) / 1e12
    busbw = (args.gather_mib << 20) * (world - 1) / (t_gather * 1e-3) / 1e9
    if env.rank == 0:
        append_rows(args.csv, [{
            "bench": "gemm_interference", "config": args.config, "rep": args.rep, "world": world,
            "dim": args.dim, "gemms": args.gemms, "gather_mib": args.gather_mib,
            "gathers_overlapped": n_gathers, "gemm_alone_ms": f"{t_alone:.3f}",
            "gemm_overlapped_ms": f"{t_over:.3f}", "slowdown_pct": f"{100 * slowdown:.2f}",
            "gemm_tflops_alone": f"{tflops:.1f}", "gather_ms_overlapped": f"{t_gather:.3f}",
            "gather_busbw_GBps_overlapped": f"{busbw:.1f}"}])
    env.log(f"gemm_interference {args.config} rep {args.rep}: GEMM batch {t_alone:.2f} ms alone "
            f"({tflops:.0f} TFLOP/s), {t_over:.2f} ms with {n_gathers} gathers of "
            f"{args.gather_mib} MiB/rank alongside: slowdown {100 * slowdown:.1f}%; a gather took "
            f"{t_gather:.3f} ms meanwhile (busbw {busbw:.1f} GB/s)")
    dist_env.finish(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
