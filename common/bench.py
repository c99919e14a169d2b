"""The benches' harness: launch, interleaved timing, the slowest rank's median, report, teardown.

Timing method. Every round runs one step of each contender, in an order rotated by one per round
(round r starts with contender r mod k): the background load of a shared machine drifts during a
run, and interleaving exposes every contender to the same drift, where running them one after the
other would compare an early window with a late one. A step is timed on each rank from a barrier to
its end, with the device synchronized before both clock reads (CUDA runs asynchronously). A step
takes as long as its slowest rank, and the first `warmup` rounds (allocator, buffers, torch DDP's
bucket rebuild) are not timed:

    t(contender) = median over the timed rounds r of  max over ranks (end_r - start_r)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.data import SyntheticTokens, local_micro_batches, split_inputs_targets
from common.dist import (
    DistContext,
    LaunchError,
    env_world_size,
    init_distributed,
    print0,
    shutdown,
    synchronize,
)
from common.kernel.model import CONFIGS, loss_fn


def bench_parser(doc: str, *, warmup: int, steps: int) -> argparse.ArgumentParser:
    """The flags the training benches share: --model, --seq-len, --warmup, --steps, --seed."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=CONFIGS, default="small")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=warmup, help="untimed rounds")
    p.add_argument("--steps", type=int, default=steps, help="timed rounds (one step of each contender)")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_checked(p: argparse.ArgumentParser, argv: list[str] | None,
                  positive: Sequence[str] = ()) -> argparse.Namespace:
    """Parse; --seq-len, --steps and each of `positive` must be > 0, --warmup >= 0."""
    args = p.parse_args(argv)
    for flag in ("seq_len", "steps", *positive):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must be >= 0")
    return args


def launch(global_batch: int | None = None,
           check: Callable[[int], str | None] = lambda world: None) -> DistContext:
    """Join torchrun's job. Read before the process group exists, so that every rank exits before
    any collective: a bad launch, a global batch the ranks do not divide, or the bench's own
    `check(world_size)` (an error message, or None)."""
    try:
        world = env_world_size()
    except LaunchError as error:
        raise SystemExit(f"error: {error}") from None
    if global_batch is not None and global_batch % world:
        raise SystemExit(f"error: --global-batch {global_batch} is not divisible by {world} ranks: "
                         f"use a multiple of {world}")
    if (problem := check(world)) is not None:
        raise SystemExit(f"error: {problem}")
    return init_distributed()


def synthetic_batches(vocab_size: int, seq_len: int, seed: int, global_batch: int,
                      device: torch.device) -> Callable[[int], torch.Tensor]:
    """Round r's global batch of synthetic tokens on the rank's device (the same on every rank)."""
    data = SyntheticTokens(vocab_size, seq_len, seed)
    return lambda r: data.global_batch(r, global_batch).to(device)


def data_parallel_step(model: Callable[[torch.Tensor], torch.Tensor], step: Callable[[], object],
                       tokens: torch.Tensor) -> None:
    """One training step on this rank's share of the global batch `tokens`: forward, loss,
    backward, the wrapper's `finish()` where it has one (chapter 01's DDP), then `step()`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    (micro,) = local_micro_batches(tokens, rank, world, tokens.shape[0] // world)
    inputs, targets = split_inputs_targets(micro)
    loss_fn(model(inputs), targets).backward()
    if hasattr(model, "finish"):
        model.finish()
    step()


@dataclass
class Timings:
    rounds: dict[str, list[float]]  # per timed round, the slowest rank's seconds

    @property
    def median(self) -> dict[str, float]:
        return {name: statistics.median(seconds) for name, seconds in self.rounds.items()}


def interleaved(steps: dict[str, Callable[[Any], object]], rounds: int, warmup: int,
                device: torch.device, round_input: Callable[[int], Any] = lambda r: r,
                after: Callable[[str, int], None] | None = None, group=None) -> Timings:
    """Time `warmup + rounds` rounds of one `steps[name](round_input(r))` each, in rotated order
    (the module's method). `after(name, r)` runs after each clock stops (memory, zero_grad); every
    rank of `group` must call this, with the same steps."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        batch = round_input(r)
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            synchronize(device)
            dist.barrier(group=group)
            start = time.perf_counter()
            steps[name](batch)
            synchronize(device)
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
            if after is not None:
                after(name, r)
    slowest = torch.tensor([times[name] for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return Timings(dict(zip(names, slowest.tolist(), strict=True)))


def seconds_per_call(calls: dict[str, Callable[[], object]], iters: int, rounds: int,
                     device: torch.device, group=None) -> dict[str, float]:
    """Each call once untimed (warm-up), then `rounds` interleaved rounds of `iters` back-to-back
    calls each: the slowest rank's median round over `iters`."""
    for call in calls.values():
        call()
    steps = {name: (lambda _, call=call: [call() for _ in range(iters)]) for name, call in calls.items()}
    return {name: t / iters for name, t in interleaved(steps, rounds, 0, device, group=group).median.items()}


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def finish(result: dict | list, *holders: dict) -> None:
    """Print `result` as JSON, the last stdout line (rank 0), and destroy the process group. The
    dicts in `holders` are emptied first: a torch DDP, FSDP2 module, ZeroRedundancyOptimizer or
    pipelining stage still alive at the destroy hangs the exit (CONTRIBUTING.md, rules of the NCCL path);
    the caller keeps no other reference to them."""
    for held in holders:
        held.clear()
    print0(json.dumps(result))
    shutdown()
