"""A small decoder-only transformer and two ways to shard it for inference.

`fsdp2`: torch.distributed.fsdp.fully_shard on every block and the root, as a user of FSDP2
would (per-parameter Shard(0) DTensors; each block's parameters gathered by one all-gather).
`manual`: for a PyTorch without FSDP2, each block's parameters are flattened, padded and split
into equal shards (FSDP1's flat parameter); a forward pre-hook gathers the block with
all_gather_into_tensor and a forward hook frees it again. Both gather every block on every step,
which is the traffic the shim is meant to move.
"""
import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import dist_env


def attention(q, k, v):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).unbind(2)
        a = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens, return_hidden=False):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return (self.head(x), x) if return_hidden else self.head(x)


def build(args, env: dist_env.Env, dtype: torch.dtype) -> nn.Module:
    """The same full weights on every rank (one seed), then sharded."""
    torch.manual_seed(args.seed)
    # Made on the GPU where PyTorch can (seeded alike, the same values on every rank): a
    # benchmark-sized model takes seconds to initialise on the CPU.
    on_device = not env.cpu and hasattr(torch.device, "__enter__")
    with env.device if on_device else contextlib.nullcontext():
        model = TinyTransformer(args.layers, args.hidden, args.heads, args.ffn, args.vocab)
        for p in model.parameters():  # larger than the default init: every layer moves the output
            p.data.normal_(0.0, 0.05)
    return model.to(device=env.device, dtype=dtype)


def fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        return True
    except Exception:  # ImportError, or an old PyTorch that breaks while importing it
        return False


def shard_fsdp2(model: TinyTransformer, prefetch: bool) -> str:
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    if prefetch:  # issue the next block's gather before this block's compute
        blocks = list(model.blocks)
        for this, nxt in zip(blocks, blocks[1:]):
            this.set_modules_to_forward_prefetch([nxt])
    return "fsdp2 (fully_shard)"


class FlatShard:
    """One block's parameters as one padded flat tensor, of which this rank keeps 1/world."""

    def __init__(self, module: nn.Module, env: dist_env.Env):
        self.params = list(module.parameters())
        self.shapes = [p.shape for p in self.params]  # the parameters are empty between gathers
        self.world = env.world
        total = sum(p.numel() for p in self.params)
        self.padded = -(-total // env.world) * env.world
        flat = torch.zeros(self.padded, dtype=self.params[0].dtype, device=env.device)
        offset = 0
        for p in self.params:
            flat[offset:offset + p.numel()].copy_(p.data.reshape(-1))
            offset += p.numel()
        # The shard stays at one address for the whole run, like FSDP's: a stable send buffer.
        self.shard = flat.chunk(env.world)[env.rank].clone()
        self.full = None
        self.release()
        module.register_forward_pre_hook(lambda _m, _i: self.gather())
        module.register_forward_hook(lambda _m, _i, _o: self.release())

    def gather(self):
        self.full = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        dist_env.all_gather_into(self.full, self.shard)
        offset = 0
        for p, shape in zip(self.params, self.shapes):
            p.data = self.full[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()

    def release(self):
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.full = None


def shard_manual(model: TinyTransformer, env: dist_env.Env) -> str:
    # The root's own parameters (embedding, final norm, head) are one more flat shard; its hooks
    # wrap the whole forward, so they stay gathered while the blocks run, as FSDP's root does.
    model._flat_shards = [FlatShard(block, env) for block in model.blocks]
    root_params = nn.ModuleList([model.embed, model.ln_f, model.head])
    root = FlatShard(root_params, env)
    model.register_forward_pre_hook(lambda _m, _i: root.gather())
    model.register_forward_hook(lambda _m, _i, _o: root.release())
    model._flat_shards.append(root)
    return "manual (flat shards gathered with all_gather_into_tensor)"


def shard(model, env, how: str, prefetch: bool = False) -> str:
    if how == "auto":
        how = "fsdp2" if not env.cpu and fsdp2_available() else "manual"
    return shard_fsdp2(model, prefetch) if how == "fsdp2" else shard_manual(model, env)


def add_model_args(p) -> None:
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--sharding", choices=("auto", "fsdp2", "manual"), default="auto")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, float32 (harness check)")


def tokens_for(args, env: dist_env.Env, step: int) -> torch.Tensor:
    """Each rank its own batch (data parallel), the same on every run."""
    g = torch.Generator().manual_seed(args.seed * 1000003 + env.rank * 7919 + step)
    return torch.randint(args.vocab, (args.batch, args.seq), generator=g).to(env.device)


def model_dtype(env: dist_env.Env) -> torch.dtype:
    return torch.float32 if env.cpu else torch.bfloat16
