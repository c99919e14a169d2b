"""The user's side of tests/test_copy_sets.py: a script that every rank runs (common/forkrun.py)
with a copied piece in an empty directory. `isolate` first leaves that directory as the only place
project code can come from: the repository's modules are dropped from sys.modules, its editable
install's finder from sys.meta_path, and sys.path keeps the copy, the standard library and
site-packages. Then a plain training loop of the kind torch's docs and nanoGPT write runs with the
copied piece, beside a single-process replica (torch's AdamW, LambdaLR, clip_grad_norm_) on the
whole batch, both in float64. After STEPS steps it checkpoints as a torch user does (a master-only
`if rank == 0: torch.save(...)`, after the piece's collective consolidation where it has one; a
file per rank where the piece shards its state), rebuilds the piece from other initial values,
loads every rank from the files and trains one step more. Rank 0 prints one line, COPY-RESULT
{json}: the largest relative difference of every clipping norm and of every final parameter, and
the file of every project module the run imported.

    python tests/copy_loops.py PIECE COPY_DIR WORK_DIR   (under forkrun)

The model is common/kernel/model.py's LLaMA at `tiny` with 2 layers: the copy's own when the piece's set
holds it, else the same file copied beside the piece as `user_model` (the user's model).
Imports at the top: the standard library and torch only.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
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
        diffs.append(finish_step(opt, sched, norm, ref, tokens))
    return diffs


def finish_step(opt, sched, norm: torch.Tensor, ref: Reference, tokens: torch.Tensor) -> float:
    """Step, schedule and zero as a torch user does; the clipping norm's difference from the
    reference's step on the whole batch."""
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return rel(norm, ref.step(tokens))


def params_diff(named, ref: Reference) -> float:
    return max(rel(p.detach(), ref.params()[n]) for n, p in named)


# --- the torch user's checkpoints: a master-only save where the state is whole on every rank (or
# is consolidated first), a file per rank where a piece shards it; every rank loads, then resumes --

def save_on_rank0(args, state) -> dict:
    """`if rank == 0: torch.save(state(), path)` (state() built on rank 0 alone: a collective in it
    would hang), then every rank loads the file."""
    path = Path(args.work) / "checkpoint.pt"
    if dist.get_rank() == 0:
        torch.save(state(), path)
    dist.barrier()
    return torch.load(path)


def save_per_rank(args, state: dict) -> dict:
    """A piece that shards its state (TP, pipeline stages): each rank saves and loads its own file."""
    path = Path(args.work) / f"checkpoint-rank{dist.get_rank()}.pt"
    torch.save(state, path)
    dist.barrier()
    return torch.load(path)


def whole(net, opt, sched) -> dict:
    return {"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}


def resume(saved: dict, net, opt, sched) -> None:
    """torch's docs' order: build, then load each state dict."""
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])


# --- the pieces ---------------------------------------------------------------------------------

def ddp(M, model, ref, args):
    DDP = importlib.import_module("data_parallel.ddp").DistributedDataParallel
    net = DDP(model, bucket_cap_mb=0.01)  # a few buckets
    opt, sched = adamw(net.parameters())
    norms = data_parallel_steps(net, opt, sched, ref, range(STEPS), lambda: None, no_sync=net.no_sync)
    saved = save_on_rank0(args, lambda: whole(net, opt, sched))  # keys "module.…", as torch's
    net = DDP(fresh(M, model), bucket_cap_mb=0.01)
    opt, sched = adamw(net.parameters())
    resume(saved, net, opt, sched)
    norms += data_parallel_steps(net, opt, sched, ref, [STEPS], lambda: None, no_sync=net.no_sync)
    return norms, params_diff(net.module.named_parameters(), ref)


