"""Unmodified PyTorch at world 2, 4 or 8 on ONE GPU, with the NCCL stand-in as its NCCL.

    torchrun --standalone --nproc_per_node W --no_python \\
        env LD_PRELOAD="[libmagice.so ]build/tests/support/libnccl.so.2" \\
            TORCH_STANDIN_NCCL=build/tests/support/libnccl.so.2 \\
        python3 torch_standin.py --out DIR [--programs fsdp2,dtensor,graph,compile]

Every rank uses cuda:0: real NCCL refuses two ranks on one GPU, the stand-in (tests/support/standin,
which stages device memory through host memory and records captured collectives into CUDA graphs)
does not. The programs, run in the order given, each save DIR/PROGRAM.rankR.pt (a dict of lists of
tensors) for ../gpu/compare_results.py to compare bitwise between a run with and one without
libmagice.so in front of the stand-in; each also checks its own results, so a wrong byte fails even
a run with nothing to compare with:
  fsdp2    FSDP2 (fully_shard) inference of multi/tiny_transformer.py: step 0 must match the
           unsharded model; the last-token logits of every step are saved.
  dtensor  DTensor full_tensor() of tensors sharded on dim 0 and 1 (and a redistribute to
           Replicate), every step: each must equal the tensor it was cut from.
  graph    a forward of gathered weights, an all-reduce, a reduce-scatter and a broadcast
           (c10d's in-place calls), run eagerly three times, then captured with
           torch.cuda.graph and replayed into poisoned outputs: each replay must match the eager
           forward of its input.
  compile  the same forward with functional collectives under
           torch.compile(mode="reduce-overhead") (CUDA graphs by Inductor's cudagraph trees):
           each call must match the eager forward. Says "compile: unavailable: WHY" and saves
           nothing where this PyTorch cannot compile; says whether cudagraphs were skipped.
The program waits for the GPU after each replay: the stand-in takes a captured collective's place
in its communicator's order when the replay reaches it, so no eager collective (nor the library's
own agreement rounds) may be issued while a replay is in flight, as with real NCCL's rule that a
communicator's work is issued in the same order on every rank.

Exit status 0 when every program given ran and checked out; 1 on the first failure (which names
the rank and the program), 2 when the environment is wrong (no CUDA, another NCCL in the process).
"""
import argparse
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = ("fsdp2", "dtensor", "graph", "compile")


class Failed(Exception):
    """A program's own check failed: the message says what, on which rank."""


class Unavailable(Exception):
    """This PyTorch lacks what a program needs (a SKIP, never a pass)."""


def say(ctx, text: str) -> None:
    if ctx.rank == 0:
        print(f"torch_standin: world {ctx.world}: {text}", flush=True)


def nccl_libraries() -> set:
    """The files named libnccl* mapped into this process."""
    paths = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(None, 5)[5].strip() if len(line.split(None, 5)) == 6 else ""
            if "libnccl" in os.path.basename(path):
                paths.add(os.path.realpath(path))
    return paths


def global_nccl_file() -> str:
    """The file that defines the ncclAllGather the process's global scope resolves to: what
    libtorch_cuda.so calls, whatever else is mapped (PyTorch may map its own NCCL by path,
    RTLD_LOCAL, beside the preloaded stand-in; the global scope, preloads first, wins)."""
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    process = ctypes.CDLL(None)
    try:
        symbol = ctypes.cast(process.ncclAllGather, ctypes.c_void_p)
    except AttributeError:
        return ""
    info = DlInfo()
    if not process.dladdr(symbol, ctypes.byref(info)) or not info.dli_fname:
        return ""
    return os.path.realpath(info.dli_fname.decode())


