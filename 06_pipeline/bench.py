"""Chapter 06 benchmark: our schedules vs torch.distributed.pipelining on the same stages.

    make bench-6                       # 4 CPU ranks (gloo), or one per GPU (NCCL)
    torchrun --standalone --nproc-per-node 4 06_pipeline/bench.py --steps 4

For each schedule, both implementations run forward+backward of the same LLaMA chunks (same
weights, same micro-batches), interleaved and timed by `common.bench` (rotated order, one warm-up
step, the slowest rank's median) so that machine noise hits both alike:
ours (PipelineExecutor) against ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B and, for
zero-bubble, ScheduleInterleavedZeroBubble (torch has no plain ZB-H1; its interleaved zero-bubble
schedule with v = 2 is the closest). Rank 0 prints step time per implementation, the ratio
ours/torch, our measured bubble beside the simulated one, and saves our measured timelines as a
PNG (on a GPU each action is timed by CUDA events on the compute stream). torch exposes no
per-action timeline, so its bubble is estimated as 1 - (our busy time) / (p · its step time),
assuming equal compute per action.

Which torch the yardstick needs: on NCCL every torch we support (2.6+). On gloo, torch 2.8 or
later: torch 2.6 and 2.7's pipelining (`_batch_p2p`) keeps only the last work of each
`batch_isend_irecv` group and waits on that alone. NCCL coalesces a group into one work, so that
is harmless there; gloo returns one work per op, so a group of several ops (Schedule1F1B's fused
send + receive, the multi-stage schedules' steps) leaves receives unwaited and the ranks hang
(pytorch#132644, fixed by pytorch#152938 in 2.8). `torch_yardstick_error` tests for the fix and the
bench refuses to start without it (exit 2, one line).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.pipelining as tpp
import torch.distributed.pipelining.schedules as tpp_schedules
from torch import nn

from common import bench as harness
from common.dist import DistContext, pick_backend
from common.kernel.model import build_model, get_config, loss_fn
from pipeline.executor import PipelineExecutor
from pipeline.schedules import SCHEDULES, make_schedule, schedule_error
from pipeline.simulator import bubble_fraction, simulate
from pipeline.stage import LlamaChunk, split_model
from pipeline.timeline import measured_bubble, save_png, shift

TORCH_SCHEDULES = {"gpipe": tpp.ScheduleGPipe, "1f1b": tpp.Schedule1F1B,
                   "interleaved": tpp.ScheduleInterleaved1F1B, "zb": tpp.ScheduleInterleavedZeroBubble}
FIXED_IN = "2.8"  # pytorch#152938: _batch_p2p returns (and the schedules wait on) every work


def torch_waits_on_every_work() -> bool:
    """Whether torch's pipelining waits on every work of a `batch_isend_irecv` group. A feature
    test, no communication: the fixed `_batch_p2p` returns a list of works ([] for no ops), the
    old one a single work (None for no ops). Should the private helper be renamed, the version
    decides."""
    batch_p2p = getattr(tpp_schedules, "_batch_p2p", None)
    if batch_p2p is None:
        return torch.__version__ >= FIXED_IN
    return batch_p2p([]) == []


def torch_yardstick_error(backend: str) -> str | None:
    """Why torch's schedules cannot be the yardstick on `backend` with this torch (one line), or None."""
    if backend == "nccl" or torch_waits_on_every_work():
        return None
    return (f"torch {torch.__version__}'s pipelining schedules hang on {backend}: they wait on only the "
            f"last op of each batch_isend_irecv group (pytorch#132644); the yardstick needs torch >= "
            f"{FIXED_IN} on {backend} (or NCCL)")


class WithPositions(nn.Module):
    """A chunk with its RoPE positions bound, for torch's PipelineStage, which passes each stage
    only the previous stage's output (our executor hands positions to every chunk itself)."""

    def __init__(self, chunk: LlamaChunk, positions: torch.Tensor):
        super().__init__()
        self.chunk, self.positions = chunk, positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x, self.positions)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="timed steps per implementation (after 1 warm-up)")
    p.add_argument("--schedules", default=",".join(TORCH_SCHEDULES))
    p.add_argument("--png", default=str(Path(__file__).with_name("timelines.png")))
    return p.parse_args(argv)


def torch_schedule(name: str, chunks: list[LlamaChunk], positions: torch.Tensor, p: int, m: int,
                   device: torch.device):
    stages = [tpp.PipelineStage(WithPositions(c, positions), c.stage, c.n_stages, device) for c in chunks]
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


