"""Sharded inference through unmodified PyTorch: the run the shim must not change by one bit.

    torchrun --nproc-per-node N fsdp_infer.py --out DIR [--steps 32] [--sharding auto|fsdp2|manual]

A small transformer (tiny_transformer.py; 4 layers of hidden 1024 by default) with the same
weights on every rank, sharded with FSDP2 (or flat shards gathered by hand where FSDP2 is
missing), runs --steps forward passes under no_grad, each rank on its own batch. Every block is
gathered on every step. Each rank saves DIR/rank<R>.pt: the last token's logits of every step and
the last step's final hidden states. Run it with and without LD_PRELOAD=libmagice.so and compare
the files with ../compare_results.py: moved gathers must give the same bytes as NCCL.
"""
import argparse
import os
import sys
import time

import torch

import dist_env
import tiny_transformer as tt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tt.add_model_args(p)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prefetch", action="store_true", help="FSDP2: prefetch the next block")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    env = dist_env.init(cpu=args.cpu)
    # The same kernels on both runs, so any difference is the gathers' (cuBLAS needs
    # CUBLAS_WORKSPACE_CONFIG for this; the driver sets it).
    torch.use_deterministic_algorithms(True, warn_only=True)
    # An unsharded copy answers step 0 first: the sharded model must reproduce it, or the
    # gathers rebuilt the wrong weights (a check that does not rely on the shim-less run).
    with torch.no_grad():
        reference = tt.build(args, env, tt.model_dtype(env))(tt.tokens_for(args, env, 0)).float()
    model = tt.build(args, env, tt.model_dtype(env))
    how = tt.shard(model, env, args.sharding, args.prefetch)
    env.log(f"fsdp_infer: world {env.world}, {how}, {args.layers} layers x hidden {args.hidden}, "
            f"batch {args.batch} x {args.seq} tokens, {args.steps} steps")

    last_logits, hidden, times, mismatch = [], None, [], False
    with torch.no_grad():
        for step in range(args.steps):
            began = time.perf_counter()
            logits, hidden = model(tt.tokens_for(args, env, step), return_hidden=True)
            last_logits.append(logits[:, -1, :].float().cpu())  # also waits for the step
            times.append(time.perf_counter() - began)
            if step == 0:
                diff = (logits.float() - reference).abs().max().item()
                scale = reference.abs().max().item()
                if not diff <= 1e-2 * scale:
                    print(f"fsdp_infer: rank {env.rank}: sharded model differs from the unsharded "
                          f"one at step 0 by {diff:.3g} (logits up to {scale:.3g})", flush=True)
                    mismatch = True
                del reference
    os.makedirs(args.out, exist_ok=True)
    torch.save({"last_logits": last_logits, "final_hidden": [hidden.float().cpu()]},
               os.path.join(args.out, f"rank{env.rank}.pt"))
    later = sorted(times[len(times) // 2:])
    state = "DIFFERS FROM" if mismatch else "matches"
    env.log(f"fsdp_infer: step 0 {state} the unsharded model; saved {len(last_logits)} steps to "
            f"{args.out}; median step of the second half {later[len(later) // 2] * 1e3:.2f} ms "
            f"(host clock)")
    dist_env.finish(env)
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
