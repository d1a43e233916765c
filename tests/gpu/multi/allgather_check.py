"""All-gather correctness through unmodified PyTorch, in the style of nccl-tests.

    torchrun --nproc-per-node N allgather_check.py [--max-mib 1024] [--steps 32] [--static]
                                                    [--skew none|callsite|grouping] [--json F]

For every datatype PyTorch hands to NCCL and every size from 1 KiB to --max-mib MiB per rank
(powers of 4), in place (the input is this rank's chunk of the output) and out of place, the same
buffers are gathered --steps times in a row: enough for the shim to find the step, agree and move
the gather (a step of one gather is found after 9 calls, agreed about 4 later, then timed both
ways for 6). Before every call the input is rewritten with values that depend on rank, step and
index, and the output is poisoned with a value outside them; after it, every element is compared
bitwise with the value computed for it. With --static the inputs are written once and never
change (run it with MAGI_STATIC_WEIGHTS=1). --skew makes odd ranks differ from even ones in a way
NCCL accepts and the agreement must notice: another call site (dist.all_gather into a list: the
same NCCL call from other code), or another grouping (even ranks issue each gather inside a
coalescing group; every rank follows each gather with a small all-reduce outside any group).

Exits 1 when any element on any rank is wrong, and fails (a traceback, exit 1) when a gather
raises; a datatype this PyTorch cannot fill or hand to the process group is skipped before any
of its gathers, on every rank alike, and said ("  SKIP float8_e5m2: ...", counted by run.sh).
"""
import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import dist_env

BLOCK = 1 << 24  # elements compared at a time: bounds the temporaries at any size

# Products of small primes keep every value below 2^63; the rank and step terms are odd, so even
# with 8 distinct values (fp8 e5m2) neighbouring ranks and consecutive steps differ.
IDX_MUL, RANK_MUL, STEP_MUL, SALT = 40503, 7919, 104729, 12345


def dtypes_offered():
    """NCCL's datatypes that this PyTorch has, with how many exact values each can carry.
    The poison written before each call is that count: a value no input ever holds."""
    table = [
        ("float32", 1 << 24), ("float16", 2048), ("bfloat16", 256), ("int8", 127),
        ("uint8", 255), ("int32", 2**31 - 1), ("int64", 2**62), ("float64", 2**40),
        ("float8_e4m3fn", 16), ("float8_e5m2", 8), ("uint32", 2**32 - 1), ("uint64", 2**62),
    ]
    return [(name, getattr(torch, name), mod) for name, mod in table if hasattr(torch, name)]


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers: a bitwise comparison that NaN, -0.0 or fp8 cannot fool."""
    return t.view(BITS[t.element_size()])


def as_dtype(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point and dtype != torch.float64:
        v = v.to(torch.float32)  # exact: every value is below 2^24 for these types
    return v.to(dtype)


def pattern(rank: int, step: int, start: int, n: int, dtype, mod: int, device) -> torch.Tensor:
    idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
    v = torch.remainder(idx * IDX_MUL + (rank * RANK_MUL + step * STEP_MUL + SALT), mod)
    return as_dtype(v, dtype)


def fill_pattern(buf: torch.Tensor, rank: int, step: int, mod: int) -> None:
    for start in range(0, buf.numel(), BLOCK):
        n = min(BLOCK, buf.numel() - start)
        buf[start:start + n].copy_(pattern(rank, step, start, n, buf.dtype, mod, buf.device))


def poison(buf: torch.Tensor, mod: int) -> None:
    if buf.numel():
        value = as_dtype(torch.tensor([mod], dtype=torch.int64), buf.dtype)
        bits(buf).fill_(int(bits(value).item()))


def count_wrong(buf: torch.Tensor, rank: int, step: int, mod: int) -> torch.Tensor:
    wrong = torch.zeros((), dtype=torch.int64, device=buf.device)
    for start in range(0, buf.numel(), BLOCK):
        n = min(BLOCK, buf.numel() - start)
        expected = pattern(rank, step, start, n, buf.dtype, mod, buf.device)
        wrong += (bits(buf[start:start + n]) != bits(expected)).sum()
    return wrong


class Gather:
    """Issues one all-gather the way this rank's --skew says."""

    def __init__(self, env: dist_env.Env, skew: str):
        odd = env.rank % 2 == 1
        self.env = env
        self.as_list = skew == "callsite" and odd
        self.grouped = skew == "grouping" and not odd
        # An agreement round is never issued inside a group, so a step made only of grouped
        # calls is never agreed on at all: every step of the grouping skew also has this
        # ungrouped all-reduce, where the round can be anchored (and then find the skew).
        self.tick = torch.zeros(1, device=env.device) if skew == "grouping" else None

    def __call__(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if self.as_list:
            dist.all_gather(list(out.chunk(self.env.world)), inp)
        elif self.grouped:
            with c10d._coalescing_manager(device=self.env.device):
                dist.all_gather_into_tensor(out, inp)
        else:
            dist_env.all_gather_into(out, inp)
        if self.tick is not None:
            dist.all_reduce(self.tick)


def run_config(env, gather, dtype, mod, count, in_place, steps, static):
    """Wrong elements per chunk of the output (index = the rank the chunk came from), plus one
    more entry for a send buffer changed by an out-of-place gather."""
    world, rank, dev = env.world, env.rank, env.device
    out = torch.empty(count * world, dtype=dtype, device=dev)
    inp = out.narrow(0, rank * count, count) if in_place else torch.empty(count, dtype=dtype, device=dev)
    wrong = torch.zeros(world + 1, dtype=torch.int64, device=dev)
    for step in range(steps):
        value_step = 0 if static else step
        if step == 0 or not static:
            fill_pattern(inp, rank, value_step, mod)
        if in_place:
            poison(out[:rank * count], mod)
            poison(out[(rank + 1) * count:], mod)
        else:
            poison(out, mod)
        gather(out, inp)
        for r in range(world):
            wrong[r] += count_wrong(out[r * count:(r + 1) * count], r, value_step, mod)
        if not in_place:
            wrong[world] += count_wrong(inp, rank, value_step, mod)
    return wrong


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:160] if str(e) else type(e).__name__


