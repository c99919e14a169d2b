"""The user's side of tests/test_copy_sets.py: a script that every rank runs (common/forkrun.py)
with a copied piece in an empty directory. `isolate` first leaves that directory as the only place
project code can come from: the repository's modules are dropped from sys.modules, its editable
install's finder from sys.meta_path, and sys.path keeps the copy, the standard library and
site-packages. Then a plain training loop of the kind torch's docs and nanoGPT write runs with the
copied piece, beside a single-process replica (torch's AdamW, LambdaLR, clip_grad_norm_) on the
whole batch, both in float64; rank 0 prints one line, COPY-RESULT {json}: the largest relative
difference of every clipping norm and of every final parameter, and the file of every project
module the run imported.

    python tests/copy_loops.py PIECE COPY_DIR WORK_DIR [--zero-accumulates]   (under forkrun)

The model is common/model.py's LLaMA at `tiny` with 2 layers: the copy's own when the piece's set
holds it, else the same file copied beside the piece as `user_model` (the user's model).
Imports at the top: the standard library and torch only.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
import sysconfig
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

SEQ, CLIP, LR, STEPS = 8, 1.0, 1e-2, 2  # CLIP 1.0 (nanoGPT's): the first steps' norms exceed it
PACKAGES = (*os.environ.get("COPY_PACKAGES", "").split(","), "user_model")


def isolate(root: str) -> None:
    """Only `root` (and the stdlib, site-packages) can provide project modules from now on."""
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    keep = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    sys.path[:] = [root] + [p for p in sys.path if any(p == k or p.startswith(k + os.sep) for k in keep)]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()


def project_files() -> list[str]:
    """The file of every loaded project module (each must be in the copy)."""
    return sorted({str(getattr(m, "__file__", None)) for n, m in list(sys.modules.items())
                   if n.split(".")[0] in PACKAGES})


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


def batch(step: int, rows: int, vocab: int) -> torch.Tensor:
    """Token rows [rows, SEQ + 1] of step `step`, the same on every rank."""
    return torch.randint(vocab, (rows, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 2)


def fresh(M, model):
    """The same architecture with other initial values (what a resume must overwrite)."""
    return M.build_model(model.cfg, seed=1, dtype=torch.float64)


class Reference:
    """The single-process replica: the whole batch, torch's AdamW, LambdaLR and clip."""

    def __init__(self, model, M):
        self.model, self.M = copy.deepcopy(model), M
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
        self.sched = LambdaLR(self.opt, warmup)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.M.loss_fn(self.model(tokens[:, :-1]), tokens[:, 1:]).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP, foreach=False)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return norm

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())


def adamw(params, wrapper=None, **kwargs):
    """AdamW (or `wrapper(params, AdamW, ...)`: ZeroOptimizer) and its LR schedule."""
    settings = {"lr": LR, "weight_decay": 0.1, "foreach": False}
    opt = (wrapper(params, torch.optim.AdamW, **kwargs, **settings) if wrapper
           else torch.optim.AdamW(params, **settings))
    return opt, LambdaLR(opt, warmup)


def data_parallel_steps(model, opt, sched, ref, steps, reduce, clip=None, no_sync=None, micro_batches=2):
    """A data-parallel user loop: this rank's 2 rows (of 2 per rank) as `micro_batches` backward
    passes (`no_sync` around all but the last), `reduce()` after them, clip (torch's unless
    `clip`), step, schedule, zero_grad; the norms' differences from the reference's."""
    rank, world, diffs = dist.get_rank(), dist.get_world_size(), []
    for step in steps:
        tokens = batch(step, 2 * world, ref.model.cfg.vocab_size)
        for k, micro in enumerate(tokens[2 * rank:2 * rank + 2].chunk(micro_batches)):
            with no_sync() if no_sync is not None and k < micro_batches - 1 else nullcontext():
                ref.M.loss_fn(model(micro[:, :-1]), micro[:, 1:]).div(micro_batches).backward()
        reduce()
        norm = clip() if clip else torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        diffs.append(rel(norm, ref.step(tokens)))
    return diffs


def params_diff(named, ref: Reference) -> float:
    return max(rel(p.detach(), ref.params()[n]) for n, p in named)


