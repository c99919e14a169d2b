"""Chapter 06 benchmark: our schedules vs torch.distributed.pipelining on the same stages.

    make bench-6                       # 4 CPU ranks (gloo), or one per GPU (NCCL)
    torchrun --standalone --nproc-per-node 4 06_pipeline/bench.py --steps 4

For each schedule, both implementations run forward+backward of the same LLaMA chunks (same
weights, same micro-batches), alternating step by step so that machine noise hits both alike:
ours (PipelineExecutor) against ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and, for
zero-bubble, ScheduleInterleavedZeroBubble (torch has no plain ZB-H1; its interleaved zero-bubble
schedule with v = 2 is the closest). Rank 0 prints step time per implementation, the ratio
ours/torch, our measured bubble beside the simulated one, and saves our measured timelines as a
PNG (on a GPU each action is timed by CUDA events on the compute stream, and every step's clock
is read after a synchronize). torch exposes no per-action timeline, so its bubble is estimated as
1 - (our busy time) / (p · its step time), assuming equal compute per action.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as tpp

from common.dist import init_distributed, print0, shutdown, synchronize
from common.model import build_model, get_config, loss_fn
from pipeline.executor import PipelineExecutor
from pipeline.schedules import make_schedule, schedule_error
from pipeline.simulator import bubble_fraction, simulate
from pipeline.timeline import measured_bubble, save_png, shift
from pipeline.train import build_stages

TORCH_SCHEDULES = {"gpipe": tpp.ScheduleGPipe, "1f1b": tpp.Schedule1F1B,
                   "interleaved": tpp.ScheduleInterleaved1F1B, "zb": tpp.ScheduleInterleavedZeroBubble}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="timed steps per implementation (after 1 warm-up)")
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb")
    p.add_argument("--png", default=str(Path(__file__).with_name("timelines.png")))
    return p.parse_args(argv)


def torch_schedule(name: str, chunks, p: int, m: int, device: torch.device):
    stages = [tpp.PipelineStage(c, c.stage, c.n_stages, device) for c in chunks]
    cls = TORCH_SCHEDULES[name]
    if name in ("gpipe", "1f1b"):
        return cls(stages[0], n_microbatches=m, loss_fn=loss_fn)
    return cls(stages, n_microbatches=m, loss_fn=loss_fn)


def torch_step(schedule, chunks, tokens: torch.Tensor) -> None:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    first = any(c.is_first for c in chunks)
    last = any(c.is_last for c in chunks)
    kwargs = {"target": targets, "losses": []} if last else {}
    if first:
        schedule.step(inputs, **kwargs)
    else:
        schedule.step(**kwargs)


def main() -> None:
    args = parse_args()
    ctx = init_distributed()
    p, rank, m = ctx.world_size, ctx.rank, args.microbatches
    cfg = get_config(args.model)
    tokens = torch.randint(0, cfg.vocab_size, (m * args.micro_batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0)).to(ctx.device)
    micro_in = list(tokens[:, :-1].split(args.micro_batch))
    micro_tgt = list(tokens[:, 1:].split(args.micro_batch))
    rows, timelines = [], {}
    for name in args.schedules.split(","):
        v = 2 if name in ("interleaved", "zb") and p > 1 else 1
        if schedule_error(name, p, m, v if name == "interleaved" else 1) or cfg.n_layers % (p * v):
            continue
        ours_chunks = build_stages(build_model(cfg, 0, torch.float32, ctx.device), cfg, p,
                                   v if name == "interleaved" else 1, rank)
        theirs_chunks = build_stages(build_model(cfg, 0, torch.float32, ctx.device), cfg, p, v, rank)
        schedule = make_schedule(name, p, m, v if name == "interleaved" else 1)
        executor = PipelineExecutor(schedule, rank, ours_chunks, loss_fn,
                                    (args.micro_batch, args.seq_len, cfg.dim), torch.float32, ctx.device)
        try:
            theirs = torch_schedule(name, theirs_chunks, p, m, ctx.device)
        except Exception as error:  # e.g. a schedule torch does not support for this layout
            theirs = None
            if rank == 0:
                print(f"torch {TORCH_SCHEDULES[name].__name__}: {type(error).__name__}: {error}")
        t_ours, t_theirs, bubbles, busy = [], [], [], []
        for step in range(args.steps + 1):
            dist.barrier()
            start = time.perf_counter()
            executor.run(micro_in, micro_tgt)
            synchronize(ctx.device)
            t = time.perf_counter() - start
            gathered = [None] * p
            dist.all_gather_object(gathered, executor.timeline)
            intervals = [i for g in gathered for i in g]
            if step:
                t_ours.append(t)
                bubbles.append(measured_bubble(intervals, p))
                busy.append(sum(i.end - i.start for i in intervals))
                timelines[f"{name} (ours, measured)"] = shift(intervals, min(i.start for i in intervals))
            for c in ours_chunks:
                c.zero_grad(set_to_none=True)
            if theirs is not None:
                dist.barrier()
                start = time.perf_counter()
                torch_step(theirs, theirs_chunks, tokens)
                synchronize(ctx.device)
                t = time.perf_counter() - start
                if step:
                    t_theirs.append(t)
                for c in theirs_chunks:
                    c.zero_grad(set_to_none=True)
        times = torch.tensor([statistics.median(t_ours), statistics.median(t_theirs) if t_theirs else 0.0],
                             dtype=torch.float64, device=ctx.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the step takes as long as its slowest rank
        ours_t, theirs_t = times.tolist()
        busy_mean = statistics.median(busy)
        rows.append((name, schedule.v, v, ours_t, theirs_t, statistics.median(bubbles),
                     float(bubble_fraction(simulate(schedule), p)),
                     1 - busy_mean / (p * theirs_t) if theirs_t else float("nan")))
        # torch's PipelineStage and schedule hold the process group: free them before shutdown
        del theirs, theirs_chunks, executor, ours_chunks
    if rank == 0:
        print(f"\npipeline bench · {p} ranks · {ctx.backend} on {ctx.device} · model {args.model} · "
              f"m={m} × micro-batch {args.micro_batch} · seq {args.seq_len} · median of {args.steps} steps")
        print(f"{'schedule':<12}{'v':>5}{'ours s':>10}{'torch s':>10}{'ratio':>8}{'bubble':>9}"
              f"{'simulated':>11}{'torch est.':>12}")
        for name, v_ours, v, o, t, b, s, tb in rows:
            ratio = f"{o / t:.2f}" if t else "-"
            vs = f"{v_ours}/{v}"
            print(f"{name:<12}{vs:>5}{o:>10.3f}{(t or float('nan')):>10.3f}{ratio:>8}{b:>9.3f}"
                  f"{s:>11.3f}{tb:>12.3f}")
        if args.png and timelines:
            save_png(timelines, args.png)
            print(f"timelines: {args.png}")
    print0(json.dumps({"bench": "pipeline", "world_size": p, "microbatches": m, "rows": [
        {"schedule": name, "v": v_ours, "ours_s": o, "torch_s": t or None,
         "ratio": o / t if t else None, "bubble": b, "bubble_simulated": s}
        for name, v_ours, _, o, t, b, s, _ in rows]}))
    shutdown()


if __name__ == "__main__":
    main()
