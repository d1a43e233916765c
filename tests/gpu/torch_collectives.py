"""Unmodified PyTorch collectives at world size 1, as a user would run them.

Run it twice — without and with LD_PRELOAD=libmagice.so — and compare the saved results: the
shim must not change a single byte of a call it does not reroute.

    python3 torch_collectives.py OUT.pt
"""
import os
import sys

import torch
import torch.distributed as dist


def main(out_path: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    torch.manual_seed(1234)
    dev = torch.device("cuda:0")
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
        shard = (torch.randn(1 << 16, device=dev) * 100).to(dtype)
        gathered = torch.empty(shard.numel() * dist.get_world_size(), dtype=dtype, device=dev)
        dist.all_gather_into_tensor(gathered, shard)
        reduced = shard.clone()
        dist.all_reduce(reduced)
        scattered = torch.empty(shard.numel() // dist.get_world_size(), dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(scattered, shard.clone())
        broadcast = shard.clone()
        dist.broadcast(broadcast, src=0)
        results[str(dtype)] = [t.cpu() for t in (gathered, reduced, scattered, broadcast)]
    # A small FSDP-like loop: the same gathers, step after step, as the skeleton sees them; long
    # enough for the ranks to agree and then move the gathers. The weights change every step (in
    # place), so a moved gather must carry each step's bytes, not the first ones.
    weights = [torch.randn(4096, device=dev) for _ in range(4)]
    loop = []
    for step in range(16):
        for w in weights:
            w.add_(1.0)
            full = torch.empty_like(w)
            dist.all_gather_into_tensor(full, w)
            loop.append(full.cpu())
        logits = torch.ones(8, device=dev)
        dist.all_reduce(logits)
        loop.append(logits.cpu())
    results["loop"] = loop
    # The same step captured into a CUDA graph, then replayed: captured calls stay on NCCL (a
    # replay would repeat the transport's handshake), so the replays must give NCCL's bytes.
    torch.cuda.synchronize()
    replays = []
    try:
        outs = [torch.empty_like(w) for w in weights]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w, out in zip(weights, outs):
                dist.all_gather_into_tensor(out, w)
        for _ in range(3):
            for w in weights:
                w.add_(1.0)
            graph.replay()
            torch.cuda.synchronize()
            replays.extend(out.cpu() for out in outs)
        print(f"graph capture: {len(replays)} gathered tensors from 3 replays")
        results["graph"] = replays
    except Exception as e:
        # A PyTorch/NCCL that cannot capture: say so (run.sh counts a SKIP when the run without
        # the shim says it) and leave the replays out. A capture that fails under the shim alone
        # then leaves the result sets different, which compare_results.py reports.
        print(f"graph capture not available here: {e}")
    torch.cuda.synchronize()
    torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