def round_trip(net, opt, sched, rebuild, wrapper=None, **kwargs):
    """`net`, `opt` and `sched`'s state_dicts loaded into fresh ones as torch's docs resume (build,
    then load); `rebuild()` makes the new net from other initial values."""
    saved = net.state_dict(), opt.state_dict(), sched.state_dict()
    net = rebuild()
    net.load_state_dict(saved[0])
    opt, sched = adamw(net.parameters(), wrapper, **kwargs)
    opt.load_state_dict(saved[1])
    sched.load_state_dict(saved[2])
    return net, opt, sched


# --- the pieces ---------------------------------------------------------------------------------

def ddp(M, model, ref, args):
    DDP = importlib.import_module("data_parallel.ddp").DistributedDataParallel
    net = DDP(model, bucket_cap_mb=0.01)  # a few buckets
    opt, sched = adamw(net.parameters())
    norms = data_parallel_steps(net, opt, sched, ref, range(STEPS), lambda: None, no_sync=net.no_sync)
    net, opt, sched = round_trip(net, opt, sched, lambda: DDP(fresh(M, model), bucket_cap_mb=0.01))
    norms += data_parallel_steps(net, opt, sched, ref, [STEPS], lambda: None, no_sync=net.no_sync)
    return norms, params_diff(net.module.named_parameters(), ref)


def ring(M, model, ref, args):
    ring_all_reduce = importlib.import_module("ring_allreduce.ring").ring_all_reduce

    def reduce() -> None:  # the user's own DP: one flat all-reduce of every gradient, then ÷ n
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        ring_all_reduce(flat)  # SUM, synchronous (dist.all_reduce's call shape)
        flat /= dist.get_world_size()
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    opt, sched = adamw(model.parameters())
    norms = data_parallel_steps(model, opt, sched, ref, range(STEPS), reduce)
    return norms, params_diff(model.named_parameters(), ref)


def zero_train(net, opt, sched, ref, steps, stage: int, accumulate: bool) -> list[float]:
    """ZeroOptimizer's loop: its own clip (torch's at stage 0, where p.grad is the reduced gradient,
    in the new API); 2 backward passes, the first under no_sync, where the API takes any number."""
    clip = None if accumulate and stage == 0 else (lambda: opt.clip_grad_norm_(CLIP))
    return data_parallel_steps(net, opt, sched, ref, steps, lambda: None, clip,
                               opt.no_sync if accumulate else None, 2 if accumulate else 1)


def zero(M, model, ref, args):
    ZeroOptimizer = importlib.import_module("zero.optimizer").ZeroOptimizer
    accumulate = args.zero_accumulates  # the plain-keyword API: any number of backward passes
    norms, diffs = [], []
    for stage in (0, 2):
        net, reference = copy.deepcopy(model), Reference(model, M)
        opt, sched = adamw(net.parameters(), ZeroOptimizer, stage=stage)
        norms += zero_train(net, opt, sched, reference, range(STEPS), stage, accumulate)
        # its state_dict is consolidated (every rank the whole): loaded into a fresh one
        net, opt, sched = round_trip(net, opt, sched, lambda: fresh(M, model), ZeroOptimizer, stage=stage)
        norms += zero_train(net, opt, sched, reference, [STEPS], stage, accumulate)
        diffs.append(params_diff(net.named_parameters(), reference))
    return norms, max(diffs)


def fsdp(M, model, ref, args):
    FSDP = importlib.import_module("fsdp.fully_sharded").FullyShardedDataParallel
    ModuleWrapPolicy = importlib.import_module("fsdp.wrap").ModuleWrapPolicy

    def wrap(net):
        return FSDP(net, auto_wrap_policy=ModuleWrapPolicy({M.TransformerBlock}))

    net = wrap(model)
    opt, sched = adamw(net.parameters())  # the flat shards
    norms = data_parallel_steps(net, opt, sched, ref, range(STEPS), lambda: None,
                                lambda: net.clip_grad_norm_(CLIP), net.no_sync)
    net, opt, sched = round_trip(net, opt, sched, lambda: wrap(fresh(M, model)))  # full tensors; shards
    norms += data_parallel_steps(net, opt, sched, ref, [STEPS], lambda: None,
                                 lambda: net.clip_grad_norm_(CLIP), net.no_sync)
    return norms, params_diff(net.state_dict().items(), ref)


