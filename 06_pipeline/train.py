"""Chapter 06 demo: train LLaMA cut into pipeline stages, one stage per rank torchrun started.

    torchrun --standalone --nproc-per-node 4 06_pipeline/train.py --schedule 1f1b --microbatches 8

Every rank holds p·v chunks' worth of layers (1/p of the model), takes the same global batch
(dp = 1), cuts it into m micro-batches and runs the chosen schedule; only activations and their
gradients cross between neighbouring ranks. The last stage reports the loss. Rank 0 prints the
measured timeline of the last step beside the simulated bubble and the closed form. `--check`
trains the single-device reference alongside and exits 1 when the two differ.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from common.cli import BatchLayout, base_parser, model_config, require, validate_common
from common.data import split_inputs_targets
from common.dist import DistContext
from common.kernel.clip import clip_grads_by_global_norm_
from common.kernel.mesh import mesh_shape
from common.kernel.model import build_model, initializer, loss_fn, materialize
from common.kernel.optimizer_bytes import optimizer_state_bytes
from common.memory import optimizer_state_tensors, storage_bytes
from common.mixed_precision import MasterWeights
from common.reference import make_optimizer
from common.run import Run, resolve_run
from common.training import Strategy, run_main
from pipeline.executor import LossFn, PipelineExecutor
from pipeline.schedules import (
    SCHEDULES,
    Schedule,
    make_schedule,
    peak_in_flight,
    schedule_error,
    virtual_stages,
)
from pipeline.simulator import bubble_formula, closed_form_bubble, simulate
from pipeline.simulator import bubble_fraction as simulated_bubble
from pipeline.stage import partition_error, split_model
from pipeline.timeline import measured_bubble, render_text, save_png, shift


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--schedule", default="1f1b", help=" | ".join(SCHEDULES))
    p.add_argument("--microbatches", type=int, default=8, metavar="M",
                   help="micro-batches per step (global batch / M sequences each)")
    p.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="model chunks per rank (interleaved only; default 2 there, else 1)")
    p.add_argument("--partition", default=None, metavar="N,N,…",
                   help="layers per (virtual) stage, e.g. 3,2,2,1 (default: an even split)")
    p.add_argument("--timeline-png", default=None, metavar="PATH",
                   help="save the last step's measured timeline (rank 0)")
    return p.parse_args(argv)


def parse_partition(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--partition {text!r}: give comma-separated layer counts, e.g. 3,2,2,1") from None


@dataclass(frozen=True)
class PipelineOptions:
    """The chapter's resolved flags (the run's `options`); m is the run's grad_accum, p its mesh's pp."""

    schedule: str = "1f1b"
    v: int = 1  # model chunks per rank (--virtual-stages, or the schedule's default)
    partition: tuple[int, ...] | None = None  # layers per (virtual) stage; None: an even split
    timeline_png: str | None = None


def validate(args: argparse.Namespace, world_size: int) -> Run:
    """Everything that can be wrong with the input, checked on every rank before any send; the run."""
    validate_common(args)
    p, m, v = world_size, args.microbatches, virtual_stages(args.schedule, args.virtual_stages)
    require(m >= 1, f"--microbatches {m}: must be >= 1")
    require((error := schedule_error(args.schedule, p, m, v)) is None, str(error))
    require(args.global_batch % m == 0,
            f"--global-batch {args.global_batch} is not divisible by --microbatches {m}: use a "
            f"multiple of {m}, e.g. --global-batch {m * max(1, round(args.global_batch / m))}")
    micro = args.global_batch // m
    require(args.micro_batch in (None, micro),
            f"--micro-batch {args.micro_batch} != --global-batch {args.global_batch} / --microbatches "
            f"{m} = {micro}: pipeline ranks share the batch (dp = 1); drop --micro-batch")
    require(args.grad_accum in (None, m),
            f"--grad-accum {args.grad_accum} != --microbatches {m}: a pipeline accumulates over its "
            "micro-batches; drop --grad-accum")
    try:
        partition = parse_partition(args.partition)
    except ValueError as error:
        require(False, str(error))
    n_layers = model_config(args).n_layers
    require((error := partition_error(n_layers, p, v, partition)) is None, str(error))
    options = PipelineOptions(args.schedule, v, tuple(partition) if partition else None,
                              getattr(args, "timeline_png", None))
    return resolve_run(args, mesh_shape(world_size, pp=world_size), BatchLayout(micro, m), options)


class PipelineStrategy(Strategy):
    """This rank's chunks, their optimizer, and the executor of the chosen schedule, which
    replaces the shared micro-batch loop (`forward_backward`); the loop's step clips by the norm
    over all stages. In mixed precision the chunks compute in bf16 and AdamW updates fp32 master
    copies."""

    executor_class = PipelineExecutor

    def __init__(self, run: Run, ctx: DistContext, pp_group: dist.ProcessGroup | None = None,
                 loss: LossFn = loss_fn):
        cfg, self.mixed, options = run.model, run.mixed, run.options
        self.group = pp_group
        p, self.rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        self.schedule: Schedule = make_schedule(options.schedule, p, run.grad_accum, options.v)
        # split the model on the meta device, then draw only this rank's layers onto its device
        meta = build_model(cfg, dtype=run.dtype, device="meta")
        partition = None if options.partition is None else list(options.partition)
        self.chunks = split_model(meta, p, options.v, self.rank, partition, self.schedule.stages(self.rank))
        init = initializer(cfg, run.seed)
        for chunk in self.chunks:
            materialize(chunk, init, ctx.device)
        self.model = nn.ModuleList(self.chunks)
        self.names = [n for chunk in self.chunks for n, _ in chunk.named_parameters()]
        self.weights = MasterWeights(self.model.parameters(), enabled=self.mixed)
        if self.mixed:
            self.model.to(torch.bfloat16)  # in place: the masters keep the fp32 values
        self.optimizer = make_optimizer(self.weights.master, run.optimizer, run.lr)
        self.dtype = run.compute_dtype
        self.activation_shape = (run.micro_batch, run.seq_len, cfg.dim)
        self.executor = self.executor_class(self.schedule, self.rank, self.chunks, loss,
                                            self.activation_shape, self.dtype, ctx.device, pp_group)
        self.name, self.clip_grad = f"pp-{options.schedule}", run.clip_grad
        self.optimizer_name = run.optimizer
        self.device = ctx.device
        self.dp_rank, self.dp_size = 0, 1
        self.timeline_png = options.timeline_png
        self.timelines: list = []

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> torch.Tensor | None:
        inputs, targets = zip(*(split_inputs_targets(t) for t in micro_batches), strict=True)
        positions = [torch.arange(x.shape[1], device=x.device) for x in inputs]  # RoPE's, per micro-batch
        # a common time origin for the timeline (0 bytes; on NCCL the barrier also waits for
        # the GPU, so the executor's step-start event runs at once)
        dist.barrier(group=self.group)
        loss = self.executor.run(inputs, targets, positions)
        self.timelines.append(self.executor.timeline)
        self.weights.grads_to_master()
        return loss  # a 0-dim tensor on the last stage (the loop reads it once), else None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The norm over all stages: each parameter lives on one rank, so every rank counts all it
        holds, summed over the pipeline group."""
        group = self.group if self.group is not None else dist.group.WORLD
        return clip_grads_by_global_norm_([q.grad for q in self.weights.master], max_norm, groups=(group,),
                               device=self.device)

    def _gather(self, tensors: list[torch.Tensor | None]) -> dict[str, torch.Tensor] | None:
        local = {n: t.detach().cpu() for n, t in zip(self.names, tensors, strict=True) if t is not None}
        gathered = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.gather_object(local, gathered, dst=dst, group=self.group)
        return {k: t for part in gathered for k, t in part.items()} if self.rank == 0 else None

    def full_gradients(self) -> dict[str, torch.Tensor] | None:
        return self._gather([q.grad for q in self.weights.master])

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        return self._gather(list(self.weights.master))

    def memory(self) -> dict[str, int]:
        extra = self.weights.master if self.mixed else []
        return {"params": storage_bytes(self.model.parameters()),
                "grads": storage_bytes(q.grad for q in self.weights.master if q.grad is not None),
                "optimizer": storage_bytes([*optimizer_state_tensors(self.optimizer), *extra])}

    def message_bytes(self) -> int:
        return math.prod(self.activation_shape) * self.dtype.itemsize

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        """Per rank per step: one activation [b, T, dim] per forward of a stage < S-1 and one
        gradient of that shape per backward of a stage > 0 (the schedule counts them), plus the
        clipping norm's all-reduce (2(p-1)/p · 8 bytes in float64, 4 else). Memory: this rank's
        P_r parameters · b, grads P_r · b_grad, AdamW m and v (2 · P_r · b_master) and a step
        counter per tensor, plus the fp32 masters (4 P_r) in mixed precision."""
        p = self.schedule.p
        sends = sum(self.schedule.send(self.rank, a) is not None for a in self.schedule.actions[self.rank])
        b, b_master = self.dtype.itemsize, self.weights.master[0].itemsize
        clip = 2 * (p - 1) / p * max(b_master, 4) if self.clip_grad is not None and p > 1 else 0.0
        comm = steps * (sends * self.message_bytes() + clip)
        P = sum(q.numel() for q in self.model.parameters())
        opt = optimizer_state_bytes(self.optimizer_name, P, b_master, len(self.weights.master))
        opt += P * b_master if self.mixed else 0
        return comm, {"params": P * b, "grads": P * b_master, "optimizer": opt}

    def report_extras(self) -> dict:
        """Collective over the pipeline group: every rank's timelines → the measured bubble of each
        step (mean over steps after the first), beside the simulated one and the closed form;
        rank 0 prints the last step's timeline."""
        gathered = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, self.timelines, group=self.group)
        s = self.schedule
        steps = [[i for g in gathered for i in g[k]] for k in range(len(self.timelines))]
        bubbles = [measured_bubble(iv, s.p) for iv in steps]
        measured = sum(bubbles[1:]) / len(bubbles[1:]) if len(bubbles) > 1 else bubbles[0]
        simulated = float(simulated_bubble(simulate(s), s.p))
        formula = float(closed_form_bubble(s.name, s.p, s.m, s.v))
        if self.rank == 0:
            last = steps[-1]
            origin = min(i.start for i in last)
            print(render_text(shift(last, origin), width=100, p=s.p,
                              title=f"{s.name} p={s.p} m={s.m} v={s.v}: measured timeline, last step "
                                    f"({(max(i.end for i in last) - origin) * 1e3:.1f} ms)"))
            print(render_text(simulate(s), width=100, p=s.p, title="ideal (unit costs)"))
            print(f"bubble: measured {measured:.3f} · simulated {simulated:.3f} · formula "
                  f"{bubble_formula(s.name, s.v)} = {formula:.3f}", flush=True)
            if self.timeline_png:
                save_png({f"{s.name} measured": shift(last, origin), f"{s.name} ideal": simulate(s)},
                         self.timeline_png)
        return {"bubble_fraction": measured, "bubble_simulated": simulated, "bubble_formula": formula,
                "bubble_formula_expr": bubble_formula(s.name, s.v), "schedule": s.name,
                "microbatches": s.m, "virtual_stages": s.v,
                "activations_in_flight_peak": peak_in_flight(s, self.rank)}


def build(run: Run, ctx: DistContext) -> Strategy:
    return PipelineStrategy(run, ctx)


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=6)
