"""A rank SIGKILLed while gathers are moving: the others must end, never hang.

    killed_rank.py --nproc N [--victim R] [--kill-step S] [--steps T] [--watchdog-s W]
                   [--deadline-s D] [--no-kill] [--cpu] [--linger-s L]

torchrun cannot run this check: when one worker dies it tears the others down itself, so no one
would ever see whether they hung. This file is its own launcher instead: it starts N copies of
itself as ranks (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in their environment, whatever
else the caller exported, LD_PRELOAD included, passed through), waits, and reports.

Each rank gathers four flat bf16 shards of different sizes per step (all_gather_into_tensor, as
FSDP does), uses them in a matmul and waits for the step. At --kill-step the victim (the last
rank by default: rank 0 holds the rendezvous store) kills itself with SIGKILL. The survivors
then block in the step's gathers — inside NCCL's kernels, or inside the shim's transport waiting
on the dead peer — until PyTorch's watchdog notices the collective passed its timeout
(--watchdog-s) and acts as TORCH_NCCL_ASYNC_ERROR_HANDLING says: 1 aborts the communicators and ends the process,
2 only aborts them (the blocked main thread must come free: its next collective raises, and the
rank exits 3), 3 (PyTorch's default) ends the process without aborting.

Exits 0 when every survivor ended within --deadline-s of the kill, and ended as a freed survivor
does: its main thread came free and saw the collective fail (exit 3), or PyTorch's watchdog ended
the process (SIGABRT, from its thread's uncaught error). 1 when one was still running then (it
is killed, and the line says HUNG), or ended otherwise: exit 0 (it ran on past a dead peer), a
traceback (exit 1), a crash (another signal). The victim must have died by its own SIGKILL.
--no-kill runs the same program with no victim (every rank must exit 0): the launcher and the
ranks checked end to end, also at world size 1. --cpu runs the ranks over gloo on the CPU (whose
own timeout, or the dead peer's closed socket, then frees the survivors), and --linger-s keeps a
freed survivor alive as a hung one would be: the launcher's kill and deadline checked without GPUs.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time

FREED = 3  # the main thread came free after an abort and saw the collective fail
# How a survivor may end: freed (above), or ended by PyTorch's watchdog, whose thread's uncaught
# error aborts the process (TORCH_NCCL_ASYNC_ERROR_HANDLING 1 and 3).
SURVIVOR_ENDINGS = {FREED: "freed", -signal.SIGABRT: "ended by the watchdog (SIGABRT)"}


def ending_text(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exited {code}"


def judge(ended: dict, nproc: int, victim, killed_at, deadline_s: float):
    """The verdict on how the ranks ended: (failed, lines). `ended` maps a rank that ended to
    (its return code, when); a rank missing from it was still running at the deadline."""
    failed = False
    lines = []
    for r in range(nproc):
        if r not in ended:
            lines.append(f"rank {r} HUNG: still running {deadline_s} s after the kill (killed now)")
            failed = True
            continue
        code, when = ended[r]
        after = ""
        if killed_at is not None and r != victim:
            after = f", {when - killed_at:.1f} s after the kill"
        if victim is None:
            ok = code == 0
            why = "" if ok else " (without a victim every rank must exit 0)"
        elif r == victim:
            ok = code == -signal.SIGKILL
            why = "" if ok else " (the victim must die by its own SIGKILL)"
        else:
            ok = code in SURVIVOR_ENDINGS
            why = (f" ({SURVIVOR_ENDINGS[code]})" if ok else
                   f" (NOT how a survivor ends: freed, exit {FREED}, or by the watchdog, SIGABRT)")
        lines.append(f"rank {r} {ending_text(code)}{after}{why}")
        failed = failed or not ok
    if victim is not None and killed_at is None:
        lines.append("the victim never died (the job ended before the kill step)")
        failed = True
    lines.append("FAILED" if failed else "every rank ended")
    return failed, lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> int:
    port = str(free_port())
    ranks = []
    for r in range(args.nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.nproc),
                   LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        argv = [sys.executable, os.path.abspath(__file__), "--rank-main", *sys.argv[1:]]
        ranks.append(subprocess.Popen(argv, env=env))
    victim = None if args.no_kill or args.nproc < 2 else args.victim % args.nproc
    mode = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3 (default)")
    print(f"killed_rank: {args.nproc} ranks, victim {victim if victim is not None else 'none'}, "
          f"kill at step {args.kill_step} of {args.steps}, watchdog {args.watchdog_s} s, "
          f"TORCH_NCCL_ASYNC_ERROR_HANDLING={mode}", flush=True)

    began = time.monotonic()
    killed_at = None
    ended = {}
    overall = args.startup_s + args.deadline_s
    while len(ended) < len(ranks):
        now = time.monotonic()
        for r, proc in enumerate(ranks):
            if r not in ended and proc.poll() is not None:
                ended[r] = (proc.returncode, now)
                if r == victim:
                    killed_at = now
        # The deadline counts from the kill; before it, the start-up (NCCL's and the shim's) gets
        # a limit of its own, so a job that never reaches the kill fails too.
        limit = killed_at + args.deadline_s if killed_at is not None else began + overall
        if now > limit:
            break
        time.sleep(0.05)

    for r, proc in enumerate(ranks):
        if r not in ended:
            proc.kill()
            proc.wait()
    failed, lines = judge(ended, len(ranks), victim, killed_at, args.deadline_s)
    for line in lines:
        print(f"killed_rank: {line}", flush=True)
    return 1 if failed else 0


def rank_main(args) -> int:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import dist_env

    env = dist_env.init(cpu=args.cpu, timeout_s=args.watchdog_s)
    victim = None if args.no_kill or env.world < 2 else args.victim % env.world
    dtype = torch.float32 if env.cpu else torch.bfloat16
    # Four sizes, not one: a step of identical gathers has no position a gather could keep.
    counts = [(args.shard_mib << 20) // dtype.itemsize + i * 4096 for i in range(4)]
    shards = [torch.randn(c, dtype=dtype, device=env.device) for c in counts]
    fulls = [torch.empty(c * env.world, dtype=dtype, device=env.device) for c in counts]
    x = torch.randn(256, 1024, dtype=dtype, device=env.device)
    try:
        for step in range(args.steps):
            if step == args.kill_step and env.rank == victim:
                print(f"killed_rank: rank {env.rank} kills itself at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            acc = torch.zeros_like(x)
            for shard, full in zip(shards, fulls):
                dist_env.all_gather_into(full, shard)
                acc += x @ full[: 1024 * 1024].view(1024, 1024)
            dist_env.synchronize(env)
    except RuntimeError as e:  # the communicator was aborted under us: the main thread is free
        # (DistBackendError and gloo's errors are RuntimeErrors; anything else is a bug of this
        # program, whose traceback and exit 1 fail the check.)
        print(f"killed_rank: rank {env.rank} freed at step {step}: {type(e).__name__}: "
              f"{str(e).splitlines()[0][:160]}", flush=True)
        time.sleep(args.linger_s)
        os._exit(FREED)  # no teardown: the process group is broken
    dist_env.finish(env)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--victim", type=int, default=-1, help="the rank that dies (default: the last)")
    p.add_argument("--kill-step", type=int, default=16)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--shard-mib", type=int, default=4)
    p.add_argument("--watchdog-s", type=int, default=20, help="the process group's timeout")
    p.add_argument("--deadline-s", type=int, default=120, help="survivors must end within this")
    p.add_argument("--startup-s", type=int, default=180, help="limit to reach the kill")
    p.add_argument("--no-kill", action="store_true")
    p.add_argument("--cpu", action="store_true",
                   help="gloo on the CPU: the launcher and the kill checked without GPUs")
    p.add_argument("--linger-s", type=float, default=0,
                   help="a freed survivor stays this long, as a hung one would (the launcher's check)")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    return rank_main(args) if args.rank_main else launch(args)


if __name__ == "__main__":
    sys.exit(main())