def tensor_parallel(M, model, ref, args):
    tp = importlib.import_module("tensor_parallel.parallelize")
    gather_full = importlib.import_module("tensor_parallel.sharding").gather_full
    clip_grads_by_global_norm_ = importlib.import_module("common.clip").clip_grads_by_global_norm_
    group = dist.group.WORLD
    specs = tp.parallelize_llama(model, group, sequence_parallel=True)  # every rank: the same data
    opt, sched = adamw(model.parameters())
    counted = [p for n, p in model.named_parameters() if specs[n].counted_here]  # each piece once
    norms = []
    for step in range(STEPS):
        tokens = batch(step, 4, model.cfg.vocab_size)
        for micro in tokens.split(2):  # gradient accumulation: 2 micro-batches
            tp.vocab_parallel_loss(model.output, model(micro[:, :-1]), micro[:, 1:]).div(2).backward()
        norm = clip_grads_by_global_norm_([p.grad for p in model.parameters()], CLIP,
                               counted=[p.grad for p in counted], groups=(group,))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        norms.append(rel(norm, ref.step(tokens)))
    return norms, params_diff(gather_full(dict(model.named_parameters()), specs).items(), ref)


def ring_attention(M, model, ref, args):
    cp = importlib.import_module("tensor_parallel.context_parallel")
    rank, world = dist.get_rank(), dist.get_world_size()
    cp.apply_context_parallel(model, dist.group.WORLD, variant="ring", layout="zigzag")
    positions = cp.sequence_positions(SEQ, world, rank)
    opt, sched = adamw(model.parameters())
    norms = []
    for step in range(STEPS):
        tokens = batch(step, 4, model.cfg.vocab_size)
        for micro in tokens.split(2):  # this rank's zig-zag chunks of every row's tokens
            x, y = (cp.shard_sequence(t, world, rank) for t in (micro[:, :-1], micro[:, 1:]))
            M.loss_fn(model(x, positions), y).div(2).backward()
        for p in model.parameters():  # the user's DP over the CP ranks: the mean of equal shares
            dist.all_reduce(p.grad)
            p.grad /= world
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        norms.append(rel(norm, ref.step(tokens)))
    return norms, params_diff(model.named_parameters(), ref)


