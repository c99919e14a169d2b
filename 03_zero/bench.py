"""Chapter 03 benchmark: step time and memory per rank of ZeRO stages 0-3, and torch's
ZeroRedundancyOptimizer over torch DDP (the stage-1 yardstick), side by side in one run.

    torchrun --standalone --nproc-per-node 4 03_zero/bench.py      (or `make bench-3`)

Five copies of the same model (same seed) in one process group, the same global batch each round,
interleaved and timed by `common.bench` (one step of each per round in a rotated order, after
`--warmup` untimed rounds; a step, from a barrier to the end of the optimizer step, counts as its
slowest rank's time; the table shows medians). Memory is the per-rank params + grads + optimizer
state after a step, counted from live tensors. Prints a table, one JSON line, and writes bench.png
beside this file.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from common import bench as harness
from common.cli import DTYPES
from common.dist import print0
from common.kernel.model import build_model, count_parameters, get_config
from common.memory import model_state_bytes, storage_bytes
from common.reference import make_optimizer
from zero import ZeroConfig, ZeroEngine

TARGET = 1.2  # the goal: stage 1 within 1.2× of ZeroRedundancyOptimizer (aim for ≤ 1.0)
STRATEGIES = ("zero-0", "zero-1", "zero-2", "zero-3", "torch-zero-1")
PNG = Path(__file__).with_name("bench.png")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.bench_parser(__doc__, warmup=2, steps=8)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (all ranks)")
    p.add_argument("--reduce-bucket-size", type=float, default=5e8, help="elements (DeepSpeed's default)")
    p.add_argument("--png", default=str(PNG), help="where to write the chart ('' to skip)")
    return harness.parse_checked(p, argv, positive=("global_batch", "reduce_bucket_size"))


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
    ctx = harness.launch(args.global_batch)
    cfg, dtype = get_config(args.model), DTYPES[args.dtype]
    fresh = lambda: build_model(cfg, args.seed, dtype, ctx.device)  # noqa: E731
    runs = {s: TorchZero1(fresh(), ctx.device) if s == "torch-zero-1"
            else Ours(fresh(), int(s[-1]), int(args.reduce_bucket_size)) for s in STRATEGIES}
    n_params = count_parameters(build_model(cfg, args.seed, dtype, "meta"))
    memory = {}

    def measure_and_zero(s: str, r: int) -> None:
        memory[s] = runs[s].memory()
        runs[s].zero_grad()

    # an engine is both the model and its optimizer: run(inputs), run.step()
    steps = {s: partial(harness.data_parallel_step, run, run.step) for s, run in runs.items()}
    batches = harness.synthetic_batches(cfg.vocab_size, args.seq_len, args.seed, args.global_batch,
                                        ctx.device)
    median = harness.interleaved(steps, args.steps, args.warmup, ctx.device, batches, measure_and_zero).median
    stage1 = median["zero-1"] / median["torch-zero-1"]
    stage3 = median["zero-3"] / median["zero-0"]
    title = (f"chapter 3 bench · {args.model} ({n_params:,} params, {args.dtype}) · dp={ctx.world_size} · "
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
           f"{harness.verdict(met)}) · zero-3 / zero-0 {stage3:.3f} (stage 3 all-gathers every "
           "unit, a block, twice per step, blocking before its compute unless the prefetch hides it)")
    if ctx.is_main and args.png:
        plot(median, memory, title, args.png)
    harness.finish({
        "chapter": 3, "bench": "zero", "model": args.model, "params": n_params, "dtype": args.dtype,
        "world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
        "global_batch": args.global_batch, "seq_len": args.seq_len, "warmup": args.warmup,
        "steps": args.steps, "step_s_median": median, "memory_per_rank": memory,
        "ratios": {"zero1_over_torch_zero1": stage1, "zero3_over_zero0": stage3},
        "target": TARGET, "target_met": met,
    }, runs, steps)  # frees torch DDP and ZeroRedundancyOptimizer while the group lives


if __name__ == "__main__":
    main()
