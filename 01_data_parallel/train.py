"""Chapter 01 demo: train LLaMA with data parallelism on every rank torchrun started.

    torchrun --standalone --nproc-per-node 4 01_data_parallel/train.py --strategy ddp --check

Each rank holds the whole model and takes global_batch / n sequences of every step; gradients are
averaged by the chosen strategy. `--check` trains the single-device reference alongside (rank 0)
and exits 1 when the two differ beyond the tolerance of the README's table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from common.cli import base_parser, batch_layout, require, validate_common
from common.dist import DistContext
from common.kernel.mesh import mesh_shape
from common.kernel.model import build_model
from common.kernel.optimizer_bytes import optimizer_state_bytes
from common.loss_scaler import agreement_bytes, make_scaler
from common.memory import optimizer_state_tensors, storage_bytes
from common.mixed_precision import MasterWeights
from common.reference import make_optimizer
from common.run import Run, resolve_run
from common.training import Strategy, run_main
from data_parallel import DistributedDataParallel, NaiveDataParallel

Wrap = Callable[[nn.Module, Run], nn.Module]
STRATEGIES: dict[str, Wrap] = {
    "naive": lambda model, run: NaiveDataParallel(model),
    "ddp": lambda model, run: DistributedDataParallel(
        model, bucket_cap_mb=run.options.bucket_mb, reduce_dtype=torch.float32 if run.mixed else None),
}


@dataclass(frozen=True)
class DataParallelOptions:
    """The chapter's resolved flags (the run's `options`)."""

    strategy: str = "ddp"  # naive | ddp
    bucket_mb: float = 25.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--strategy", default="ddp", help="naive | ddp")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap in MiB")
    return p.parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> Run:
    """Everything that can be wrong with the input, checked before any collective; the run."""
    validate_common(args, loss_scaling=True)
    require(args.strategy in STRATEGIES,
            f"--strategy {args.strategy!r} is unknown: use one of {', '.join(STRATEGIES)}")
    require(args.bucket_mb > 0, f"--bucket-mb {args.bucket_mb}: must be > 0 (torch's default is 25)")
    require(args.mixed_precision == "none" or args.strategy != "naive",
            f"--mixed-precision {args.mixed_precision} with --strategy naive: the naive version reduces "
            "in the parameter dtype; use --strategy ddp (fp32 gradient buckets)")
    return resolve_run(args, mesh_shape(world_size), batch_layout(args.global_batch, world_size,
                       args.micro_batch, args.grad_accum), DataParallelOptions(args.strategy, args.bucket_mb))


class DataParallelStrategy(Strategy):
    """Whole model on every rank, `wrap`ped so that its backward averages the gradients; the
    shared loop's step does the rest (the local norm is the global one: every rank holds the whole
    averaged gradient). In mixed precision the model computes in bf16 (or fp16), DDP reduces fp32
    `main_grad`s, and AdamW updates an fp32 master copy; fp16 scales the loss, and the ranks agree
    its overflow flag over the DDP group (the all-reduce of the gradients carries an inf already:
    the flag's costs 4 bytes and holds for anything rank-local after it)."""

    def __init__(self, run: Run, ctx: DistContext, wrap: Wrap):
        self.mixed = run.mixed
        module = build_model(run.model, run.seed, run.compute_dtype, ctx.device)
        self.model = wrap(module, run)
        self.names = [n for n, _ in module.named_parameters()]
        self.weights = MasterWeights(module.parameters(), enabled=self.mixed)
        self.optimizer = make_optimizer(self.weights.master, run.optimizer, run.lr)
        self.name, self.clip_grad = run.options.strategy, run.clip_grad
        self.dp_rank, self.dp_size = ctx.rank, ctx.world_size
        self.optimizer_name, self.param_itemsize = run.optimizer, module.output.weight.itemsize
        self.reduce_itemsize = 4 if self.mixed else self.param_itemsize
        self.scaler = make_scaler(run.mixed_precision, run.loss_scaling, ctx.device)

    def after_backward(self) -> None:
        if isinstance(self.model, NaiveDataParallel):
            self.model.finish()  # the naive version reduces after backward, by hand
        if self.mixed:  # the fp32 main_grad buckets become the masters' grads, no copy
            self.weights.grads_to_master([p.main_grad for p in self.weights.params])

    def zero_grad(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model.zero_grad(set_to_none=False)  # in place: the gradients stay bucket views
            self.weights.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _named(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: t.detach() for n, t in zip(self.names, tensors, strict=True)}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self._named([m.grad for m in self.weights.master])

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self._named(self.weights.master)

    def memory(self) -> dict[str, int]:
        grads = ([b.buffer for b in self.model.buckets] if isinstance(self.model, DistributedDataParallel)
                 else [p.grad for p in self.model.parameters()])
        extra = self.weights.master if self.mixed else []
        return {"params": storage_bytes(self.model.parameters()), "grads": storage_bytes(grads),
                "optimizer": storage_bytes([*optimizer_state_tensors(self.optimizer), *extra])}

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        """Per rank: 2(n-1)/n·P·b_reduce wire bytes per step. Nothing is sharded: P·b params,
        P·b_reduce grads, AdamW's m and v (2·P·b_master) and a step counter per tensor, plus the
        fp32 master copy (4P) in mixed precision: (2 + 4 + 12)·P bytes."""
        P = sum(p.numel() for p in self.model.parameters())
        n_tensors, n = len(self.weights.master), self.dp_size
        master_bytes = self.weights.master[0].itemsize
        opt = optimizer_state_bytes(self.optimizer_name, P, master_bytes, n_tensors)
        opt += P * master_bytes if self.mixed else 0
        flag = agreement_bytes(n) if self.scaler else 0  # fp16: the overflow flag's all-reduce
        comm = steps * (2 * (n - 1) / n * P * self.reduce_itemsize + flag)
        return comm, {"params": P * self.param_itemsize, "grads": P * self.reduce_itemsize, "optimizer": opt}


def overlap_tokens(n: int, grad_bytes: int, flops: float, busbw: float) -> float:
    """Tokens per rank above which the gradient all-reduce fits under backward (the Ultra-Scale
    Playbook's overlap condition). Backward costs ≈ 4·P·t FLOPs at `flops` FLOP/s; the all-reduce
    moves 2(n-1)/n·P·b bytes at `busbw` bytes/s; P cancels:

        2(n-1)/n · P·b / B  ≤  4·P·t / F      ⇔      t ≥ (n-1)/n · b·F / (2B)"""
    return (n - 1) / n * grad_bytes * flops / (2 * busbw)


def build(run: Run, ctx: DistContext) -> Strategy:
    return DataParallelStrategy(run, ctx, STRATEGIES[run.options.strategy])


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=1)