def unusable(env, gather, dtype, mod) -> str:
    """Why this PyTorch cannot test `dtype`, or "" when it can. A type it cannot fill, compare
    or hand to the process group fails here on every rank alike, before any gather is counted:
    PyTorch refuses a type NCCL lacks with a TypeError before calling NCCL (gloo, under --cpu,
    with a RuntimeError). An error of the gather itself (a DistBackendError: NCCL's or the
    shim's) is no reason to skip: it propagates and fails the run."""
    try:
        inp = torch.empty(1, dtype=dtype, device=env.device)
        out = torch.empty(env.world, dtype=dtype, device=env.device)
        fill_pattern(inp, env.rank, 0, mod)
        poison(out, mod)
        count_wrong(inp, env.rank, 0, mod)
    except (RuntimeError, TypeError, ValueError) as e:
        return f"cannot fill or compare it: {first_line(e)}"
    try:
        gather(out, inp)
    except TypeError as e:
        return f"the process group refuses it: {first_line(e)}"
    except RuntimeError as e:
        if not env.cpu or isinstance(e, getattr(dist, "DistBackendError", ())):
            raise
        return f"gloo refuses it: {first_line(e)}"
    return ""


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--min-kib", type=int, default=1)
    p.add_argument("--max-mib", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--static", action="store_true", help="inputs written once (MAGI_STATIC_WEIGHTS=1)")
    p.add_argument("--skew", choices=("none", "callsite", "grouping"), default="none")
    p.add_argument("--dtypes", default="", help="comma list; default every one offered")
    p.add_argument("--modes", default="out,in", help="out (out of place), in (in place)")
    p.add_argument("--json", default="", help="rank 0 writes the results here")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (checks the harness only)")
    args = p.parse_args()
    if args.steps < 12:
        p.error("--steps must be at least 12: fewer never let the shim agree")

    env = dist_env.init(cpu=args.cpu)
    gather = Gather(env, args.skew)
    wanted = set(filter(None, args.dtypes.split(",")))
    dtypes = [d for d in dtypes_offered() if not wanted or d[0] in wanted]
    sizes = []
    nbytes = args.min_kib << 10
    while nbytes <= args.max_mib << 20:
        sizes.append(nbytes)
        nbytes *= 4
    modes = [m == "in" for m in args.modes.split(",")]
    env.log(f"allgather_check: world {env.world}, {len(dtypes)} datatypes, {len(sizes)} sizes "
            f"{size_text(sizes[0])}..{size_text(sizes[-1])} per rank, {args.steps} steps each, "
            f"static={args.static}, skew={args.skew}, PyTorch {torch.__version__}")

    results, totals, skipped = [], [], []
    for name, dtype, mod in dtypes:
        began = time.time()
        why = unusable(env, gather, dtype, mod)
        if why:
            env.log(f"  SKIP {name}: {why}")
            skipped.append(name)
            continue
        per_dtype = []
        for nbytes in sizes:
            count = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
            for in_place in modes:
                wrong = run_config(env, gather, dtype, mod, count, in_place, args.steps, args.static)
                per_dtype.append((nbytes, in_place, wrong))
        for nbytes, in_place, wrong in per_dtype:
            counts = wrong.tolist()
            results.append({"dtype": name, "bytes_per_rank": nbytes, "in_place": in_place,
                            "wrong_by_source_rank": counts[:-1], "send_buffer_changed": counts[-1]})
            totals.append(sum(counts))
        bad = sum(sum(w.tolist()) for _, _, w in per_dtype)
        if env.rank == 0 or bad:
            print(f"  rank {env.rank} {name:14s} {len(per_dtype):3d} gathers x {args.steps} steps: "
                  f"{bad} wrong elements ({time.time() - began:.1f} s)", flush=True)

    # Every rank learns every rank's count, so all exit alike.
    mine = torch.tensor(totals + [0], dtype=torch.int64, device=env.device)
    dist.all_reduce(mine)
    total_wrong = int(mine.sum().item())
    for res, mine_wrong in zip(results, totals):
        if mine_wrong:
            print(f"  WRONG on rank {env.rank}: {res['dtype']} {size_text(res['bytes_per_rank'])} "
                  f"{'in place' if res['in_place'] else 'out of place'}: by source rank "
                  f"{res['wrong_by_source_rank']}, send buffer changed {res['send_buffer_changed']}",
                  flush=True)
    if env.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"world": env.world, "static": args.static, "skew": args.skew,
                       "configs": len(results), "wrong": total_wrong, "rank0": results}, f, indent=1)
    env.log(f"allgather_check: {len(results)} configurations x {args.steps} steps, world "
            f"{env.world}: {total_wrong} wrong elements; {len(skipped)} datatypes skipped"
            f"{' (' + ', '.join(skipped) + ')' if skipped else ''}")
    dist_env.finish(env)
    if not results:
        env.log("allgather_check: no datatype could be tested: nothing was checked")
    return 1 if total_wrong or not results else 0


if __name__ == "__main__":
    sys.exit(main())