def standin_problem(rank: int, loaded: bool) -> str:
    """Why PyTorch's NCCL is not the stand-in, or "": its calls must reach the preloaded stand-in
    (directly, or through the library preloaded in front of it), and once a collective ran the
    stand-in must be mapped."""
    expected = os.environ.get("TORCH_STANDIN_NCCL", "")
    if not expected:
        return (f"torch_standin: rank {rank}: TORCH_STANDIN_NCCL is not set (the stand-in's path, "
                f"as preloaded)")
    want = os.path.realpath(expected)
    bound = global_nccl_file()
    if bound != want and os.path.basename(bound) != "libmagice.so":
        return (f"torch_standin: rank {rank}: ncclAllGather resolves to {bound or 'nothing'}, not "
                f"the stand-in {want}: preload it (LD_PRELOAD) (NCCL files mapped: "
                f"{sorted(nccl_libraries()) or 'none'})")
    if loaded and want not in nccl_libraries():
        return f"torch_standin: rank {rank}: the stand-in {want} is not mapped"
    return ""


class Ctx:
    def __init__(self, args, rank: int, world: int, torch, dist):
        self.args = args
        self.rank = rank
        self.world = world
        self.torch = torch
        self.dist = dist
        self.dev = torch.device("cuda", 0)

    def save(self, program: str, results: dict) -> None:
        os.makedirs(self.args.out, exist_ok=True)
        self.torch.save(results, os.path.join(self.args.out, f"{program}.rank{self.rank}.pt"))


# ---- fsdp2 -------------------------------------------------------------------------------------

def run_fsdp2(ctx) -> None:
    torch = ctx.torch
    sys.path.insert(0, os.path.join(HERE, "multi"))
    import dist_env
    import tiny_transformer as tt
    if not tt.fsdp2_available():
        raise Unavailable("torch.distributed.fsdp.fully_shard is not in this PyTorch")
    env = dist_env.Env(ctx.rank, ctx.world, 0, ctx.dev, False)
    margs = argparse.Namespace(layers=2, hidden=256, heads=4, ffn=1024, vocab=1024, batch=2,
                               seq=32, seed=1234)
    dtype = torch.bfloat16
    with torch.no_grad():
        reference = tt.build(margs, env, dtype)(tt.tokens_for(margs, env, 0)).float()
    model = tt.build(margs, env, dtype)
    tt.shard_fsdp2(model, prefetch=False)
    logits_per_step, hidden = [], None
    with torch.no_grad():
        for step in range(ctx.args.steps):
            logits, hidden = model(tt.tokens_for(margs, env, step), return_hidden=True)
            logits_per_step.append(logits[:, -1, :].float().cpu())  # also waits for the step
            if step == 0:
                diff = (logits.float() - reference).abs().max().item()
                scale = reference.abs().max().item()
                if not diff <= 1e-2 * scale:
                    raise Failed(f"rank {ctx.rank}: fsdp2: the sharded model differs from the "
                                 f"unsharded one at step 0 by {diff:.3g} (logits up to "
                                 f"{scale:.3g})")
    ctx.save("fsdp2", {"last_logits": logits_per_step, "final_hidden": [hidden.float().cpu()]})
    say(ctx, f"fsdp2: {ctx.args.steps} steps of FSDP2 inference ({margs.layers} blocks of hidden "
             f"{margs.hidden}), step 0 matches the unsharded model")


# ---- dtensor -----------------------------------------------------------------------------------