class UserStage(torch.nn.Module):
    """The user's own cut of their LLaMA into pipeline stages: the embedding, a run of blocks, the
    head; forward(x, positions) as the executor calls it."""

    def __init__(self, M, model, layers: range, first: bool, last: bool):
        super().__init__()
        self.M, self.cfg = M, model.cfg
        self.embed = model.tok_embeddings if first else None
        self.layers = torch.nn.ModuleList(model.layers[i] for i in layers)
        self.head = torch.nn.Sequential(model.norm, model.output) if last else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        cos, sin = self.M.rope_cos_sin(self.cfg, positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.head(h) if self.head is not None else h


def pipeline(M, model, ref, args):
    PipelineExecutor = importlib.import_module("pipeline.executor").PipelineExecutor
    make_schedule = importlib.import_module("pipeline.schedules").make_schedule
    clip_grads_by_global_norm_ = importlib.import_module("common.clip").clip_grads_by_global_norm_
    rank, p, m = dist.get_rank(), dist.get_world_size(), 2
    names = {id(q): n for n, q in model.named_parameters()}
    per = model.cfg.n_layers // p
    stage = UserStage(M, model, range(rank * per, (rank + 1) * per), rank == 0, rank == p - 1)
    executor = PipelineExecutor(make_schedule("1f1b", p, m), rank, [stage], M.loss_fn,
                                (1, SEQ, model.cfg.dim), torch.float64, torch.device("cpu"))
    opt, sched = adamw(stage.parameters())
    norms = []
    for step in range(STEPS):
        tokens = batch(step, m, model.cfg.vocab_size)
        executor.run(list(tokens[:, :-1].split(1)), list(tokens[:, 1:].split(1)), [torch.arange(SEQ)] * m)
        norm = clip_grads_by_global_norm_([q.grad for q in stage.parameters()], CLIP,
                                            groups=(dist.group.WORLD,))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        norms.append(rel(norm, ref.step(tokens)))
    return norms, params_diff([(names[id(q)], q) for q in stage.parameters()], ref)


def parallel_3d(M, model, ref, args):
    mod = {n: importlib.import_module(n) for n in ("common.mesh", "parallel3d.parallelize",
                                                  "parallel3d.shards", "parallel3d.clip",
                                                  "pipeline.executor", "pipeline.schedules",
                                                  "tensor_parallel.parallelize")}
    P3, device, micro = mod["parallel3d.parallelize"], torch.device("cpu"), 1
    mesh = mod["common.mesh"].build_mesh(mod["common.mesh"].mesh_shape(4, tp=2, pp=2))  # dp = 1
    config = P3.Parallel3DConfig(schedule="1f1b", sequence_parallel=True)
    meta = M.build_model(model.cfg, dtype=torch.float64, device="meta")
    chunks, tp_specs = P3.parallelize_3d(meta, mesh, config, device)
    shards = mod["parallel3d.shards"].shard_map(chunks, tp_specs, mesh)
    head, m = chunks[-1].module.output, 2

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return mod["tensor_parallel.parallelize"].vocab_parallel_loss(head, logits, targets)

    executor = mod["pipeline.executor"].PipelineExecutor(
        mod["pipeline.schedules"].make_schedule("1f1b", mesh.pp, m), mesh.pp_rank, chunks, loss,
        P3.activation_shape(model.cfg, mesh, config, micro, SEQ), torch.float64, device, mesh.pp_group)
    opt, sched = adamw([q for c in chunks for q in c.parameters()])
    norms = []
    for step in range(STEPS):
        tokens = batch(step, m * micro, model.cfg.vocab_size)
        executor.run(*zip(*(P3.rank_inputs(t, mesh) for t in tokens.split(micro)), strict=True))
        norm = mod["parallel3d.clip"].clip_grad_norm_3d(shards, CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        norms.append(rel(norm, ref.step(tokens)))
    final = mod["parallel3d.shards"].gather_full(shards, lambda u: u.flat_param)  # rank 0's
    return norms, params_diff(final.items(), ref) if final else 0.0


def checkpoint(M, model, ref, args):
    save, load, state, reshard = (importlib.import_module(f"parallel3d.checkpoint.{n}")
                                  for n in ("save", "load", "state", "reshard"))
    rank, world = dist.get_rank(), dist.get_world_size()

    def reduce() -> None:  # the user's own DP
        for q in model.parameters():
            dist.all_reduce(q.grad)
            q.grad /= world

    opt, sched = adamw(model.parameters())
    norms = data_parallel_steps(model, opt, sched, ref, range(STEPS), reduce)
    halves = {}  # each rank saves its half of every (replicated) tensor, as a flat range
    for n, q in model.named_parameters():
        start, end = q.numel() * rank // world, q.numel() * (rank + 1) // world
        region = reshard.Region(tuple(q.shape), (0,) * q.dim(), tuple(q.shape), start, end - start)
        halves[n] = state.ParamSlice(q, region, start)
    root = Path(args.work) / "ckpt"
    save.save_checkpoint(root, STEPS, {**state.model_shards(halves), **state.optimizer_shards(opt, halves)},
                         {"scheduler": sched.state_dict(), "param_groups": state.param_groups_state(opt)},
                         rank_state=state.capture_rng_state())
    model = fresh(M, model)  # and every rank reads it all
    opt, sched = adamw(model.parameters())
    state.init_optimizer_state(opt)
    whole = {n: state.ParamSlice(q, reshard.Region.full(tuple(q.shape))) for n, q in model.named_parameters()}
    loaded = load.load_checkpoint(root, {**state.model_shards(whole), **state.optimizer_shards(opt, whole)})
    state.load_param_groups_state(opt, loaded.state["param_groups"])
    sched.load_state_dict(loaded.state["scheduler"])
    state.restore_rng_state(loaded.rank_state)
    norms += data_parallel_steps(model, opt, sched, ref, [STEPS], reduce)
    return norms, params_diff(model.named_parameters(), ref)


PIECES = {"DDP": ddp, "ring all-reduce": ring, "ZeroOptimizer": zero, "FSDP": fsdp,
          "TP layers and plan": tensor_parallel, "ring attention": ring_attention,
          "pipeline schedule and executor": pipeline, "parallelize_3d": parallel_3d,
          "checkpoint save/load": checkpoint}


def main() -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("piece", choices=PIECES)
    p.add_argument("copy")
    p.add_argument("work")
    p.add_argument("--zero-accumulates", action="store_true")
    args = p.parse_args()
    isolate(args.copy)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        M = importlib.import_module("common.model" if (Path(args.copy) / "common/model.py").exists()
                                    else "user_model")
        model = M.build_model(M.get_config("tiny", n_layers=2), seed=0, dtype=torch.float64)
        norms, params = PIECES[args.piece](M, model, Reference(model, M), args)
        worst = torch.tensor([max(norms), params], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print("COPY-RESULT " + json.dumps({"norms": worst[0].item(), "params": worst[1].item(),
                                               "steps": len(norms), "files": project_files()}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
