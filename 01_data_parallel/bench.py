"""Chapter 01 benchmark: step time of naive DP, our bucketed DDP and torch's DDP, side by side.

    torchrun --standalone --nproc-per-node 4 01_data_parallel/bench.py      (or `make bench-1`)

One process group, three copies of the same model (same seed), the same global batch for each
step, interleaved and timed by `common.bench` (every round one step of each, in an order rotated
by one per round; a step counts as its slowest rank's time, from a barrier to the end of the
optimizer step; the table reports the median over the measured rounds). The first `--warmup`
rounds are not timed (allocator, gloo buffers, torch DDP's bucket rebuild after its first
iteration).

Prints a table, then one JSON line: {"chapter": 1, "bench": "data_parallel", ...}.

`--sweep-buckets 0.5,1,4,25` instead times our DDP at each bucket cap, interleaved the same way,
beside two references that bound it: the same step under `no_sync()` (compute only, nothing
communicated) and one all-reduce of all P·b gradient bytes (communication only). Without overlap
a step costs about their sum; with perfect overlap, the larger of the two plus the last bucket's
all-reduce, which starts only when backward ends. JSON: {"bench": "bucket_sweep", ...}.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from common import bench as harness
from common.cli import DTYPES
from common.dist import DistContext, print0
from common.kernel.model import LlamaConfig, build_model, count_parameters, get_config
from common.reference import make_optimizer
from data_parallel import DistributedDataParallel, NaiveDataParallel

TARGET = 1.15  # the goal: ours within 1.15× of torch's DDP, and faster than naive
STRATEGIES = ("naive", "ddp", "torch_ddp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.bench_parser(__doc__, warmup=3, steps=20)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step (all ranks)")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="bucket cap of ours and torch's DDP (torch's default is 25)")
    p.add_argument("--sweep-buckets", default=None, metavar="MB,MB,…",
                   help="time our DDP at these bucket caps instead (plus compute-only and comm-only)")
    args = harness.parse_checked(p, argv, positive=("global_batch", "bucket_mb"))
    if args.sweep_buckets is not None:
        try:
            args.sweep_buckets = [float(x) for x in args.sweep_buckets.split(",")]
        except ValueError:
            p.error(f"--sweep-buckets {args.sweep_buckets!r}: use comma-separated MiB, e.g. 0.5,1,4,25")
        if not all(x > 0 for x in args.sweep_buckets):
            p.error(f"--sweep-buckets {args.sweep_buckets}: every cap must be > 0")
    return args


def wrap(strategy: str, model: torch.nn.Module, bucket_mb: float,
         device: torch.device) -> torch.nn.Module:
    if strategy == "naive":
        return NaiveDataParallel(model)
    if strategy == "ddp":
        return DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    # torch's reducer syncs inside backward (no finish()). On CPU + gloo: device_ids=None.
    device_ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                                     bucket_cap_mb=bucket_mb)


def sweep_buckets(args: argparse.Namespace, ctx: DistContext, cfg: LlamaConfig, dtype: torch.dtype,
                  batches: Callable[[int], torch.Tensor]) -> dict:
    """Median step seconds (slowest rank) of our DDP per bucket cap, of the same step under
    no_sync() (compute only), and of one all-reduce of every gradient byte (comm only)."""
    runs = {}
    for cap in args.sweep_buckets:
        model = build_model(cfg, args.seed, dtype, ctx.device)
        runs[f"{cap:g}"] = (DistributedDataParallel(model, bucket_cap_mb=cap),
                            make_optimizer(model.parameters(), "adamw", 1e-3))
    dp, optimizer = runs[f"{args.sweep_buckets[-1]:g}"]
    flat = torch.zeros(sum(p.numel() for p in dp.module.parameters()), dtype=dtype, device=ctx.device)

    def compute_only(tokens: torch.Tensor) -> None:
        with dp.no_sync():
            harness.data_parallel_step(dp, optimizer.step, tokens)

    steps = {cap: partial(harness.data_parallel_step, dp_, opt.step) for cap, (dp_, opt) in runs.items()}
    steps |= {"compute only": compute_only, "comm only": lambda tokens: dist.all_reduce(flat)}
    median = harness.interleaved(steps, args.steps, args.warmup, ctx.device, batches,
                         lambda name, r: (runs[name][1] if name in runs else optimizer).zero_grad()).median
    buckets = {cap: [b.buffer.numel() * b.buffer.element_size() for b in dp_.buckets]
               for cap, (dp_, _) in runs.items()}
    return {"chapter": 1, "bench": "bucket_sweep", "model": args.model, "dtype": args.dtype,
            "world_size": ctx.world_size, "backend": ctx.backend, "global_batch": args.global_batch,
            "seq_len": args.seq_len, "steps": args.steps, "step_s_median": median,
            "bucket_bytes": buckets, "grad_bytes": flat.numel() * flat.element_size()}


def torch_bucket_count(dp: torch.nn.parallel.DistributedDataParallel) -> int | None:
    """Buckets after torch's rebuild (in the order gradients became ready, at the start of its
    second forward), from its logging data, which lags by one iteration: needs 3 steps run."""
    data = dp._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    return len(str(sizes).split(", ")) if sizes else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = harness.launch(args.global_batch)
    world = ctx.world_size
    cfg, dtype = get_config(args.model), DTYPES[args.dtype]
    batches = harness.synthetic_batches(cfg.vocab_size, args.seq_len, args.seed, args.global_batch,
                                        ctx.device)
    if args.sweep_buckets is not None:
        result = sweep_buckets(args, ctx, cfg, dtype, batches)
        for name, seconds in result["step_s_median"].items():
            label = name if not name[0].isdigit() else (f"ddp, {name} MiB cap "
                                                        f"({len(result['bucket_bytes'][name])} buckets)")
            print0(f"{label:<32}{1e3 * seconds:>9.1f} ms")
        harness.finish(result)
        return

    runs = {}
    for strategy in STRATEGIES:
        model = build_model(cfg, args.seed, dtype, ctx.device)
        runs[strategy] = (wrap(strategy, model, args.bucket_mb, ctx.device),
                          make_optimizer(model.parameters(), "adamw", 1e-3))
    del model
    n_params = count_parameters(runs["ddp"][0].module)
    n_tensors = len(list(runs["ddp"][0].module.parameters()))
    steps = {s: partial(harness.data_parallel_step, dp, opt.step) for s, (dp, opt) in runs.items()}
    timings = harness.interleaved(steps, args.steps, args.warmup, ctx.device, batches,
                                  lambda s, r: runs[s][1].zero_grad())
    median = timings.median
    tokens_per_step = args.global_batch * args.seq_len
    calls = {"naive": n_tensors, "ddp": len(runs["ddp"][0].buckets),
             "torch_ddp": torch_bucket_count(runs["torch_ddp"][0])}
    names = {"naive": "naive (per tensor)", "ddp": "ours (bucketed)", "torch_ddp": "torch DDP"}

    print0(f"chapter 1 bench · {args.model} ({n_params:,} params, {args.dtype}) · dp={world} · "
           f"{ctx.backend} on {ctx.device} · batch {args.global_batch}×{args.seq_len} · "
           f"bucket cap {args.bucket_mb:g} MiB · median of {args.steps} steps (+{args.warmup} warm-up)")
    print0(f"{'strategy':<20}{'all-reduces':>12}{'step ms':>10}{'min–max ms':>16}{'tokens/s':>10}"
           f"{'/ torch':>9}")
    for s in STRATEGIES:
        lo, hi = min(timings.rounds[s]), max(timings.rounds[s])
        print0(f"{names[s]:<20}{calls[s] if calls[s] is not None else '-':>12}"
               f"{1e3 * median[s]:>10.1f}{f'{1e3 * lo:.0f}–{1e3 * hi:.0f}':>16}"
               f"{tokens_per_step / median[s]:>10.0f}{median[s] / median['torch_ddp']:>9.3f}")
    ours, naive = median["ddp"] / median["torch_ddp"], median["naive"] / median["torch_ddp"]
    met = ours <= TARGET and median["ddp"] < median["naive"]
    print0(f"ours/torch {ours:.3f} · naive/torch {naive:.3f} · target ours/torch ≤ {TARGET} and "
           f"ours < naive: {harness.verdict(met)}")
    harness.finish({
        "chapter": 1, "bench": "data_parallel", "model": args.model, "params": n_params,
        "dtype": args.dtype, "world_size": world, "backend": ctx.backend, "device": str(ctx.device),
        "global_batch": args.global_batch, "seq_len": args.seq_len, "bucket_cap_mb": args.bucket_mb,
        "warmup": args.warmup, "steps": args.steps,
        "step_s_median": median, "tokens_per_s": {s: tokens_per_step / median[s] for s in median},
        "all_reduce_calls_per_step": calls,
        "ratios": {"ours_over_torch": ours, "naive_over_torch": naive}, "target": TARGET,
        "target_met": met,
    }, runs, steps)  # frees torch DDP's Reducer while the group lives


if __name__ == "__main__":
    main()
