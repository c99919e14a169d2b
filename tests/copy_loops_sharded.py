"""The pieces of tests/copy_loops.py that shard the model (TP layers and plan, expert parallelism,
ring attention, the pipeline executor, parallelize_3d): each trains as a torch user writes it,
saves its state (a file per rank where the piece shards it, on rank 0 alone where every rank holds
it whole), rebuilds from other initial values, loads and trains on, beside the single-process
reference. Loaded by copy_loops.py with its helpers as the module `copy_loops`; imports: the
standard library, torch.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from copy_loops import (
    CLIP,
    SEQ,
    STEPS,
    Reference,
    adamw,
    batch,
    finish_step,
    fresh,
    params_diff,
    rel,
    resume,
    save_on_rank0,
    save_per_rank,
    whole,
)


def tensor_parallel(M, model, ref, args):
    tp = importlib.import_module("tensor_parallel.parallelize")
    gather_full = importlib.import_module("tensor_parallel.sharding").gather_full
    clip_grads_by_global_norm_ = importlib.import_module("common.kernel.clip").clip_grads_by_global_norm_
    group = dist.group.WORLD

    def build(net):
        specs = tp.parallelize_llama(net, group, sequence_parallel=True)  # every rank: the same data
        return net, specs, *adamw(net.parameters())

    def train(steps):
        counted = [p for n, p in net.named_parameters() if specs[n].counted_here]  # each piece once
        norms = []
        for step in steps:
            tokens = batch(step, 4, net.cfg.vocab_size)
            for micro in tokens.split(2):  # gradient accumulation: 2 micro-batches
                tp.vocab_parallel_loss(net.output, net(micro[:, :-1]), micro[:, 1:]).div(2).backward()
            norm = clip_grads_by_global_norm_([p.grad for p in net.parameters()], CLIP,
                                              counted=[p.grad for p in counted], groups=(group,))
            norms.append(finish_step(opt, sched, norm, ref, tokens))
        return norms

    net, specs, opt, sched = build(model)
    norms = train(range(STEPS))
    saved = save_per_rank(args, whole(net, opt, sched))  # each rank's TP pieces
    net, specs, opt, sched = build(fresh(M, model))
    resume(saved, net, opt, sched)
    norms += train([STEPS])
    return norms, params_diff(gather_full(dict(net.named_parameters()), specs).items(), ref)


def expert_parallelism(M, model, ref, args):
    """The user's MoE model (tiny-moe with 2 layers: one dense, one MoE) with its experts split over
    the world, each rank its own rows: the user's DP all-reduces the replicated gradients; an
    expert's arrives summed over its EP group (the all-to-all's backward); both ÷ world."""
    ep = importlib.import_module("tensor_parallel.expert_parallel")
    clip_grads_by_global_norm_ = importlib.import_module("common.kernel.clip").clip_grads_by_global_norm_
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    model = M.build_model(M.get_config("tiny-moe", n_layers=2), seed=0, dtype=torch.float64)
    ref, mine = Reference(model, M), ep.expert_slice(rank, world, model.cfg.n_experts)

    def build(net):
        ep.expert_parallel(net, group)  # each MoE layer keeps its E/ep experts, dispatches by all-to-all
        return net, *adamw(net.parameters())

    def train(steps):
        norms = []
        for step in steps:
            tokens = batch(step, 2 * world, net.cfg.vocab_size)
            rows = tokens[2 * rank:2 * rank + 2]
            M.loss_fn(net(rows[:, :-1]), rows[:, 1:]).backward()
            for name, p in net.named_parameters():
                if not ep.is_expert(name):
                    dist.all_reduce(p.grad)
                p.grad /= world
            counted = [p.grad for n, p in net.named_parameters() if ep.is_expert(n) or rank == 0]
            norm = clip_grads_by_global_norm_([p.grad for p in net.parameters()], CLIP, counted=counted,
                                              groups=(group,))  # disjoint experts, the rest once
            norms.append(finish_step(opt, sched, norm, ref, tokens))
        return norms

    net, opt, sched = build(model)
    norms = train(range(STEPS))
    saved = save_per_rank(args, whole(net, opt, sched))  # each rank's experts
    net, opt, sched = build(fresh(M, model))
    resume(saved, net, opt, sched)
    norms += train([STEPS])
    full = ref.params()
    return norms, max(rel(p.detach(), full[n][mine] if ep.is_expert(n) else full[n])
                      for n, p in net.named_parameters())


def ring_attention(M, model, ref, args):
    cp = importlib.import_module("tensor_parallel.context_parallel")
    layout = importlib.import_module("tensor_parallel.context_layout")
    rank, world = dist.get_rank(), dist.get_world_size()
    positions = layout.sequence_positions(SEQ, world, rank)

    def build(net):
        cp.apply_context_parallel(net, dist.group.WORLD, variant="ring", layout="zigzag")
        return net, *adamw(net.parameters())

    def train(steps):
        norms = []
        for step in steps:
            tokens = batch(step, 4, net.cfg.vocab_size)
            for micro in tokens.split(2):  # this rank's zig-zag chunks of every row's tokens
                x, y = (layout.shard_sequence(t, world, rank) for t in (micro[:, :-1], micro[:, 1:]))
                M.loss_fn(net(x, positions), y).div(2).backward()
            for p in net.parameters():  # the user's DP over the CP ranks: the mean of equal shares
                dist.all_reduce(p.grad)
                p.grad /= world
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP, foreach=False)
            norms.append(finish_step(opt, sched, norm, ref, tokens))
        return norms

    net, opt, sched = build(model)
    norms = train(range(STEPS))
    saved = save_on_rank0(args, lambda: whole(net, opt, sched))  # the weights are whole on every rank
    net, opt, sched = build(fresh(M, model))
    resume(saved, net, opt, sched)
    norms += train([STEPS])
    return norms, params_diff(net.named_parameters(), ref)


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
    clip_grads_by_global_norm_ = importlib.import_module("common.kernel.clip").clip_grads_by_global_norm_
    rank, p, m = dist.get_rank(), dist.get_world_size(), 2
    names = {id(q): n for n, q in model.named_parameters()}
    per = model.cfg.n_layers // p

    def build(net):
        stage = UserStage(M, net, range(rank * per, (rank + 1) * per), rank == 0, rank == p - 1)
        executor = PipelineExecutor(make_schedule("1f1b", p, m), rank, [stage], M.loss_fn,
                                    (1, SEQ, net.cfg.dim), torch.float64, torch.device("cpu"))
        return net, stage, executor, *adamw(stage.parameters())

    def train(steps):
        norms = []
        for step in steps:
            tokens = batch(step, m, net.cfg.vocab_size)
            executor.run(list(tokens[:, :-1].split(1)), list(tokens[:, 1:].split(1)), [torch.arange(SEQ)] * m)
            norm = clip_grads_by_global_norm_([q.grad for q in stage.parameters()], CLIP,
                                              groups=(dist.group.WORLD,))
            norms.append(finish_step(opt, sched, norm, ref, tokens))
        return norms

    net, stage, executor, opt, sched = build(model)
    norms = train(range(STEPS))
    saved = save_per_rank(args, whole(stage, opt, sched))  # each rank's stage
    net, stage, executor, opt, sched = build(fresh(M, model))
    names = {id(q): names[id(old)] for q, old in zip(net.parameters(), model.parameters(), strict=True)}
    resume(saved, stage, opt, sched)
    norms += train([STEPS])
    return norms, params_diff([(names[id(q)], q) for q in stage.parameters()], ref)


def parallel_3d(M, model, ref, args):
    mod = {n: importlib.import_module(n) for n in ("common.kernel.mesh", "parallel3d.parallelize",
                                                  "parallel3d.shards", "parallel3d.clip",
                                                  "pipeline.executor", "pipeline.schedules",
                                                  "tensor_parallel.parallelize")}
    P3, device, micro, m = mod["parallel3d.parallelize"], torch.device("cpu"), 1, 2
    mesh = mod["common.kernel.mesh"].build_mesh(mod["common.kernel.mesh"].mesh_shape(4, tp=2, pp=2))  # dp = 1

    def build(seed: int):
        config = P3.Parallel3DConfig(schedule="1f1b", sequence_parallel=True, seed=seed)
        meta = M.build_model(model.cfg, dtype=torch.float64, device="meta")
        chunks, tp_specs = P3.parallelize_3d(meta, mesh, config, device)
        head = chunks[-1].module.output

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return mod["tensor_parallel.parallelize"].vocab_parallel_loss(head, logits, targets)

        executor = mod["pipeline.executor"].PipelineExecutor(
            mod["pipeline.schedules"].make_schedule("1f1b", mesh.pp, m), mesh.pp_rank, chunks, loss,
            P3.activation_shape(model.cfg, mesh, config, micro, SEQ), torch.float64, device, mesh.pp_group)
        return chunks, mod["parallel3d.shards"].shard_map(chunks, tp_specs, mesh), executor, *adamw(
            [q for c in chunks for q in c.parameters()])

    def train(steps):
        norms = []
        for step in steps:
            tokens = batch(step, m * micro, model.cfg.vocab_size)
            executor.run(*zip(*(P3.rank_inputs(t, mesh) for t in tokens.split(micro)), strict=True))
            norm = mod["parallel3d.clip"].clip_grad_norm_3d(shards, CLIP)
            norms.append(finish_step(opt, sched, norm, ref, tokens))
        return norms

    chunks, shards, executor, opt, sched = build(0)
    norms = train(range(STEPS))
    states = [c.state_dict() for c in chunks]  # a collective over each chunk's data-parallel group
    saved = save_per_rank(args, {"chunks": states, "optimizer": opt.state_dict(),
                                 "scheduler": sched.state_dict()})
    chunks, shards, executor, opt, sched = build(1)
    for chunk, state in zip(chunks, saved["chunks"], strict=True):
        chunk.load_state_dict(state)
    opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])
    norms += train([STEPS])
    final = mod["parallel3d.shards"].gather_full(shards, lambda u: u.flat_param)  # rank 0's
    return norms, params_diff(final.items(), ref) if final else 0.0


PIECES = {"TP layers and plan": tensor_parallel, "expert parallelism": expert_parallelism,
          "ring attention": ring_attention,
          "pipeline schedule and executor": pipeline, "parallelize_3d": parallel_3d}
