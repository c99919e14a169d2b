"""Chapter 02 demo: the ring all-reduce checked, timed, then used to train LLaMA with DDP.

    torchrun --standalone --nproc-per-node 4 02_ring_allreduce/train.py --check

1. correctness: `ring_all_reduce` against `dist.all_reduce` on random tensors of every supported
   dtype and op and of awkward lengths (1, n-1, uneven), on every rank;
2. speed: one --bench-mb float32 tensor all-reduced by the ring, the naive root and torch's own,
   side by side (bus bandwidth, nccl-tests' definition);
3. training: chapter 01's DistributedDataParallel with --algorithm's all-reduce as its all_reduce.
   `--check` trains the single-device reference alongside (rank 0) and exits 1 when the two differ
   beyond the dtype's tolerance, exactly as chapter 01 does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from common.bench import seconds_per_call
from common.cli import base_parser, batch_layout, require, validate_common
from common.dist import DistContext
from common.kernel.mesh import mesh_shape
from common.run import Run, resolve_run
from common.training import Strategy, run_main
from data_parallel import DistributedDataParallel
from data_parallel.train import DataParallelOptions, DataParallelStrategy
from ring_allreduce import TIMED_ALL_REDUCES as TIMED
from ring_allreduce.agreement import CHECK_BYTES  # the call check's message (check=True)
from ring_allreduce.cost_model import bus_bandwidth
from ring_allreduce.naive import naive_all_reduce
from ring_allreduce.ring import AVG, MAX, MIN, PRODUCT, SUM, CheckOncePerShape, ring_all_reduce

ALGORITHMS = {"ring": ring_all_reduce, "naive": naive_all_reduce, "builtin": None}  # None: dist's
# max |ring - builtin| / max |builtin|: only the order of the reduction differs.
VERIFY_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.int64: 0.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="ring", help="the DDP all-reduce: ring | naive | builtin")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap in MiB")
    p.add_argument("--bench-mb", type=float, default=16.0,
                   help="tensor size of the speed comparison in MiB (0 skips it)")
    return p.parse_args(argv)


@dataclass(frozen=True)
class RingOptions(DataParallelOptions):
    """Chapter 01's options (its DDP, with --bucket-mb) and this chapter's own."""

    algorithm: str = "ring"  # the DDP all-reduce: ring | naive | builtin
    bench_mb: float = 16.0  # the speed comparison's tensor (0: skipped)


def validate(args: argparse.Namespace, world_size: int) -> Run:
    """Everything that can be wrong with the input, checked before any collective; the run."""
    validate_common(args)
    require(args.algorithm in ALGORITHMS,
            f"--algorithm {args.algorithm!r} is unknown: use one of {', '.join(ALGORITHMS)}")
    require(args.bucket_mb > 0, f"--bucket-mb {args.bucket_mb}: must be > 0 (torch's default is 25)")
    require(args.bench_mb >= 0, f"--bench-mb {args.bench_mb}: must be >= 0 (0 skips the speed test)")
    layout = batch_layout(args.global_batch, world_size, args.micro_batch, args.grad_accum)
    options = RingOptions(bucket_mb=args.bucket_mb, algorithm=args.algorithm, bench_mb=args.bench_mb)
    return resolve_run(args, mesh_shape(world_size), layout, options)


def verify_against_builtin(seed: int, device: torch.device) -> dict:
    """Ring vs dist.all_reduce on random tensors; the same verdict on every rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    worst: dict[str, float] = {}
    for dtype in VERIFY_TOLERANCE:
        for op in (SUM, AVG, MAX, MIN, PRODUCT):
            if op == AVG and not dtype.is_floating_point:
                continue
            for length in (1, max(1, n - 1), 10 * n + 3):
                if dtype.is_floating_point:
                    x = torch.randn(length, generator=gen, dtype=torch.float64).to(dtype)
                else:
                    x = torch.randint(-3, 4, (length,), generator=gen, dtype=dtype)
                ring, builtin = x.to(device, copy=True), x.to(device, copy=True)
                ring_all_reduce(ring, op=op)
                dist.all_reduce(builtin, op=SUM if op == AVG else op)  # never AVG on the wire
                if op == AVG:
                    builtin /= n
                diff = ((ring.double() - builtin.double()).abs().max()
                        / builtin.double().abs().max().clamp_min(1e-30)).item()
                worst[str(dtype)] = max(worst.get(str(dtype), 0.0), diff)
    ok = torch.tensor([int(all(worst[str(d)] <= t for d, t in VERIFY_TOLERANCE.items()))], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return {"max_rel_diff": worst, "tolerance": {str(d): t for d, t in VERIFY_TOLERANCE.items()},
            "passed": bool(ok.item())}


def compare_bandwidth(size_mb: float, device: torch.device, rounds: int = 3, iters: int = 2) -> dict:
    """Bus bandwidth (GB/s) of one size_mb float32 all-reduce by each algorithm: the algorithms take
    turns, round after round (the machine's load drifts), and each keeps its median round."""
    n = dist.get_world_size()
    tensor = torch.zeros(int(size_mb * 2**20) // 4, device=device)
    size = tensor.numel() * 4
    seconds = seconds_per_call({name: partial(fn, tensor, group=None) for name, fn in TIMED.items()},
                               iters, rounds, device)
    result: dict = {"size_bytes": size}
    for name, median in seconds.items():
        result[name] = {"seconds": median, "busbw_GBps": bus_bandwidth(size, n, median) / 1e9}
    return result


def comm_formula(algorithm: str, buckets: list[tuple[int, torch.dtype]], world: int, rank: int,
                 steps: int) -> float:
    """Per rank, for each bucket (numel, dtype) of S bytes and each step: ring 2(n-1)/n·S; naive
    (n-1)·S on the root (rank 0), S elsewhere; torch's own 2(n-1)/n·S. Plus, for ring and naive,
    the call check (32 bytes a message: n-1 of them, or the root's n-1 and one elsewhere) on the
    first call of each bucket shape only (CheckOncePerShape): DDP's calls repeat every step."""
    if world == 1:
        return 0.0
    n = world
    data = {"ring": lambda s: 2 * (n - 1) / n * s, "builtin": lambda s: 2 * (n - 1) / n * s,
            "naive": lambda s: (n - 1) * s if rank == 0 else s}[algorithm]
    checks = {"ring": CHECK_BYTES * (n - 1), "builtin": 0,
              "naive": CHECK_BYTES * (n - 1) if rank == 0 else CHECK_BYTES}[algorithm]
    return (steps * sum(data(numel * dtype.itemsize) for numel, dtype in buckets)
            + checks * len(set(buckets)))


class RingDataParallelStrategy(DataParallelStrategy):
    """Chapter 01's DDP strategy with --algorithm's all-reduce in place of dist.all_reduce. The
    ring and the naive all-reduce check the call on the first step only: DDP's buckets are fixed
    at construction, so later steps repeat calls that every rank already agreed on."""

    def __init__(self, run: Run, ctx: DistContext):
        self.algorithm, self.rank = run.options.algorithm, ctx.rank
        fn = ALGORITHMS[self.algorithm]
        super().__init__(run, ctx, lambda model, r: DistributedDataParallel(
            model, bucket_cap_mb=r.options.bucket_mb, all_reduce=CheckOncePerShape(fn) if fn else None,
            reduce_dtype=torch.float32 if r.mixed else None))
        self.name = f"ddp+{self.algorithm}"

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        buckets = [(b.buffer.numel(), b.buffer.dtype) for b in self.model.buckets]
        _, memory = super().formulas(steps)
        return comm_formula(self.algorithm, buckets, self.dp_size, self.rank, steps), memory

    def report_extras(self) -> dict:
        return {"buckets": len(self.model.buckets)}


def build(run: Run, ctx: DistContext) -> Strategy:
    return RingDataParallelStrategy(run, ctx)


def verify_and_time(run: Run, ctx: DistContext) -> dict:
    """Before training: the ring against dist.all_reduce, then the bandwidth comparison."""
    verification = verify_against_builtin(run.seed, ctx.device)
    bench_mb = run.options.bench_mb
    bandwidth = compare_bandwidth(bench_mb, ctx.device) if bench_mb > 0 else {}
    extras = {"ring_vs_builtin": verification, "bandwidth": bandwidth}
    if ctx.is_main:
        print_extras(extras, ctx.world_size)
    return extras


def print_extras(report: dict, world_size: int) -> None:
    """The chapter's own numbers, before the standard table."""
    v = report["ring_vs_builtin"]
    diffs = ", ".join(f"{d.removeprefix('torch.')} {x:.1e}" for d, x in v["max_rel_diff"].items())
    print(f"ring vs dist.all_reduce: {'PASS' if v['passed'] else 'FAIL'} (max rel diff {diffs})")
    if report["bandwidth"]:
        b = report["bandwidth"]
        cells = " · ".join(f"{a} {b[a]['busbw_GBps']:.3f} GB/s" for a in TIMED)
        print(f"bus bandwidth, {b['size_bytes'] / 2**20:g} MiB float32 on {world_size} ranks: "
              f"{cells}")


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=2, before_training=verify_and_time)
