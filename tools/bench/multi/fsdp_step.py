"""End-to-end step time of FSDP2 inference with the gathers overlapped, and where the time goes.

    torchrun --nproc-per-node N fsdp_step.py --config NAME --csv F [--layers 8 --hidden 4096 ...]

The transformer of tests/gpu/multi/tiny_transformer.py, larger by default, sharded with FSDP2
(each block prefetches the next one's gather, so gathers run under the previous block's
compute). Three phases, each timed by CUDA events on the compute stream after its own warmup
(long enough for the shim to find that phase's step and agree on it):
  step     the sharded forward pass: what a user sees;
  compute  the same forward pass on an unsharded copy: no communication at all;
  gathers  every FSDP module's unshard() and reshard() with no compute: the gathers alone.
exposed = step - compute is the communication the overlap did not hide. Run once per
configuration (NCCL alone, the shim) and compare the step times.
"""
import argparse
import sys

import torch

from bench_common import add_common_args, append_rows, dist_env, median
import tiny_transformer as tt


def timed_ms(fn, iters: int) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop))
    return median(samples)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p)
    tt.add_model_args(p)
    p.set_defaults(layers=8, hidden=4096, heads=32, ffn=16384, vocab=32768, batch=4, seq=512,
                   sharding="fsdp2")
    p.add_argument("--warmup", type=int, default=24)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()

    env = dist_env.init()
    dtype = tt.model_dtype(env)
    replica = tt.build(args, env, dtype)
    model = tt.build(args, env, dtype)
    how = tt.shard(model, env, args.sharding, prefetch=True)
    tokens = tt.tokens_for(args, env, 0)
    units = [m for m in model.modules() if hasattr(m, "unshard") and hasattr(m, "reshard")]

    def step():
        model(tokens)

    def compute():
        replica(tokens)

    def gathers_only():
        for m in units:
            m.unshard()
            m.reshard()

    phases = {}
    with torch.no_grad():
        for name, fn in (("step", step), ("compute", compute), ("gathers", gathers_only)):
            if name == "gathers" and not units:
                continue
            timed_ms(fn, args.warmup)
            phases[name] = timed_ms(fn, args.iters)
    # The slowest rank sets each phase, as it sets the step.
    names = sorted(phases)
    result = torch.tensor([phases[n] for n in names], dtype=torch.float64, device=env.device)
    torch.distributed.all_reduce(result, op=torch.distributed.ReduceOp.MAX)
    phases = dict(zip(names, result.tolist()))
    exposed = phases["step"] - phases["compute"]
    gathers = phases.get("gathers", float("nan"))
    hidden = (1.0 - exposed / gathers) if gathers == gathers and gathers > 0 else float("nan")
    full_bytes = sum(q.numel() * q.element_size() for q in replica.parameters())
    if env.rank == 0:
        append_rows(args.csv, [{
            "bench": "fsdp_step", "config": args.config, "rep": args.rep, "world": env.world,
            "layers": args.layers, "hidden": args.hidden, "tokens": args.batch * args.seq,
            "weights_MiB": full_bytes >> 20, "step_ms": f"{phases['step']:.3f}",
            "compute_ms": f"{phases['compute']:.3f}", "gathers_ms": f"{gathers:.3f}",
            "exposed_ms": f"{exposed:.3f}", "gathers_hidden_pct": f"{100 * hidden:.1f}"}])
    env.log(f"fsdp_step {args.config} rep {args.rep}: {how}, {args.layers} x {args.hidden}, "
            f"{full_bytes >> 20} MiB of weights gathered per step: step {phases['step']:.2f} ms, "
            f"compute alone {phases['compute']:.2f} ms, gathers alone {gathers:.2f} ms, exposed "
            f"{exposed:.2f} ms ({100 * hidden:.0f}% of the gather time hidden)")
    dist_env.finish(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
