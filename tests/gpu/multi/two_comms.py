"""Two communicators at once: the whole node, and 2-GPU subgroups split from it.

    torchrun --nproc-per-node N two_comms.py [--steps 32]

The default group spans every rank; dist.new_group makes pairs {0,1}, {2,3}, ... (the last rank
alone when N is odd), which NCCL builds with ncclCommSplit because the default group is bound to
a device. Every step gathers on the whole-node communicator on the current stream and, at the
same time, on this rank's pair on a second stream, then all-reduces on the pair; the two
communicators have different steps, so the shim agrees on each by itself. Every received element
is checked against the value computed for it; exits 1 if any is wrong.
"""
import argparse
import sys

import torch
import torch.distributed as dist

import allgather_check as agc
import dist_env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--world-kib", type=int, default=4096, help="per-rank shard, whole-node gather")
    p.add_argument("--pair-kib", type=int, default=1024, help="per-rank shard, pair gather")
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()

    env = dist_env.init(cpu=args.cpu)
    world, rank, dev = env.world, env.rank, env.device
    pairs = [list(range(r, min(r + 2, world))) for r in range(0, world, 2)]
    groups = [dist.new_group(ranks) for ranks in pairs]  # every rank makes every group, in order
    mine = pairs[rank // 2]
    pair = groups[rank // 2]
    env.log(f"two_comms: world {world}, pairs {pairs}, {args.steps} steps")

    # gloo of older PyTorch lacks bfloat16: the CPU check gathers float16 there instead.
    f32, bf16 = (torch.float32, 1 << 24), ((torch.float16, 2048) if env.cpu else (torch.bfloat16, 256))
    w_count = (args.world_kib << 10) // 4
    p_count = (args.pair_kib << 10) // 2
    w_in = torch.empty(w_count, dtype=f32[0], device=dev)
    w_out = torch.empty(w_count * world, dtype=f32[0], device=dev)
    p_in = torch.empty(p_count, dtype=bf16[0], device=dev)
    p_out = torch.empty(p_count * len(mine), dtype=bf16[0], device=dev)
    p_sum = torch.empty(1, dtype=torch.int64, device=dev)
    side = None if env.cpu else torch.cuda.Stream(dev)
    wrong = torch.zeros(3, dtype=torch.int64, device=dev)  # whole node, pair, pair all-reduce

    for step in range(args.steps):
        agc.fill_pattern(w_in, rank, step, f32[1])
        agc.poison(w_out, f32[1])
        # The pair's values differ from the whole node's (another step offset): a gather served
        # from the wrong communicator's window cannot pass.
        agc.fill_pattern(p_in, rank, step + 1000, bf16[1])
        agc.poison(p_out, bf16[1])
        p_sum.fill_(rank + step)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                dist_env.all_gather_into(p_out, p_in, group=pair)
                dist.all_reduce(p_sum, group=pair)
        else:
            dist_env.all_gather_into(p_out, p_in, group=pair)
            dist.all_reduce(p_sum, group=pair)
        dist_env.all_gather_into(w_out, w_in)
        if side is not None:
            torch.cuda.current_stream(dev).wait_stream(side)
        for r in range(world):
            wrong[0] += agc.count_wrong(w_out[r * w_count:(r + 1) * w_count], r, step, f32[1])
        for i, r in enumerate(mine):
            wrong[1] += agc.count_wrong(p_out[i * p_count:(i + 1) * p_count], r, step + 1000, bf16[1])
        wrong[2] += (p_sum != sum(mine) + step * len(mine)).sum()

    counts = wrong.tolist()
    total = wrong.clone()
    dist.all_reduce(total)
    print(f"  rank {rank}: whole node {counts[0]}, pair {counts[1]} wrong elements, "
          f"pair all-reduce wrong {counts[2]} times", flush=True)
    total_wrong = int(total.sum().item())
    env.log(f"two_comms: {args.steps} steps on 2 communicators at once, world {world}: "
            f"{total_wrong} wrong")
    dist_env.finish(env)
    return 1 if total_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
