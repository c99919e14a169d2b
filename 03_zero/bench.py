"""Chapter 03 benchmark: step time and memory per rank of ZeRO stages 0-3, and torch's
ZeroRedundancyOptimizer over torch DDP (the stage-1 yardstick), side by side in one run.

    torchrun --standalone --nproc-per-node 4 03_zero/bench.py      (or `make bench-3`)

Five copies of the same model (same seed) in one process group, the same global batch each round.
Every round runs one step of each strategy, in an order rotated by one per round (a loaded machine
drifts; interleaving exposes all five to the same drift), after `--warmup` untimed rounds. A step
is timed from a barrier to the end of the optimizer step and counts as its slowest rank's time;
the table shows medians. Memory is the per-rank params + grads + optimizer state after a step,
counted from live tensors. Prints a table, one JSON line, and writes bench.png beside this file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from common.cli import DTYPES
from common.data import SyntheticTokens, local_micro_batches, split_inputs_targets
from common.dist import LaunchError, env_world_size, init_distributed, print0, shutdown, synchronize
from common.memory import model_state_bytes, storage_bytes
from common.model import CONFIGS, build_model, count_parameters, get_config, loss_fn
from common.reference import make_optimizer
from zero import ZeroConfig, ZeroEngine

TARGET = 1.2  # the goal: stage 1 within 1.2× of ZeroRedundancyOptimizer (aim for ≤ 1.0)
STRATEGIES = ("zero-0", "zero-1", "zero-2", "zero-3", "torch-zero-1")
PNG = Path(__file__).with_name("bench.png")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=CONFIGS, default="small")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (all ranks)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--reduce-bucket-size", type=float, default=5e8, help="elements (DeepSpeed's default)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    p.add_argument("--steps", type=int, default=8, help="timed rounds (one step of each strategy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default=str(PNG), help="where to write the chart ('' to skip)")
    args = p.parse_args(argv)
    for flag in ("global_batch", "seq_len", "steps", "reduce_bucket_size"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must be >= 0")
    return args


class TorchZero1:
    """torch's stage 1: DDP all-reduces the gradients, ZeroRedundancyOptimizer steps this rank's
    partition and broadcasts it."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        ids = [device.index] if device.type == "cuda" else None
        self.model, self.ddp = model, torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                                 lr=1e-3, weight_decay=0.1, foreach=False)

    def __call__(self, inputs):
        return self.ddp(inputs)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def memory(self) -> dict[str, int]:
        return model_state_bytes(self.model.parameters(), self.optimizer.optim)


class Ours:
    def __init__(self, model: torch.nn.Module, stage: int, bucket: int):
        config = ZeroConfig(stage=stage, reduce_bucket_size=bucket, param_persistence_threshold=0)
        self.engine = ZeroEngine(model, lambda ps: make_optimizer(ps, "adamw", 1e-3), config)

    def __call__(self, inputs):
        return self.engine(inputs)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def memory(self) -> dict[str, int]:
        return {k: storage_bytes(v) for k, v in self.engine.state_tensors().items()}


def plot(median: dict[str, float], memory: dict[str, dict[str, int]], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(median)
    colors = ["#888888", "#4c72b0", "#55a868", "#c44e52", "#8172b2"]
    left.bar(names, [1e3 * median[s] for s in names], color=colors)
    left.set_ylabel("median step time (ms, slowest rank)")
    left.set_title("step time")
    bottom = [0.0] * len(names)
    for kind, color in (("params", "#4c72b0"), ("grads", "#55a868"), ("optimizer", "#c44e52")):
        values = [memory[s][kind] / 2**20 for s in names]
        right.bar(names, values, bottom=bottom, label=kind, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_ylabel("MiB per rank")
    right.set_title("params + grads + optimizer state per rank")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    runs = {}
    for s in STRATEGIES:
        model = build_model(cfg, args.seed, dtype, ctx.device)
        runs[s] = (TorchZero1(model, ctx.device) if s == "torch-zero-1"
                   else Ours(model, int(s[-1]), int(args.reduce_bucket_size)))
    n_params = count_parameters(build_model(cfg, args.seed, dtype, "meta"))

    times, memory = {s: [] for s in STRATEGIES}, {}
    for r in range(args.warmup + args.steps):
        (micro,) = local_micro_batches(data.global_batch(r, args.global_batch).to(ctx.device), ctx.rank,
                                       world, args.global_batch // world)
        inputs, targets = split_inputs_targets(micro)
        for k in range(len(STRATEGIES)):
            s = STRATEGIES[(r + k) % len(STRATEGIES)]
            run = runs[s]
            synchronize(ctx.device)
            dist.barrier()
            start = time.perf_counter()
            loss_fn(run(inputs), targets).backward()
            run.step()
            synchronize(ctx.device)
            elapsed = time.perf_counter() - start
            memory[s] = run.memory()
            run.zero_grad()
            if r >= args.warmup:
                times[s].append(elapsed)

    slowest = torch.tensor([times[s] for s in STRATEGIES], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    del runs, run, model  # free torch DDP and ZeroRedundancyOptimizer while the group lives
    median = {s: statistics.median(slowest[i].tolist()) for i, s in enumerate(STRATEGIES)}
    stage1 = median["zero-1"] / median["torch-zero-1"]
    stage3 = median["zero-3"] / median["zero-0"]
    title = (f"chapter 3 bench · {args.model} ({n_params:,} params, {args.dtype}) · dp={world} · "
             f"{ctx.backend} on {ctx.device} · batch {args.global_batch}×{args.seq_len}")
    print0(title + f" · median of {args.steps} steps (+{args.warmup} warm-up)")
    print0(f"{'strategy':<14}{'step ms':>9}{'/ zero-0':>10}{'params MiB':>12}{'grads MiB':>11}"
           f"{'optim MiB':>11}{'total MiB':>11}")
    for s in STRATEGIES:
        m = memory[s]
        print0(f"{s:<14}{1e3 * median[s]:>9.1f}{median[s] / median['zero-0']:>10.3f}"
               f"{m['params'] / 2**20:>12.2f}{m['grads'] / 2**20:>11.2f}{m['optimizer'] / 2**20:>11.2f}"
               f"{sum(m.values()) / 2**20:>11.2f}")
    met = stage1 <= TARGET
    print0(f"zero-1 / torch ZeroRedundancyOptimizer {stage1:.3f} (target ≤ {TARGET}: "
           f"{'met' if met else 'MISSED'}) · zero-3 / zero-0 {stage3:.3f} (stage 3 all-gathers every "
           "unit, a block, twice per step, blocking before its compute unless the prefetch hides it)")
    if ctx.is_main and args.png:
        plot(median, memory, title, args.png)
    print0(json.dumps({
        "chapter": 3, "bench": "zero", "model": args.model, "params": n_params, "dtype": args.dtype,
        "world_size": world, "backend": ctx.backend, "device": str(ctx.device),
        "global_batch": args.global_batch, "seq_len": args.seq_len, "warmup": args.warmup,
        "steps": args.steps, "step_s_median": median, "memory_per_rank": memory,
        "ratios": {"zero1_over_torch_zero1": stage1, "zero3_over_zero0": stage3},
        "target": TARGET, "target_met": met,
    }))
    shutdown()


if __name__ == "__main__":
    main()
