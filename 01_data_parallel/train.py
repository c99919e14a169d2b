"""Chapter 01 demo: train LLaMA with data parallelism on every rank torchrun started.

    torchrun --standalone --nproc-per-node 4 01_data_parallel/train.py --strategy ddp --check

Each rank holds the whole model and takes global_batch / n sequences of every step; gradients are
averaged by the chosen strategy. `--check` trains the single-device reference alongside (rank 0)
and exits 1 when the two differ beyond the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from common.cli import (
    DTYPES,
    ConfigError,
    base_parser,
    batch_layout,
    exit_on_config_error,
    require,
    validate_common,
)
from common.comm import CommMeter
from common.data import ByteCorpus, SyntheticTokens, local_micro_batches, split_inputs_targets
from common.dist import (
    DistContext,
    LaunchError,
    env_world_size,
    init_distributed,
    seed_everything,
    shutdown,
)
from common.memory import ActivationMeter, cuda_peak_bytes, model_state_bytes
from common.model import build_model, count_parameters, get_config, loss_fn
from common.reference import LockstepReference, make_optimizer
from common.report import emit_report
from data_parallel import DistributedDataParallel, NaiveDataParallel

STRATEGIES = {
    "naive": lambda model, args: NaiveDataParallel(model),
    "ddp": lambda model, args: DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--strategy", default="ddp", help="naive | ddp")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap in MiB")
    return p.parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> tuple[int, int]:
    """Everything that can be wrong with the input, checked before any collective."""
    validate_common(args)
    require(args.strategy in STRATEGIES,
            f"--strategy {args.strategy!r} is unknown: use one of {', '.join(STRATEGIES)}")
    require(args.bucket_mb > 0, f"--bucket-mb {args.bucket_mb}: must be > 0 (torch's default is 25)")
    return batch_layout(args.global_batch, world_size, args.micro_batch, args.grad_accum)


def data_parallel_formulas(n_params: int, n_tensors: int, bytes_per: int, world: int, steps: int,
                           optimizer: str) -> tuple[float, dict[str, float]]:
    """Per rank: 2(n-1)/n·P·b wire bytes per step; P·b params, P·b grads, and AdamW's m and v
    (2·P·b) plus a 4-byte step counter per tensor: nothing is sharded."""
    comm = steps * 2 * (world - 1) / world * n_params * bytes_per
    opt = 2 * n_params * bytes_per + 4 * n_tensors if optimizer == "adamw" else 0
    return comm, {"params": n_params * bytes_per, "grads": n_params * bytes_per, "optimizer": opt}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        world_size = env_world_size()
        micro_batch, grad_accum = validate(args, world_size)
    except (ConfigError, LaunchError) as error:
        exit_on_config_error(os.environ.get("RANK", "?"), error)
    ctx = init_distributed()
    report = train(args, ctx, micro_batch, grad_accum)
    if ctx.is_main:
        emit_report(report, args.report)
    status = 0 if report.get("check_passed", True) else 1
    shutdown()
    return status


def train(args: argparse.Namespace, ctx: DistContext, micro_batch: int, grad_accum: int,
          wrap: Callable[[nn.Module, argparse.Namespace], nn.Module] | None = None) -> dict:
    """Train for args.steps steps; return the run report (with --check, the verdict too, the same
    on every rank). `wrap(model, args)` replaces STRATEGIES[args.strategy] (chapter 02 passes a
    DDP whose all-reduce is its ring)."""
    seed_everything(args.seed)
    dtype, cfg, world_size = DTYPES[args.dtype], get_config(args.model), ctx.world_size
    data = (SyntheticTokens(cfg.vocab_size, args.seq_len, args.seed) if args.data == "synthetic"
            else ByteCorpus(args.seq_len, args.seed, args.data))

    # Every rank builds the same model from the same seed; the wrapper broadcasts rank 0's anyway.
    model = build_model(cfg, args.seed, dtype, ctx.device)
    dp = (wrap or STRATEGIES[args.strategy])(model, args)
    optimizer = make_optimizer(model.parameters(), args.optimizer, args.lr)
    reference = (LockstepReference(cfg, args.seed, dtype, args.optimizer, args.lr, ctx.device)
                 if args.check and ctx.is_main else None)

    local_losses, train_time, memory = [], 0.0, {}
    meter, activations = CommMeter(), ActivationMeter(model.parameters())
    for step in range(args.steps):
        tokens = data.global_batch(step, args.global_batch)
        start = time.perf_counter()
        with meter:
            loss_sum = 0.0
            for i, micro in enumerate(local_micro_batches(tokens, ctx.rank, world_size, micro_batch)):
                inputs, targets = split_inputs_targets(micro.to(ctx.device))
                sync = i == grad_accum - 1  # communicate only on the last micro-batch
                with activations, (nullcontext() if sync else dp.no_sync()):
                    loss = loss_fn(dp(inputs), targets) / grad_accum
                    loss.backward()
                loss_sum += loss.item()
            dp.finish()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        train_time += time.perf_counter() - start
        local_losses.append(loss_sum)
        if reference is not None:
            reference.step(tokens, {n: p.grad for n, p in model.named_parameters()},
                           {n: p.detach() for n, p in model.named_parameters()})
        start = time.perf_counter()
        optimizer.step()
        if step == args.steps - 1:
            memory = model_state_bytes(model.parameters(), optimizer)
        optimizer.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - start

    # The mean of the ranks' mean losses is the global-batch loss (one all-reduce, outside the meter).
    losses_t = torch.tensor(local_losses, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(losses_t, op=dist.ReduceOp.SUM)
    losses = (losses_t / world_size).tolist()

    comm_formula, memory_formula = data_parallel_formulas(
        count_parameters(model), len(list(model.parameters())), dtype.itemsize, world_size,
        args.steps, args.optimizer)
    memory["activations_peak"] = activations.peak_bytes
    if (cuda_peak := cuda_peak_bytes(ctx.device)) is not None:
        memory["cuda_max_allocated"] = cuda_peak
    report = {
        "chapter": 1, "strategy": args.strategy, "world_size": world_size,
        "mesh": {"dp": world_size}, "backend": ctx.backend, "device": str(ctx.device),
        "dtype": args.dtype, "steps": args.steps, "losses": losses,
        "micro_batch": micro_batch, "grad_accum": grad_accum,
        "tokens_per_s": args.steps * args.global_batch * args.seq_len / train_time,
        "comm": meter.as_dict(), "comm_bytes_per_rank": meter.bytes_sent,
        "comm_bytes_formula": comm_formula, "memory": memory, "memory_formula": memory_formula,
    }
    passed = torch.tensor([1], device=ctx.device)
    if reference is not None:
        params = {n: p.detach() for n, p in model.named_parameters()}
        report.update(reference.finish(losses, params))
        passed.fill_(int(report["check_passed"]))
    if args.check:
        dist.broadcast(passed, src=0)  # every rank exits with rank 0's verdict
        report["check_passed"] = bool(passed.item())
    return report


if __name__ == "__main__":
    sys.exit(main())
