"""Chapter 04 benchmark: our FSDP vs torch's FSDP2 (`fully_shard`) with the same units, and
chapter 01's DDP as the baseline: step time and per-rank memory, side by side.

    torchrun --standalone --nproc-per-node 4 04_fsdp/bench.py        (or `make bench-4`)

One process group, three copies of the same model (same seed), the same global batch per step.
Units: every TransformerBlock, then the root (torch: `fully_shard(block)` for each block, then
`fully_shard(model)`). The strategies are interleaved and timed by `common.bench`: one step of
each per round in an order rotated by one per round, after `--warmup` untimed rounds; a step, from
a barrier to the end of the optimizer step, counts as its slowest rank's time; the table shows the
median over the timed rounds.
Memory is what each rank holds after the step: parameters + gradients + optimizer state, counted
from the live (local) tensors, each storage once.

Prints a table, then one JSON line: {"chapter": 4, "bench": "fsdp", ...}. Where the installed
torch cannot run FSDP2 (torch < 2.7 on CPU) every rank exits 2 with the reason, before any collective.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch

from common import bench as harness
from common.cli import DTYPES, ConfigError, exit_on_config_error
from common.dist import print0
from common.kernel.model import TransformerBlock, build_model, count_parameters, get_config
from common.memory import storage_bytes
from common.reference import make_optimizer
from data_parallel import DistributedDataParallel
from fsdp import HYBRID_STRATEGIES, FullyShardedDataParallel, ShardingStrategy, transformer_auto_wrap_policy
from fsdp.torch_fsdp2 import fsdp2_unavailable, fully_shard_llama, local
from fsdp.train import device_type

TARGET = 1.2  # the goal: ours/torch FSDP2 step time ≤ 1.2 (aim ≤ 1.0)
STRATEGIES = ("ours", "torch_fsdp2", "ddp")
NAMES = {"ours": "ours (FSDP)", "torch_fsdp2": "torch FSDP2", "ddp": "ch01 DDP"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.bench_parser(__doc__, warmup=2, steps=10)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--sharding-strategy", default="FULL_SHARD",
                   choices=[s.name for s in ShardingStrategy if s not in HYBRID_STRATEGIES],
                   help="ours; torch FSDP2 gets reshard_after_forward = (FULL_SHARD); HSDP: train.py")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step (all ranks)")
    return harness.parse_checked(p, argv, positive=("global_batch",))


def wrap(strategy: str, model: torch.nn.Module, args: argparse.Namespace,
         device: torch.device) -> torch.nn.Module:
    if strategy == "ours":
        return FullyShardedDataParallel(
            model, auto_wrap_policy=partial(transformer_auto_wrap_policy,
                                            transformer_layer_cls={TransformerBlock}),
            sharding_strategy=ShardingStrategy[args.sharding_strategy], forward_prefetch=True)
    if strategy == "torch_fsdp2":
        return fully_shard_llama(model, device, args.sharding_strategy == "FULL_SHARD")
    return DistributedDataParallel(model)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: str) -> dict[str, int]:
    params = [local(p) for p in model.parameters()]
    grads = ([b.buffer for b in model.buckets] if strategy == "ddp"
             else [local(p.grad) for p in model.parameters() if p.grad is not None])
    states = [local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": storage_bytes(params), "grads": storage_bytes(grads),
            "optimizer": storage_bytes(states)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    missing = fsdp2_unavailable(device_type())
    if missing is not None:  # before any process group: every rank exits 2 with the reason
        exit_on_config_error(os.environ.get("RANK", "?"), ConfigError(f"torch FSDP2 yardstick: {missing}"))
    ctx = harness.launch(args.global_batch)
    cfg, dtype = get_config(args.model), DTYPES[args.dtype]
    n_params = count_parameters(build_model(cfg, args.seed, dtype, "meta"))
    runs = {}
    for s in STRATEGIES:
        model = wrap(s, build_model(cfg, args.seed, dtype, ctx.device), args, ctx.device)
        runs[s] = (model, make_optimizer(model.parameters(), "adamw", 1e-3))
    del model
    memory: dict[str, dict[str, int]] = {}

    def measure_and_zero(s: str, r: int) -> None:
        model, optimizer = runs[s]
        memory[s] = state_bytes(model, optimizer, s)
        if s == "ddp":
            model.zero_grad()
        else:
            optimizer.zero_grad(set_to_none=True)

    steps = {s: partial(harness.data_parallel_step, model, opt.step) for s, (model, opt) in runs.items()}
    batches = harness.synthetic_batches(cfg.vocab_size, args.seq_len, args.seed, args.global_batch,
                                        ctx.device)
    median = harness.interleaved(steps, args.steps, args.warmup, ctx.device, batches, measure_and_zero).median
    total = {s: sum(memory[s].values()) for s in STRATEGIES}
    tokens_per_step = args.global_batch * args.seq_len
    print0(f"chapter 4 bench · {args.model} ({n_params:,} params, {args.dtype}) · dp={ctx.world_size} · "
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
           f"{harness.verdict(time_ratio <= TARGET)}) · ours/DDP memory "
           f"{total['ours'] / total['ddp']:.3f} (1/N = {1 / ctx.world_size:.3f})")
    harness.finish({
        "chapter": 4, "bench": "fsdp", "model": args.model, "params": n_params, "dtype": args.dtype,
        "sharding_strategy": args.sharding_strategy, "world_size": ctx.world_size, "backend": ctx.backend,
        "device": str(ctx.device), "global_batch": args.global_batch, "seq_len": args.seq_len,
        "warmup": args.warmup, "steps": args.steps, "step_s_median": median,
        "tokens_per_s": {s: tokens_per_step / median[s] for s in median}, "state_bytes": memory,
        "ratios": {"time_ours_over_fsdp2": time_ratio,
                   "time_ddp_over_fsdp2": median["ddp"] / median["torch_fsdp2"],
                   "memory_ours_over_fsdp2": total["ours"] / total["torch_fsdp2"],
                   "memory_ours_over_ddp": total["ours"] / total["ddp"]},
        "target": TARGET, "target_met": time_ratio <= TARGET,
    }, runs, steps)  # frees FSDP2's modules and hooks while the group lives


if __name__ == "__main__":
    main()