def run_dtensor(ctx) -> None:
    torch = ctx.torch
    try:
        from torch.distributed.device_mesh import init_device_mesh
        try:
            from torch.distributed.tensor import DTensor, Replicate, Shard
        except ImportError:  # before PyTorch 2.4
            from torch.distributed._tensor import DTensor, Replicate, Shard
    except ImportError as e:
        raise Unavailable(f"DTensor: {e}")
    mesh = init_device_mesh("cuda", (ctx.world,))
    w = ctx.world
    cases = [((w * 64, 32), 0, torch.float32), ((16, w * 24), 1, torch.bfloat16),
             ((w * 1000,), 0, torch.float32), ((w * 8, 5, 7), 0, torch.int32)]
    fulls = []
    for i, (shape, dim, dtype) in enumerate(cases):
        g = torch.Generator().manual_seed(100 + i)  # the same tensor on every rank
        if dtype == torch.int32:
            full = torch.randint(-1 << 20, 1 << 20, shape, generator=g, dtype=dtype)
        else:
            full = torch.randn(shape, generator=g).to(dtype)
        local = full.chunk(w, dim)[ctx.rank].contiguous().to(ctx.dev)
        fulls.append((full, DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)))
    results = {"full_tensor": [], "replicate": []}
    for step in range(ctx.args.steps):
        for i, (full, dt) in enumerate(fulls):
            got = dt.full_tensor().cpu()
            if not torch.equal(got, full):
                raise Failed(f"rank {ctx.rank}: dtensor: step {step}: full_tensor() of case {i} "
                             f"(shape {tuple(full.shape)}, Shard({cases[i][1]})) differs from the "
                             f"tensor it was cut from")
            results["full_tensor"].append(got)
    for i, (full, dt) in enumerate(fulls):
        got = dt.redistribute(mesh, [Replicate()]).to_local().cpu()
        if not torch.equal(got, full):
            raise Failed(f"rank {ctx.rank}: dtensor: redistribute to Replicate of case {i} differs")
        results["replicate"].append(got)
    ctx.save("dtensor", results)
    say(ctx, f"dtensor: {ctx.args.steps} steps of full_tensor() on {len(cases)} tensors, and a "
             f"redistribute each: every byte equal to the tensors cut")


# ---- the forward of graph and compile ------------------------------------------------------------

HIDDEN, LAYERS = 64, 3


class C10dOps:
    """c10d's in-place collectives, as an eager program calls them (and torch.cuda.graph captures
    them)."""

    def __init__(self, ctx):
        self.torch, self.dist, self.world = ctx.torch, ctx.dist, ctx.world

    def all_gather(self, shard):
        out = self.torch.empty((shard.shape[0] * self.world, *shard.shape[1:]), dtype=shard.dtype,
                               device=shard.device)
        self.dist.all_gather_into_tensor(out, shard)
        return out

    def all_reduce(self, x):
        y = x.clone()
        self.dist.all_reduce(y)
        return y

    def reduce_scatter(self, y):
        out = self.torch.empty((y.shape[0] // self.world, *y.shape[1:]), dtype=y.dtype,
                               device=y.device)
        self.dist.reduce_scatter_tensor(out, y.contiguous())
        return out

    def broadcast(self, z, src):
        r = z.clone()
        self.dist.broadcast(r, src=src)
        return r


class FunctionalOps:
    """Functional collectives, which torch.compile traces."""

    def __init__(self, ctx):
        import torch.distributed._functional_collectives as funcol
        self.funcol, self.group = funcol, ctx.dist.group.WORLD

    def all_gather(self, shard):
        return self.funcol.all_gather_tensor(shard, 0, self.group)

    def all_reduce(self, x):
        return self.funcol.all_reduce(x, "sum", self.group)

    def reduce_scatter(self, y):
        return self.funcol.reduce_scatter_tensor(y, "sum", 0, self.group)

    def broadcast(self, z, src):
        return self.funcol.broadcast(z, src, self.group)


def forward(x, shards, ops, world):
    """Each layer's weight gathered from the ranks' row shards, then the ranks' activations
    summed, scattered and one rank's part broadcast: the collectives a sharded model runs."""
    for shard in shards:
        x = torch.tanh(x @ ops.all_gather(shard))
    y = ops.all_reduce(x)
    z = ops.reduce_scatter(y)
    r = ops.broadcast(z, world - 1)
    return x, y, z, r


def forward_inputs(ctx):
    """The weights' shards (the same full weights on every rank) and a function giving this rank's
    input of call k."""
    torch = ctx.torch
    g = torch.Generator().manual_seed(77)
    hidden = ctx.args.hidden
    weights = [torch.randn(hidden, hidden, generator=g) / hidden ** 0.5 for _ in range(LAYERS)]
    shards = [w.chunk(ctx.world, 0)[ctx.rank].contiguous().to(ctx.dev) for w in weights]

    def input_of(k):
        gk = torch.Generator().manual_seed(1000 * ctx.rank + k)
        return torch.randn(2 * ctx.world, hidden, generator=gk).to(ctx.dev)

    return shards, input_of


def check_close(ctx, program, what, got, want, rtol, atol) -> None:
    torch = ctx.torch
    for name, a, b in zip("xyzr", got, want):
        if not torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol):
            diff = (a.float() - b.float()).abs().max().item()
            raise Failed(f"rank {ctx.rank}: {program}: {what}: output {name} differs from the "
                         f"eager forward by up to {diff:.3g}")


