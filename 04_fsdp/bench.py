"""Chapter 04 benchmark: our FSDP vs torch's FSDP2 (`fully_shard`) with the same units, and
chapter 01's DDP as the baseline: step time and per-rank memory, side by side.

    torchrun --standalone --nproc-per-node 4 04_fsdp/bench.py        (or `make bench-4`)

One process group, three copies of the same model (same seed), the same global batch per step.
Units: every TransformerBlock, then the root (torch: `fully_shard(block)` for each block, then
`fully_shard(model)`). The strategies are interleaved, one step of each per round in an order
rotated by one per round, so all three see the same background drift on a shared machine; the
first `--warmup` rounds are not timed. A step is timed from a barrier to the end of the optimizer
step and counts as the slowest rank's time; the table shows the median over the timed rounds.
Memory is what each rank holds after the step: parameters + gradients + optimizer state, counted
from the live (local) tensors, each storage once.

Prints a table, then one JSON line: {"chapter": 4, "bench": "fsdp", ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from common.cli import DTYPES
from common.data import SyntheticTokens, local_micro_batches, split_inputs_targets
from common.dist import LaunchError, env_world_size, init_distributed, print0, shutdown, synchronize
from common.memory import storage_bytes
from common.model import CONFIGS, TransformerBlock, build_model, count_parameters, get_config, loss_fn
from common.reference import make_optimizer
from data_parallel import DistributedDataParallel
from fsdp import FullyShardedDataParallel, ShardingStrategy, transformer_auto_wrap_policy

TARGET = 1.2  # the goal: ours/torch FSDP2 step time ≤ 1.2 (aim ≤ 1.0)
STRATEGIES = ("ours", "torch_fsdp2", "ddp")
NAMES = {"ours": "ours (FSDP)", "torch_fsdp2": "torch FSDP2", "ddp": "ch01 DDP"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=CONFIGS, default="small")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--sharding-strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy],
                   help="ours; torch FSDP2 gets reshard_after_forward = (FULL_SHARD)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step (all ranks)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    p.add_argument("--steps", type=int, default=10, help="timed rounds (one step of each strategy)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag in ("global_batch", "seq_len", "steps"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must be >= 0")
    return args


def torch_fsdp2(model: torch.nn.Module, device: torch.device, reshard: bool) -> torch.nn.Module:
    """torch's FSDP2 with our units: each block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)  # the root stays gathered, as ours
    return model