def bench_schedule(name: str, args: argparse.Namespace, ctx: DistContext, tokens: torch.Tensor,
                   timelines: dict) -> tuple | None:
    """One table row for schedule `name` (None when it does not fit the launch): both
    implementations timed side by side, our measured bubble, the simulated one, torch's estimate.
    Returning frees torch's PipelineStage and schedule, which hold the process group."""
    p, rank, m, cfg = ctx.world_size, ctx.rank, args.microbatches, get_config(args.model)
    spec = SCHEDULES[name]
    v_ours = 1 if p == 1 and spec.free_v else spec.default_v
    v = 2 if name == "zb" and p > 1 else v_ours  # our zb is ZB-H1 (v = 1); torch's is interleaved
    if schedule_error(name, p, m, v_ours) or cfg.n_layers % (p * v):
        return None
    schedule = make_schedule(name, p, m, v_ours)
    ours_chunks = split_model(build_model(cfg, 0, torch.float32, ctx.device), p, v_ours, rank,
                              stages=schedule.stages(rank))
    theirs_chunks = split_model(build_model(cfg, 0, torch.float32, ctx.device), p, v, rank)
    executor = PipelineExecutor(schedule, rank, ours_chunks, loss_fn,
                                (args.micro_batch, args.seq_len, cfg.dim), torch.float32, ctx.device)
    micro_in, micro_tgt = (list(t.split(args.micro_batch)) for t in (tokens[:, :-1], tokens[:, 1:]))
    positions = torch.arange(args.seq_len, device=ctx.device)  # every micro-batch: 0 … s-1
    steps = {"ours": lambda _: executor.run(micro_in, micro_tgt, [positions] * m)}
    try:  # KeyError: no torch yardstick for this schedule
        theirs = torch_schedule(name, theirs_chunks, positions, p, m, ctx.device)
        steps["torch"] = lambda _: torch_step(theirs, theirs_chunks, tokens)
    except Exception as error:  # e.g. a schedule torch does not support for this layout
        if rank == 0:
            print(f"torch {TORCH_SCHEDULES[name].__name__}: {type(error).__name__}: {error}")
    bubbles, busy = [], []

    def gather_timeline_and_zero(which: str, step: int) -> None:
        if which == "ours":
            gathered = [None] * p
            dist.all_gather_object(gathered, executor.timeline)
            intervals = [i for g in gathered for i in g]
            if step:  # after the warm-up step
                bubbles.append(measured_bubble(intervals, p))
                busy.append(sum(i.end - i.start for i in intervals))
                timelines[f"{name} (ours, measured)"] = shift(intervals, min(i.start for i in intervals))
        for c in ours_chunks if which == "ours" else theirs_chunks:
            c.zero_grad(set_to_none=True)

    median = harness.interleaved(steps, args.steps, 1, ctx.device, after=gather_timeline_and_zero).median
    ours_t, theirs_t = median["ours"], median.get("torch", 0.0)
    torch_bubble = 1 - statistics.median(busy) / (p * theirs_t) if theirs_t else float("nan")
    return (name, schedule.v, v, ours_t, theirs_t, statistics.median(bubbles),
            float(bubble_fraction(simulate(schedule), p)), torch_bubble)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if (error := torch_yardstick_error(pick_backend())) is not None:  # before any collective
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2)
    ctx = harness.launch()
    cfg = get_config(args.model)
    tokens = torch.randint(0, cfg.vocab_size, (args.microbatches * args.micro_batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0)).to(ctx.device)
    timelines: dict = {}
    rows = [row for name in args.schedules.split(",")
            if (row := bench_schedule(name, args, ctx, tokens, timelines)) is not None]
    if ctx.is_main:
        print(f"\npipeline bench · {ctx.world_size} ranks · {ctx.backend} on {ctx.device} · model "
              f"{args.model} · m={args.microbatches} × micro-batch {args.micro_batch} · seq {args.seq_len} · "
              f"median of {args.steps} steps")
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
    harness.finish({"bench": "pipeline", "world_size": ctx.world_size, "microbatches": args.microbatches,
                    "rows": [{"schedule": name, "v": v_ours, "ours_s": o, "torch_s": t or None,
                              "ratio": o / t if t else None, "bubble": b, "bubble_simulated": s}
                             for name, v_ours, _, o, t, b, s, _ in rows]})


if __name__ == "__main__":
    main()