# ---- graph -------------------------------------------------------------------------------------

def run_graph(ctx) -> None:
    torch = ctx.torch
    shards, input_of = forward_inputs(ctx)
    ops = C10dOps(ctx)
    static_x = input_of(0).clone()
    eager = []
    # Three warm-ups on a side stream, as torch.cuda.graph's documentation asks.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(3):
            static_x.copy_(input_of(k))
            eager.append([t.cpu() for t in forward(static_x, shards, ops, ctx.world)])
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = forward(static_x, shards, ops, ctx.world)
    torch.cuda.synchronize()
    replays = []
    for k in range(ctx.args.replays):
        static_x.copy_(input_of(k))
        for o in outs:
            o.fill_(float("nan"))  # a byte the replay does not write cannot pass
        graph.replay()
        torch.cuda.synchronize()  # no eager collective while a replay is in flight
        got = [o.cpu() for o in outs]
        if k < 3:
            want = eager[k]
        else:
            want = [t.cpu() for t in forward(input_of(k), shards, ops, ctx.world)]
        torch.cuda.synchronize()
        check_close(ctx, "graph", f"replay {k}", got, want, rtol=1e-5, atol=1e-6)
        replays.extend(got)
    ctx.save("graph", {"eager": [t for call in eager for t in call], "replays": replays})
    del graph
    say(ctx, f"graph: 3 eager warm-ups, then {ctx.args.replays} replays of {LAYERS} gathers, an "
             f"all-reduce, a reduce-scatter and a broadcast captured with torch.cuda.graph: each "
             f"replay matches the eager forward")


# ---- compile -----------------------------------------------------------------------------------

def compile_unavailable(torch) -> str:
    """Why torch.compile cannot run here, or ""."""
    if not hasattr(torch, "compile"):
        return "torch.compile is not in this PyTorch"
    try:
        import torch._dynamo
        supported = getattr(torch._dynamo, "is_dynamo_supported", lambda: True)
        if not supported():
            return f"TorchDynamo does not support Python {sys.version.split()[0]}"
        from torch.utils._triton import has_triton
        if not has_triton():
            return "Triton is missing (Inductor needs it for the GPU)"
    except Exception as e:  # an import that breaks says it cannot compile as well
        return f"{type(e).__name__}: {e}"
    return ""


def run_compile(ctx) -> None:
    torch = ctx.torch
    why = compile_unavailable(torch)
    if why:
        raise Unavailable(why)
    shards, input_of = forward_inputs(ctx)
    ops = FunctionalOps(ctx)
    from torch._dynamo.utils import counters

    def step(x, s0, s1, s2):
        return forward(x, [s0, s1, s2], ops, ctx.world)

    compiled = torch.compile(step, mode="reduce-overhead")
    calls = []
    began = time.perf_counter()
    for k in range(ctx.args.compiled_calls):
        if hasattr(torch, "compiler") and hasattr(torch.compiler, "cudagraph_mark_step_begin"):
            torch.compiler.cudagraph_mark_step_begin()
        got = [t.clone().cpu() for t in compiled(input_of(k), *shards)]
        torch.cuda.synchronize()  # no eager collective while a replay is in flight
        want = [t.cpu() for t in step(input_of(k), *shards)]  # eager, functional collectives
        torch.cuda.synchronize()
        check_close(ctx, "compile", f"call {k}", got, want, rtol=1e-4, atol=1e-5)
        calls.extend(got)
    took = time.perf_counter() - began
    ctx.save("compile", {"calls": calls})
    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k and "skip" in k}
    skipped = sum(skips.values())
    say(ctx, f"compile: {ctx.args.compiled_calls} calls of the forward under "
             f"torch.compile(mode=\"reduce-overhead\") in {took:.1f} s, each matching the eager "
             f"forward; " + (f"cudagraphs skipped ({skips})" if skipped else
                             "cudagraphs not skipped (the later calls replay a CUDA graph)"))