def wrap(strategy: str, model: torch.nn.Module, args: argparse.Namespace,
         device: torch.device) -> torch.nn.Module:
    if strategy == "ours":
        return FullyShardedDataParallel(
            model, auto_wrap_policy=partial(transformer_auto_wrap_policy,
                                            transformer_layer_cls={TransformerBlock}),
            sharding_strategy=ShardingStrategy[args.sharding_strategy])
    if strategy == "torch_fsdp2":
        return torch_fsdp2(model, device, args.sharding_strategy == "FULL_SHARD")
    return DistributedDataParallel(model)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a DTensor (torch FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: str) -> dict[str, int]:
    params = [local(p) for p in model.parameters()]
    grads = ([b.buffer for b in model.buckets] if strategy == "ddp"
             else [local(p.grad) for p in model.parameters() if p.grad is not None])
    states = [local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": storage_bytes(params), "grads": storage_bytes(grads),
            "optimizer": storage_bytes(states)}


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               rank: int, world: int) -> None:
    (micro,) = local_micro_batches(tokens, rank, world, tokens.shape[0] // world)
    inputs, targets = split_inputs_targets(micro)
    loss_fn(model(inputs), targets).backward()
    if hasattr(model, "finish"):
        model.finish()  # ch01 DDP: harmless, it already ran at the end of backward
    optimizer.step()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        world = env_world_size()
    except LaunchError as error:
        raise SystemExit(f"error: {error}") from None
    if args.global_batch % world:
        raise SystemExit(f"error: --global-batch {args.global_batch} is not divisible by {world} "
                         f"ranks: use a multiple of {world}")
    ctx = init_distributed()
    cfg, dtype = get_config(args.model), DTYPES[args.dtype]
    data = SyntheticTokens(cfg.vocab_size, args.seq_len, args.seed)
    n_params = count_parameters(build_model(cfg, args.seed, dtype, "meta"))

    runs = {}
    for strategy in STRATEGIES:
        model = wrap(strategy, build_model(cfg, args.seed, dtype, ctx.device), args, ctx.device)
        runs[strategy] = (model, make_optimizer(model.parameters(), "adamw", 1e-3))

    times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    memory: dict[str, dict[str, int]] = {}
    for r in range(args.warmup + args.steps):
        tokens = data.global_batch(r, args.global_batch).to(ctx.device)
        for k in range(len(STRATEGIES)):
            strategy = STRATEGIES[(r + k) % len(STRATEGIES)]
            model, optimizer = runs[strategy]
            synchronize(ctx.device)
            dist.barrier()
            start = time.perf_counter()
            train_step(model, optimizer, tokens, ctx.rank, world)
            synchronize(ctx.device)
            if r >= args.warmup:
                times[strategy].append(time.perf_counter() - start)
            memory[strategy] = state_bytes(model, optimizer, strategy)
            if strategy == "ddp":
                model.zero_grad()
            else:
                optimizer.zero_grad(set_to_none=True)

    slowest = torch.tensor([times[s] for s in STRATEGIES], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    del runs, model, optimizer  # free FSDP2's modules and hooks while the group lives
    median = {s: statistics.median(slowest[i].tolist()) for i, s in enumerate(STRATEGIES)}
    total = {s: sum(memory[s].values()) for s in STRATEGIES}
    tokens_per_step = args.global_batch * args.seq_len
    print0(f"chapter 4 bench · {args.model} ({n_params:,} params, {args.dtype}) · dp={world} · "
           f"{ctx.backend} on {ctx.device} · batch {args.global_batch}×{args.seq_len} · "
           f"{args.sharding_strategy} · median of {args.steps} steps (+{args.warmup} warm-up)")
    print0(f"{'strategy':<16}{'step ms':>10}{'tokens/s':>10}{'/ FSDP2':>9}{'state MiB':>11}"
           f"{'/ FSDP2':>9}{'/ DDP':>8}")
    for s in STRATEGIES:
        print0(f"{NAMES[s]:<16}{1e3 * median[s]:>10.1f}{tokens_per_step / median[s]:>10.0f}"
               f"{median[s] / median['torch_fsdp2']:>9.3f}{total[s] / 2**20:>11.2f}"
               f"{total[s] / total['torch_fsdp2']:>9.3f}{total[s] / total['ddp']:>8.3f}")
    time_ratio = median["ours"] / median["torch_fsdp2"]
    print0(f"ours/torch FSDP2 step time {time_ratio:.3f} (target ≤ {TARGET}: "
           f"{'met' if time_ratio <= TARGET else 'MISSED'}) · ours/DDP memory "
           f"{total['ours'] / total['ddp']:.3f} (1/N = {1 / world:.3f})")
    print0(json.dumps({
        "chapter": 4, "bench": "fsdp", "model": args.model, "params": n_params, "dtype": args.dtype,
        "sharding_strategy": args.sharding_strategy, "world_size": world, "backend": ctx.backend,
        "device": str(ctx.device), "global_batch": args.global_batch, "seq_len": args.seq_len,
        "warmup": args.warmup, "steps": args.steps, "step_s_median": median,
        "tokens_per_s": {s: tokens_per_step / median[s] for s in median}, "state_bytes": memory,
        "ratios": {"time_ours_over_fsdp2": time_ratio,
                   "time_ddp_over_fsdp2": median["ddp"] / median["torch_fsdp2"],
                   "memory_ours_over_fsdp2": total["ours"] / total["torch_fsdp2"],
                   "memory_ours_over_ddp": total["ours"] / total["ddp"]},
        "target": TARGET, "target_met": time_ratio <= TARGET,
    }))
    shutdown()


if __name__ == "__main__":
    main()
