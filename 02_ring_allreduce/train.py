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
import os
import statistics
import sys

import torch
import torch.distributed as dist

from common.cli import (
    ConfigError,
    base_parser,
    batch_layout,
    exit_on_config_error,
    require,
    validate_common,
)
from common.dist import (
    DistContext,
    LaunchError,
    env_world_size,
    init_distributed,
    shutdown,
)
from common.report import emit_report
from data_parallel import DistributedDataParallel
from data_parallel.train import train as data_parallel_train
from ring_allreduce.bench import ALGORITHMS as TIMED
from ring_allreduce.bench import time_calls
from ring_allreduce.cost_model import bus_bandwidth
from ring_allreduce.naive import naive_all_reduce
from ring_allreduce.ring import AVG, MAX, MIN, PRODUCT, SUM, ring_all_reduce

ALGORITHMS = {"ring": ring_all_reduce, "naive": naive_all_reduce, "builtin": None}  # None: dist's
CHECK_BYTES = 16  # the call signature ring/naive exchange per hop before the data (check=True)
# max |ring - builtin| / max |builtin|: only the order of the reduction differs.
VERIFY_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.int64: 0.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="ring", help="the DDP all-reduce: ring | naive | builtin")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap in MiB")
    p.add_argument("--bench-mb", type=float, default=16.0,
                   help="tensor size of the speed comparison in MiB (0 skips it)")
    return p.parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> tuple[int, int]:
    """Everything that can be wrong with the input, checked before any collective."""
    validate_common(args)
    require(args.algorithm in ALGORITHMS,
            f"--algorithm {args.algorithm!r} is unknown: use one of {', '.join(ALGORITHMS)}")
    require(args.bucket_mb > 0, f"--bucket-mb {args.bucket_mb}: must be > 0 (torch's default is 25)")
    require(args.bench_mb >= 0, f"--bench-mb {args.bench_mb}: must be >= 0 (0 skips the speed test)")
    return batch_layout(args.global_batch, world_size, args.micro_batch, args.grad_accum)


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
    times: dict[str, list[float]] = {name: [] for name in TIMED}
    for fn in TIMED.values():
        fn(tensor, group=None)  # warm-up
    for _ in range(rounds):
        for name, fn in TIMED.items():
            times[name].append(time_calls(fn, tensor, None, iters))
    result: dict = {"size_bytes": size}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        result[name] = {"seconds": median, "busbw_GBps": bus_bandwidth(size, n, median) / 1e9}
    return result


def comm_formula(algorithm: str, bucket_bytes: list[int], world: int, rank: int, steps: int) -> float:
    """Per rank and step, for each bucket: ring 2(n-1)/n·S + 16(n-1) (the call check); naive
    (n-1)·S + 16(n-1) on the root (rank 0), S + 16 elsewhere; torch's own 2(n-1)/n·S."""
    if world == 1:
        return 0.0
    n = world
    per_bucket = {
        "ring": lambda s: 2 * (n - 1) / n * s + CHECK_BYTES * (n - 1),
        "naive": lambda s: (n - 1) * (s + CHECK_BYTES) if rank == 0 else s + CHECK_BYTES,
        "builtin": lambda s: 2 * (n - 1) / n * s,
    }[algorithm]
    return steps * sum(per_bucket(s) for s in bucket_bytes)


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
    status = 0 if report.get("check_passed", True) and report["ring_vs_builtin"]["passed"] else 1
    shutdown()
    return status


def train(args: argparse.Namespace, ctx: DistContext, micro_batch: int, grad_accum: int) -> dict:
    """Verify, time, then train for args.steps steps through chapter 01's loop with a DDP whose
    all-reduce is --algorithm's; return the run report."""
    verification = verify_against_builtin(args.seed, ctx.device)
    bandwidth = compare_bandwidth(args.bench_mb, ctx.device) if args.bench_mb > 0 else {}
    buckets: list[int] = []

    def wrap(model, args):
        dp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb,
                                     all_reduce=ALGORITHMS[args.algorithm])
        buckets.extend(b.buffer.numel() * b.buffer.element_size() for b in dp.buckets)
        return dp

    args.strategy = f"ddp+{args.algorithm}"
    report = data_parallel_train(args, ctx, micro_batch, grad_accum, wrap=wrap)
    report.update(
        chapter=2, buckets=len(buckets), ring_vs_builtin=verification, bandwidth=bandwidth,
        comm_bytes_formula=comm_formula(args.algorithm, buckets, ctx.world_size, ctx.rank, args.steps),
    )
    if ctx.is_main:
        print_extras(report)
    return report


def print_extras(report: dict) -> None:
    """The chapter's own numbers, before the standard table."""
    v = report["ring_vs_builtin"]
    diffs = ", ".join(f"{d.removeprefix('torch.')} {x:.1e}" for d, x in v["max_rel_diff"].items())
    print(f"ring vs dist.all_reduce: {'PASS' if v['passed'] else 'FAIL'} (max rel diff {diffs})")
    if report["bandwidth"]:
        b = report["bandwidth"]
        cells = " · ".join(f"{a} {b[a]['busbw_GBps']:.3f} GB/s" for a in TIMED)
        print(f"bus bandwidth, {b['size_bytes'] / 2**20:g} MiB float32 on {report['world_size']} ranks: "
              f"{cells}")


if __name__ == "__main__":
    sys.exit(main())
