"""What the multi-GPU scripts share: the process group as torchrun hands it over, and gathers.

Every script runs unchanged at any world size (torchrun --nproc-per-node N). `--cpu` runs the same
logic over gloo on the CPU, so the harness itself can be checked on a machine without a GPU; the
shim is only ever exercised through NCCL.
"""
import datetime
import os

import torch
import torch.distributed as dist


class Env:
    def __init__(self, rank: int, world: int, local_rank: int, device: torch.device, cpu: bool):
        self.rank = rank
        self.world = world
        self.local_rank = local_rank
        self.device = device
        self.cpu = cpu

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)


def init(cpu: bool = False, timeout_s: int = 600) -> Env:
    """Joins the job torchrun started. A collective that waits longer than timeout_s fails the
    process (NCCL's watchdog aborts it) instead of hanging the run."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    timeout = datetime.timedelta(seconds=timeout_s)
    if cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # A bound device makes the default group's communicator eager, and new_group() then
        # splits it (ncclCommSplit) rather than creating an unrelated one.
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout,
                                device_id=device)
    return Env(rank, world, local_rank, device, cpu)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """all_gather_into_tensor, as a program would call it. gloo builds without it (older
    PyTorch) gather into the chunks of `out` instead: the same bytes land in the same places."""
    if out.device.type == "cuda" or _gloo_has_into():
        dist.all_gather_into_tensor(out, inp, group=group)
    else:
        world = dist.get_world_size(group)
        dist.all_gather(list(out.chunk(world)), inp, group=group)


_GLOO_INTO = None


def _gloo_has_into() -> bool:
    """Whether gloo serves all_gather_into_tensor here; probed once with a one-element gather,
    which every rank runs at the same point, so all take the same branch afterwards."""
    global _GLOO_INTO
    if _GLOO_INTO is None and not hasattr(dist, "all_gather_into_tensor"):
        _GLOO_INTO = False
    if _GLOO_INTO is None:
        world = dist.get_world_size()
        probe = torch.zeros(world, dtype=torch.int32)
        try:
            dist.all_gather_into_tensor(probe, torch.ones(1, dtype=torch.int32))
            _GLOO_INTO = True
        except (RuntimeError, NotImplementedError):
            _GLOO_INTO = False
    return _GLOO_INTO


def synchronize(env: Env) -> None:
    if not env.cpu:
        torch.cuda.synchronize(env.device)


def finish(env: Env) -> None:
    synchronize(env)
    dist.barrier()
    dist.destroy_process_group()
