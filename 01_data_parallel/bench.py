"""Chapter 01 benchmark: step time of naive DP, our bucketed DDP and torch's DDP, side by side.

    torchrun --standalone --nproc-per-node 4 01_data_parallel/bench.py      (or `make bench-1`)

One process group, three copies of the same model (same seed), the same global batch for each
step. The strategies are interleaved: every round runs one step of each, in an order rotated by
one per round. On a shared or oversubscribed machine (4 CPU ranks on 2 cores) the background load
drifts over a run; interleaving exposes the three to the same drift, so their medians are
comparable, where running them in sequence would compare an early window with a late one. The
first `--warmup` rounds are not timed (allocator, gloo buffers, torch DDP's bucket rebuild after its
first iteration). A step is timed from a barrier to the end of the optimizer step on every rank and
counts as the slowest rank's time; the table reports the median over the measured rounds.

Prints a table, then one JSON line: {"chapter": 1, "bench": "data_parallel", ...}.

`--sweep-buckets 0.5,1,4,25` instead times our DDP at each bucket cap, interleaved the same way,
beside two references that bound it: the same step under `no_sync()` (compute only, nothing
communicated) and one all-reduce of all P·b gradient bytes (communication only). Without overlap
a step costs about their sum; with perfect overlap, the larger of the two plus the last bucket's
all-reduce, which starts only when backward ends. JSON: {"bench": "bucket_sweep", ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from common.cli import DTYPES
from common.data import SyntheticTokens, local_micro_batches, split_inputs_targets
from common.dist import LaunchError, env_world_size, init_distributed, print0, shutdown, synchronize
from common.model import CONFIGS, build_model, count_parameters, get_config, loss_fn
from common.reference import make_optimizer
from data_parallel import DistributedDataParallel, NaiveDataParallel

TARGET = 1.15  # the goal: ours within 1.15× of torch's DDP, and faster than naive
STRATEGIES = ("naive", "ddp", "torch_ddp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=CONFIGS, default="small")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step (all ranks)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="bucket cap of ours and torch's DDP (torch's default is 25)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds")
    p.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each strategy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep-buckets", default=None, metavar="MB,MB,…",
                   help="time our DDP at these bucket caps instead (plus compute-only and comm-only)")
    args = p.parse_args(argv)
    for flag in ("global_batch", "seq_len", "steps", "bucket_mb"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be positive")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must be >= 0")
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


def train_step(dp: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               rank: int, world: int) -> None:
    """The same step as train.py: forward, loss, backward, gradient sync, AdamW step."""
    (micro,) = local_micro_batches(tokens, rank, world, tokens.shape[0] // world)
    inputs, targets = split_inputs_targets(micro)
    loss_fn(dp(inputs), targets).backward()
    if hasattr(dp, "finish"):
        dp.finish()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sweep_buckets(args: argparse.Namespace, ctx, cfg, dtype: torch.dtype, data: SyntheticTokens) -> dict:
    """Median step seconds (slowest rank) of our DDP per bucket cap, of the same step under
    no_sync() (compute only), and of one all-reduce of every gradient byte (comm only)."""
    runs = {}
    for cap in args.sweep_buckets:
        model = build_model(cfg, args.seed, dtype, ctx.device)
        runs[f"{cap:g}"] = (DistributedDataParallel(model, bucket_cap_mb=cap),
                            make_optimizer(model.parameters(), "adamw", 1e-3))
    dp, optimizer = runs[f"{args.sweep_buckets[-1]:g}"]
    flat = torch.zeros(sum(p.numel() for p in dp.module.parameters()), dtype=dtype, device=ctx.device)
    names = [*runs, "compute only", "comm only"]
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.warmup + args.steps):
        tokens = data.global_batch(r, args.global_batch).to(ctx.device)
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            synchronize(ctx.device)
            dist.barrier()
            start = time.perf_counter()
            if name == "comm only":
                dist.all_reduce(flat)
            elif name == "compute only":
                with dp.no_sync():
                    train_step(dp, optimizer, tokens, ctx.rank, ctx.world_size)
            else:
                train_step(*runs[name], tokens, ctx.rank, ctx.world_size)
            synchronize(ctx.device)
            if r >= args.warmup:
                times[name].append(time.perf_counter() - start)
    slowest = torch.tensor([times[n] for n in names], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    median = {n: statistics.median(slowest[i].tolist()) for i, n in enumerate(names)}
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
    try:
        world = env_world_size()  # checked before the process group exists, like train.py
    except LaunchError as error:
        raise SystemExit(f"error: {error}") from None
    if args.global_batch % world:
        raise SystemExit(f"error: --global-batch {args.global_batch} is not divisible by {world} "
                         f"ranks: use a multiple of {world}")
    ctx = init_distributed()
    rank = ctx.rank
    cfg, dtype = get_config(args.model), DTYPES[args.dtype]
    data = SyntheticTokens(cfg.vocab_size, args.seq_len, args.seed)
    if args.sweep_buckets is not None:
        result = sweep_buckets(args, ctx, cfg, dtype, data)
        for name, seconds in result["step_s_median"].items():
            label = name if not name[0].isdigit() else (f"ddp, {name} MiB cap "
                                                        f"({len(result['bucket_bytes'][name])} buckets)")
            print0(f"{label:<32}{1e3 * seconds:>9.1f} ms")
        print0(json.dumps(result))
        shutdown()
        return

    runs = {}
    for strategy in STRATEGIES:
        model = build_model(cfg, args.seed, dtype, ctx.device)
        dp = wrap(strategy, model, args.bucket_mb, ctx.device)
        runs[strategy] = (dp, make_optimizer(model.parameters(), "adamw", 1e-3))
    n_params = count_parameters(runs["ddp"][0].module)
    n_tensors = len(list(runs["ddp"][0].module.parameters()))

    times = {s: [] for s in STRATEGIES}
    for r in range(args.warmup + args.steps):
        tokens = data.global_batch(r, args.global_batch).to(ctx.device)
        for k in range(len(STRATEGIES)):
            strategy = STRATEGIES[(r + k) % len(STRATEGIES)]
            dp, optimizer = runs[strategy]
            synchronize(ctx.device)
            dist.barrier()
            start = time.perf_counter()
            train_step(dp, optimizer, tokens, rank, world)
            synchronize(ctx.device)
            if r >= args.warmup:
                times[strategy].append(time.perf_counter() - start)

    # A step takes as long as its slowest rank.
    slowest = torch.tensor([times[s] for s in STRATEGIES], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    median = {s: statistics.median(slowest[i].tolist()) for i, s in enumerate(STRATEGIES)}
    spread = {s: (min(slowest[i].tolist()), max(slowest[i].tolist())) for i, s in enumerate(STRATEGIES)}
    tokens_per_step = args.global_batch * args.seq_len
    calls = {"naive": n_tensors, "ddp": len(runs["ddp"][0].buckets),
             "torch_ddp": torch_bucket_count(runs["torch_ddp"][0])}
    names = {"naive": "naive (per tensor)", "ddp": "ours (bucketed)", "torch_ddp": "torch DDP"}
    del runs, model, dp, optimizer  # free torch DDP's Reducer while the group lives (shutdown's doc)

    print0(f"chapter 1 bench · {args.model} ({n_params:,} params, {args.dtype}) · dp={world} · "
           f"{ctx.backend} on {ctx.device} · batch {args.global_batch}×{args.seq_len} · "
           f"bucket cap {args.bucket_mb:g} MiB · median of {args.steps} steps (+{args.warmup} warm-up)")
    print0(f"{'strategy':<20}{'all-reduces':>12}{'step ms':>10}{'min–max ms':>16}{'tokens/s':>10}"
           f"{'/ torch':>9}")
    for s in STRATEGIES:
        lo, hi = spread[s]
        print0(f"{names[s]:<20}{calls[s] if calls[s] is not None else '-':>12}"
               f"{1e3 * median[s]:>10.1f}{f'{1e3 * lo:.0f}–{1e3 * hi:.0f}':>16}"
               f"{tokens_per_step / median[s]:>10.0f}{median[s] / median['torch_ddp']:>9.3f}")
    ours, naive = median["ddp"] / median["torch_ddp"], median["naive"] / median["torch_ddp"]
    met = ours <= TARGET and median["ddp"] < median["naive"]
    print0(f"ours/torch {ours:.3f} · naive/torch {naive:.3f} · target ours/torch ≤ {TARGET} and "
           f"ours < naive: {'met' if met else 'MISSED'}")
    print0(json.dumps({
        "chapter": 1, "bench": "data_parallel", "model": args.model, "params": n_params,
        "dtype": args.dtype, "world_size": world, "backend": ctx.backend, "device": str(ctx.device),
        "global_batch": args.global_batch, "seq_len": args.seq_len, "bucket_cap_mb": args.bucket_mb,
        "warmup": args.warmup, "steps": args.steps,
        "step_s_median": median, "tokens_per_s": {s: tokens_per_step / median[s] for s in median},
        "all_reduce_calls_per_step": calls,
        "ratios": {"ours_over_torch": ours, "naive_over_torch": naive}, "target": TARGET,
        "target_met": met,
    }))
    shutdown()


if __name__ == "__main__":
    main()