RUNNERS = {"fsdp2": run_fsdp2, "dtensor": run_dtensor, "graph": run_graph, "compile": run_compile}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--programs", default="fsdp2,dtensor,graph")
    p.add_argument("--steps", type=int, default=16, help="fsdp2 and dtensor steps")
    p.add_argument("--replays", type=int, default=5, help="graph replays")
    p.add_argument("--hidden", type=int, default=HIDDEN,
                   help="graph and compile: the layers' width (a shard is hidden^2 / world floats)")
    p.add_argument("--compiled-calls", type=int, default=6, help="calls of the compiled forward")
    p.add_argument("--timeout-s", type=int, default=180, help="the process group's timeout")
    args = p.parse_args()
    programs = [x for x in args.programs.split(",") if x]
    unknown = [x for x in programs if x not in PROGRAMS]
    if unknown:
        print(f"torch_standin: unknown program(s) {unknown}; known: {', '.join(PROGRAMS)}",
              file=sys.stderr)
        return 2
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    # Every rank on cuda:0. DeviceMesh (DTensor's, FSDP2's) sets the device from LOCAL_RANK while
    # CUDA is not yet initialised: initialised first, and LOCAL_RANK 0 all the same.
    os.environ["LOCAL_RANK"] = "0"
    if not torch.cuda.is_available():
        print(f"torch_standin: rank {rank}: CUDA is not available to PyTorch", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")
    # The same kernels on both runs, so that any difference is the collectives'.
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Before the first collective, which another NCCL would refuse with two ranks on one GPU.
    problem = standin_problem(rank, loaded=False)
    if problem:
        print(problem, file=sys.stderr, flush=True)
        return 2
    # No device_id: it would make the communicator eager and bound to a device per rank; the
    # ranks' communicator is made at the first collective, on cuda:0 for all.
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    ctx = Ctx(args, rank, world, torch, dist)
    first = torch.ones(1, device=ctx.dev)
    dist.all_reduce(first)
    if first.item() != world:
        print(f"torch_standin: rank {rank}: the first all-reduce gave {first.item()}, not {world}",
              file=sys.stderr)
        return 1
    problem = standin_problem(rank, loaded=True)
    if problem:
        print(problem, file=sys.stderr, flush=True)
        return 2
    say(ctx, f"{world} ranks on cuda:0 over the stand-in ({os.environ['TORCH_STANDIN_NCCL']}), "
             f"PyTorch {torch.__version__}, programs {','.join(programs)}")
    status = 0
    for program in programs:
        began = time.perf_counter()
        try:
            RUNNERS[program](ctx)
        except Unavailable as e:
            say(ctx, f"{program}: unavailable: {e}")
            continue
        except Failed as e:
            print(f"torch_standin: FAILED {e}", file=sys.stderr, flush=True)
            status = 1
            break
        except Exception:
            print(f"torch_standin: rank {rank}: {program}: FAILED with an exception:\n"
                  f"{traceback.format_exc()}", file=sys.stderr, flush=True)
            status = 1
            break
        say(ctx, f"{program}: done in {time.perf_counter() - began:.1f} s")
    if status == 0:
        torch.cuda.synchronize()
        last = torch.ones(1, device=ctx.dev)
        dist.all_reduce(last)  # every rank done (barrier() would guess a device per rank)
        torch.cuda.synchronize()
        dist.destroy_process_group()  # the library's end-of-communicator lines come here
    return status


if __name__ == "__main__":
    sys.exit(main())