def ring(M, model, ref, args):
    ring_all_reduce = importlib.import_module("ring_allreduce.ring").ring_all_reduce

    def reduce() -> None:  # the user's own DP: one flat all-reduce of every gradient, then ÷ n
        grads = [p.grad for p in net.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        ring_all_reduce(flat)  # SUM, synchronous (dist.all_reduce's call shape)
        flat /= dist.get_world_size()
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    net = model
    opt, sched = adamw(net.parameters())
    norms = data_parallel_steps(net, opt, sched, ref, range(STEPS), reduce)
    saved = save_on_rank0(args, lambda: whole(net, opt, sched))
    net = fresh(M, model)
    opt, sched = adamw(net.parameters())
    resume(saved, net, opt, sched)
    norms += data_parallel_steps(net, opt, sched, ref, [STEPS], reduce)
    return norms, params_diff(net.named_parameters(), ref)


def zero(M, model, ref, args):
    """ZeroOptimizer at stages 0 and 2."""
    runs = [zero_stage(M, model, args, stage) for stage in (0, 2)]
    return [n for norms, _ in runs for n in norms], max(diff for _, diff in runs)


def zero_stage(M, model, args, stage: int):
    """Its own clip (torch's at stage 0, where p.grad is the reduced gradient), 2 backward passes
    per step, the first under no_sync; the state consolidated on rank 0 (torch's
    ZeroRedundancyOptimizer pair) and saved there alone."""
    ZeroOptimizer = importlib.import_module("zero.optimizer").ZeroOptimizer
    net, reference = copy.deepcopy(model), Reference(model, M)

    def train(steps):
        clip = None if stage == 0 else (lambda: opt.clip_grad_norm_(CLIP))
        return data_parallel_steps(net, opt, sched, reference, steps, lambda: None, clip, opt.no_sync)

    opt, sched = adamw(net.parameters(), ZeroOptimizer, stage=stage)
    norms = train(range(STEPS))
    opt.consolidate_state_dict(to=0)  # a collective: every rank
    saved = save_on_rank0(args, lambda: whole(net, opt, sched))
    net = fresh(M, model)
    opt, sched = adamw(net.parameters(), ZeroOptimizer, stage=stage)
    resume(saved, net, opt, sched)
    norms += train([STEPS])
    return norms, params_diff(net.named_parameters(), reference)


def fsdp(M, model, ref, args):
    FSDP = importlib.import_module("fsdp.fully_sharded").FullyShardedDataParallel
    ModuleWrapPolicy = importlib.import_module("fsdp.wrap").ModuleWrapPolicy

    def wrap(net):
        return FSDP(net, auto_wrap_policy=ModuleWrapPolicy({M.TransformerBlock}))

    def train(steps):
        return data_parallel_steps(net, opt, sched, ref, steps, lambda: None,
                                   lambda: net.clip_grad_norm_(CLIP), net.no_sync)

    net = wrap(model)
    opt, sched = adamw(net.parameters())  # the flat shards
    norms = train(range(STEPS))
    state, optim_state = net.state_dict(), FSDP.optim_state_dict(net, opt)  # collectives: every rank
    saved = save_on_rank0(args, lambda: {"model": state, "optimizer": optim_state,
                                         "scheduler": sched.state_dict()})
    net = wrap(fresh(M, model))
    opt, sched = adamw(net.parameters())
    net.load_state_dict(saved["model"])
    opt.load_state_dict(FSDP.optim_state_dict_to_load(net, opt, saved["optimizer"]))
    sched.load_state_dict(saved["scheduler"])
    norms += train([STEPS])
    return norms, params_diff(net.state_dict().items(), ref)


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


def sharded_pieces() -> dict:
    """The pieces that shard the model (TP, ring attention, pipeline, parallelize_3d), in
    tests/copy_loops_sharded.py, which takes this script's helpers from `copy_loops`."""
    sys.modules["copy_loops"] = sys.modules[__name__]
    spec = importlib.util.spec_from_file_location("copy_loops_sharded", Path(__file__).with_name(
        "copy_loops_sharded.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PIECES


PIECES = {"DDP": ddp, "ring all-reduce": ring, "ZeroOptimizer": zero, "FSDP": fsdp,
          "checkpoint save/load": checkpoint}


def main() -> None:
    import argparse

    p = argparse.ArgumentParser()
    pieces = {**PIECES, **sharded_pieces()}
    p.add_argument("piece", choices=pieces)
    p.add_argument("copy")
    p.add_argument("work")
    args = p.parse_args()
    isolate(args.copy)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        has_kernel_model = (Path(args.copy) / "common/kernel/model.py").exists()
        M = importlib.import_module("common.kernel.model" if has_kernel_model
                                    else "user_model")
        model = M.build_model(M.get_config("tiny", n_layers=2), seed=0, dtype=torch.float64)
        norms, params = pieces[args.piece](M, model, Reference(model, M), args)
        worst = torch.tensor([max(norms), params], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            print("COPY-RESULT " + json.dumps({"norms": worst[0].item(), "params": worst[1].item(),
                                               "steps": len(norms), "files": project_files()}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
