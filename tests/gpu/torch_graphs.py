"""A step of unchanged weights, run eagerly and then captured into a CUDA graph and replayed, with
PyTorch at world size 1, as a user would run it.

Run it without and with LD_PRELOAD=libmagice.so (MAGI_STATIC_WEIGHTS=1 MAGI_CE_FORCE=1: the eager
steps agree on the plan and move the gathers, and the captured ones move with it) and compare the
saved results bitwise. Every replay writes into receive buffers poisoned just before it, so a byte
the graph does not write cannot pass. With --rewrite the weights change before every replay (the
default mode, MAGI_GRAPH_SLOTS=always: each replay must gather what they hold then).

    python3 torch_graphs.py OUT.pt [--rewrite]
"""
import os
import sys

import torch
import torch.distributed as dist


def main(out_path: str, rewrite: bool) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    torch.manual_seed(4321)
    dev = torch.device("cuda:0")
    # Weights loaded once and never changed, each its own allocation of a different size.
    weights = [torch.randn((1 << 16) * (i + 1), device=dev) for i in range(4)]
    fulls = [torch.empty(w.numel() * dist.get_world_size(), device=dev) for w in weights]
    logits = torch.ones(8, device=dev)

    def step() -> None:
        for w, full in zip(weights, fulls):
            dist.all_gather_into_tensor(full, w)
        logits.fill_(1.0)
        dist.all_reduce(logits)

    results = {"eager": [], "graph": []}
    for _ in range(24):  # long enough to agree and move (MAGI_CE_FORCE=1)
        step()
    torch.cuda.synchronize()
    results["eager"] = [f.cpu() for f in fulls] + [logits.cpu()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(5):
        if rewrite:
            for i, w in enumerate(weights):
                w.mul_(-1.0).add_(float(replay + i))
        for f in fulls:
            f.fill_(-1.0)
        logits.fill_(-1.0)
        graph.replay()
        torch.cuda.synchronize()
        results["graph"].extend([f.cpu() for f in fulls] + [logits.cpu()])
    print(f"graph: {len(results['graph'])} tensors from 5 replays")
    torch.save(results, out_path)
    del graph
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], "--rewrite" in sys.argv[2:])
