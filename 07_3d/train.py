"""Chapter 07 demo: train LLaMA with TP × PP × FSDP on one 3D mesh.

    torchrun --standalone --nproc-per-node 8 07_3d/train.py --dp 2 --pp 2 --tp 2 --schedule 1f1b

Every rank builds the full model on the meta device (no memory), keeps its pipeline stage (06),
cuts that stage's blocks, embedding and head into tensor-parallel pieces over its TP group (05),
optionally wraps blocks for activation recomputation, and shards what is left over its DP group
with FSDP (04): one unit per block, the stage's embedding/head as the root unit. Only then are
values drawn: each parameter overlapping this rank's FSDP shard is generated in full on CPU from
the seed (common.model.initializer), cut to its TP piece, and its shard's slice copied to the
device. A schedule of 06 runs the stages; gradients are clipped by the global norm over all
three dimensions (clip.py), AdamW steps on the FSDP shards, the LR follows warm-up + cosine.
`--check` gathers full gradients and parameters from all three dimensions against the
single-device reference.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from common.cli import (
    DTYPES,
    BatchLayout,
    ConfigError,
    base_parser,
    batch_layout,
    model_config,
    require,
    validate_common,
)
from common.data import split_inputs_targets
from common.dist import DistContext
from common.memory import ActivationMeter, optimizer_state_tensors, storage_bytes
from common.model import TransformerBlock, build_model, initializer, rope_cos_sin
from common.reference import make_optimizer
from common.training import Strategy, run_main
from fsdp import FSDP, MixedPrecision, ModuleWrapPolicy, ShardingStrategy, clean_name
from parallel3d.checkpointing import MODES, CheckpointWrapper, apply_activation_checkpointing, unwrapped_name
from parallel3d.clip import clip_grad_norm_
from parallel3d.comm_formulas import comm_bytes_per_step
from parallel3d.lr_schedule import warmup_cosine_scheduler
from parallel3d.memory_model import layer_activation_bytes
from parallel3d.mesh import MeshError, init_device_mesh, mesh_shape
from parallel3d.trainer_checkpoint import ResumableStrategy, add_checkpoint_flags, validate_checkpoint_flags
from pipeline import PipelineExecutor, make_schedule, partition_error, schedule_error, split_model
from pipeline.simulator import closed_form_bubble
from tensor_parallel import (
    check_tp_sizes,
    gather_full,
    local_piece,
    parallelize_blocks,
    parallelize_embedding,
    parallelize_head,
    tp_shard_specs,
    vocab_parallel_loss,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
ZB_REFUSED: str | None = (  # the tests lift it to check ZB's gradients (exact) and comm (exact)
    "--schedule zb: ZB-H1's gradients under FSDP are exact (W differentiates the gathered flat "
    "tensors autograd saw), but on stages > 0 the split backward keeps every micro-batch's autograd "
    "graph alive after its W, so saved activations grow step after step (see the README's Limits). "
    "Use --schedule 1f1b or interleaved")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=None, help="data-parallel (FSDP) size (default: inferred)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages (default: 2 when the world size is a multiple of 4, else 1)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size, innermost: one node "
                   "(default: 2 when the world size is a multiple of 4, else 1)")
    p.add_argument("--schedule", default="1f1b", help=" | ".join(SCHEDULES))
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="micro-batches per step per pipeline (default: --grad-accum, else 2·pp)")
    p.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="model chunks per pipeline rank (interleaved: default 2, else 1)")
    p.add_argument("--sequence-parallel", action="store_true", help="SP inside the TP regions")
    p.add_argument("--activation-checkpointing", default="none", help=" | ".join(MODES))
    p.add_argument("--sharding-strategy", default="FULL_SHARD",
                   help="FSDP over the DP group: FULL_SHARD (ZeRO-3) | SHARD_GRAD_OP | NO_SHARD")
    p.add_argument("--lr-schedule", default=None, help="cosine (warm-up + cosine) | constant "
                   "(default: cosine, constant under --check: the reference trains at a fixed LR)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor, × --lr")
    add_checkpoint_flags(p)
    args = p.parse_args(argv)
    if args.lr_schedule is None:
        args.lr_schedule = "constant" if args.check else "cosine"
    return args


def virtual_stages(args: argparse.Namespace) -> int:
    v = getattr(args, "virtual_stages", None)
    return v if v is not None else (2 if args.schedule == "interleaved" else 1)


def validate(args: argparse.Namespace, world_size: int) -> BatchLayout:
    """Everything that can be wrong with the input, checked on every rank before any collective."""
    validate_common(args)
    if args.tp is None and args.pp is None and args.dp is None and world_size % 4 == 0:
        args.tp, args.pp = 2, 2  # the demo's default: 8 ranks → dp 2 × pp 2 × tp 2
    args.tp, args.pp = args.tp or 1, args.pp or 1
    try:
        dp, pp, tp = mesh_shape(world_size, args.tp, args.pp, args.dp)
    except MeshError as error:
        raise ConfigError(str(error)) from None
    cfg = model_config(args)
    require(args.schedule in SCHEDULES, f"--schedule {args.schedule!r} is unknown: use one of "
            f"{', '.join(SCHEDULES)}")
    require(args.activation_checkpointing in MODES, f"--activation-checkpointing "
            f"{args.activation_checkpointing!r}: use one of {', '.join(MODES)}")
    require(args.sharding_strategy in ShardingStrategy.__members__, f"--sharding-strategy "
            f"{args.sharding_strategy!r}: use one of {', '.join(ShardingStrategy.__members__)}")
    require(args.lr_schedule in ("cosine", "constant"),
            f"--lr-schedule {args.lr_schedule!r}: use cosine or constant")
    require(not (args.check and args.lr_schedule != "constant"),
            f"--check with --lr-schedule {args.lr_schedule}: the single-device reference trains at "
            "a constant LR; drop --lr-schedule (it defaults to constant under --check)")
    require(args.warmup_steps is None or args.warmup_steps >= 0,
            f"--warmup-steps {args.warmup_steps}: must be >= 0")
    require(0 <= args.min_lr_ratio <= 1, f"--min-lr-ratio {args.min_lr_ratio}: must be in [0, 1]")
    try:
        check_tp_sizes(tp, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim, args.seq_len,
                       args.sequence_parallel)
    except ValueError as error:
        raise ConfigError(f"--tp {tp}: {error}") from None
    m = args.microbatches or args.grad_accum
    if m is None and args.micro_batch is None:  # default: 2·pp micro-batches (1 without a pipeline)
        m, per_rank = (2 * pp if pp > 1 else 1), args.global_batch // dp
        require(args.global_batch % dp or per_rank % m == 0,
                f"--global-batch {args.global_batch} gives {per_rank} sequences per data-parallel "
                f"rank (dp {dp}), not divisible into the default 2·pp = {m} micro-batches: pass "
                f"--microbatches (a divisor of {per_rank}) or a --global-batch multiple of {dp * m}")
    layout = batch_layout(args.global_batch, dp, args.micro_batch, m)
    require(args.microbatches in (None, layout.grad_accum),
            f"--microbatches {args.microbatches} != {layout.grad_accum} micro-batches of "
            f"--micro-batch {args.micro_batch} per data-parallel rank: drop one of the flags")
    v = virtual_stages(args)
    require((error := schedule_error(args.schedule, pp, layout.grad_accum, v)) is None,
            f"{error} (on a mesh dp {dp} × pp {pp} × tp {tp})")
    require((error := partition_error(cfg.n_layers, pp, v)) is None, str(error))
    require(args.schedule != "zb" or ZB_REFUSED is None, str(ZB_REFUSED))
    require(args.schedule != "zb" or args.activation_checkpointing == "none",
            f"--schedule zb with --activation-checkpointing {args.activation_checkpointing}: not "
            "supported (the tensors recomputed in B would have to outlive B until W; untested); use "
            "--activation-checkpointing none, or --schedule 1f1b")
    args.resume_from = validate_checkpoint_flags(args, cfg)  # reads metadata only: no collective
    return layout


def sequence_rope(cfg, tp: int, positions: torch.Tensor, dtype: torch.dtype):
    """RoPE's cos/sin for a stage whose activations carry s/tp tokens under sequence parallelism:
    the attention sees the all-gathered sequence, so the tables cover all s positions."""
    return rope_cos_sin(cfg, torch.arange(positions.numel() * tp, device=positions.device), dtype)


class StageActivationMeter(ActivationMeter):
    """Saved activations, not counting the gathered weights autograd saves (the FSDP units'
    flat `full` tensors are parameters, counted by the ledger as such)."""

    def __init__(self, handles):
        super().__init__([h.flat_param for h in handles])
        self.handles = handles

    def _add(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if any(h.full.untyped_storage().data_ptr() == ptr for h in self.handles):
            return None
        return super()._add(t)


class Parallel3DStrategy(ResumableStrategy, Strategy):
    """This rank's pipeline chunks, TP-split, FSDP-sharded over its DP group, run by a schedule."""

    def __init__(self, args: argparse.Namespace, ctx: DistContext, layout: BatchLayout):
        cfg, self.mixed = model_config(args), args.mixed_precision == "bf16"
        self.cfg, self.args, self.layout = cfg, args, layout
        self.mesh3d = mesh = init_device_mesh(args.tp, args.pp, args.dp)
        tp_group, self.sp = mesh.tp_group, args.sequence_parallel
        master_dtype = torch.float32 if self.mixed else DTYPES[args.dtype]
        self.compute_dtype = torch.bfloat16 if self.mixed else master_dtype
        m, v = layout.grad_accum, virtual_stages(args)
        self.schedule = make_schedule(args.schedule, mesh.pp, m, v)
        # all on the meta device until FSDP draws the parameters overlapping this rank's shards
        chunks = split_model(build_model(cfg, dtype=master_dtype, device="meta"), mesh.pp, v,
                             mesh.pp_rank, rope=partial(sequence_rope, cfg, mesh.tp if self.sp else 1))
        self.tp_specs, self.head = {}, None
        for chunk in chunks:  # TP first, then recomputation, then FSDP (torchtitan's order)
            if chunk.tok_embeddings is not None:
                chunk.tok_embeddings = parallelize_embedding(chunk.tok_embeddings, tp_group, self.sp)
            parallelize_blocks(chunk.layers.values(), tp_group, self.sp)
            if chunk.output is not None:
                chunk.norm, chunk.output = parallelize_head(chunk.norm, chunk.output, tp_group, self.sp)
                self.head = chunk.output
            self.tp_specs.update(tp_shard_specs(chunk, tp_group))
            apply_activation_checkpointing(chunk.layers, args.activation_checkpointing)
        unit = CheckpointWrapper if args.activation_checkpointing == "full" else TransformerBlock
        mp = MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16) if self.mixed else None
        self.sharding = ShardingStrategy[args.sharding_strategy]
        init = initializer(cfg, args.seed)

        def tp_piece(name: str, _) -> torch.Tensor:  # the full tensor's TP piece; FSDP keeps its 1/dp
            name = unwrapped_name(name)
            return local_piece(init(name), self.tp_specs[name])

        self.chunks = [FSDP(c, process_group=mesh.dp_group, sharding_strategy=self.sharding,
                            auto_wrap_policy=ModuleWrapPolicy({unit}), mixed_precision=mp,
                            device_id=ctx.device, param_init_fn=tp_piece)
                       for c in chunks]
        self.model = nn.ModuleList(self.chunks)
        self.optimizer = make_optimizer(self.model.parameters(), args.optimizer, args.lr)
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
        self.scheduler = (warmup_cosine_scheduler(self.optimizer, args.steps, warmup, args.min_lr_ratio)
                          if args.lr_schedule == "cosine" else None)
        seq = args.seq_len // mesh.tp if self.sp else args.seq_len
        self.activation_shape = (layout.micro_batch, seq, cfg.dim)
        self.executor = PipelineExecutor(self.schedule, mesh.pp_rank, self.chunks, self.loss,
                                         self.activation_shape, self.compute_dtype, ctx.device,
                                         mesh.pp_group)
        self.name = f"3d-{args.schedule}"
        self.mesh, self.dp_rank, self.dp_size = mesh.as_dict(), mesh.dp_rank, mesh.dp
        self.clip_grad, self.device = args.clip_grad, ctx.device
        self.counted = self._counted_segments()
        self._busy_s, self._steps = 0.0, 0
        self.resume(getattr(args, "resume_from", None))  # sets start_step (trainer_checkpoint.py)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_loss(self.head, logits, targets)

    # --- the step -------------------------------------------------------------------------------

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> torch.Tensor | None:
        self.restore_rng_once()
        start = time.perf_counter()
        inputs, targets = zip(*(split_inputs_targets(t) for t in micro_batches), strict=True)
        loss = self.executor.run(inputs, targets)
        self._busy_s += self._elapsed(start)
        return loss  # a 0-dim tensor on the last stage (the loop reads it once), else None

    def _elapsed(self, start: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def mfu(self) -> float | None:
        """Model FLOPs utilisation on CUDA: (6N' + 12·L·h·s) per token × tokens/s / (world ·
        bf16 peak), N' = parameters without the embedding (common.gpu_check's convention)."""
        if self.device.type != "cuda" or not self._busy_s:
            return None
        from common.gpu_check import flops_per_token, peak_tflops

        peak = peak_tflops(torch.cuda.get_device_name(self.device))
        n = sum(p.numel() for p in build_model(self.cfg, device="meta").parameters())
        tokens = self._steps * self.args.global_batch * self.args.seq_len
        world = self.mesh3d.dp * self.mesh3d.pp * self.mesh3d.tp
        flops = flops_per_token(self.cfg, n, self.args.seq_len) * tokens / self._busy_s
        return flops / (world * peak * 1e12) if peak else None

    def handles(self):
        return [h for chunk in self.chunks for h in chunk.handles()]

    def _counted_segments(self) -> list[tuple[int, int, int]]:
        """(handle index, start, end) of the slices of this rank's flat shards that enter the
        global norm: every element of the full model once. FSDP shards are disjoint across DP
        (NO_SHARD: only DP rank 0 counts); a TP-replicated tensor counts on one rank of each
        piece's copies (tp_rank % copies == 0)."""
        out, tp_rank = [], self.mesh3d.tp_rank
        for i, h in enumerate(self.handles()):
            if h.shard_world == 1 and self.mesh3d.dp_rank != 0:
                continue
            unit = next(c for chunk in self.chunks for c in chunk.units() if c._handle is h)
            prefix = f"{unit.unit_name}." if unit.unit_name else ""
            lo, hi, offset = h.shard_rank * h.shard_numel, (h.shard_rank + 1) * h.shard_numel, 0
            for name, n in zip(h.names, h.numels, strict=True):
                spec = self.tp_specs[unwrapped_name(clean_name(prefix + name))]
                a, b = max(lo, offset), min(hi, offset + n)
                if a < b and tp_rank % spec.copies == 0:
                    out.append((i, a - lo, b - lo))
                offset += n
        return out

    def step(self) -> None:
        start = time.perf_counter()
        self._step_impl()
        self._busy_s += self._elapsed(start)
        self._steps += 1

    def _step_impl(self) -> None:
        if self.clip_grad is not None:
            handles = self.handles()
            grads = [h.flat_param.grad for h in handles]
            counted = [grads[i][a:b] for i, a, b in self.counted if grads[i] is not None]
            clip_grad_norm_(grads, counted, self.clip_grad, device=self.device)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    # --- --check: full tensors from all three dimensions -----------------------------------------

    def _gather(self, per_chunk) -> dict[str, torch.Tensor] | None:
        """FSDP gathers over DP (to DP rank 0), TP gathers over the TP group, then the stages are
        collected on global rank 0 over its PP group."""
        local = {}
        for chunk in self.chunks:
            part = per_chunk(chunk)
            if part is not None:
                local.update({unwrapped_name(n): t for n, t in part.items()})
        if self.mesh3d.dp_rank != 0:
            return None
        full = gather_full(local, {n: self.tp_specs[n] for n in local})
        if self.mesh3d.tp_rank != 0:
            return None
        full = {n: t.detach().cpu() for n, t in full.items()}
        parts = [None] * self.mesh3d.pp if self.mesh3d.rank == 0 else None
        dist.gather_object(full, parts, dst=0, group=self.mesh3d.pp_group)
        return {n: t for part in parts for n, t in part.items()} if parts else None

    def full_gradients(self) -> dict[str, torch.Tensor] | None:
        return self._gather(lambda c: c.full_gradients(rank0_only=True))

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        return self._gather(lambda c: c.full_state_dict(rank0_only=True))

    # --- accounting --------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def memory(self) -> dict[str, int]:
        return {"params": storage_bytes(self.model.parameters()),
                "grads": storage_bytes(p.grad for p in self.model.parameters() if p.grad is not None),
                "optimizer": storage_bytes(optimizer_state_tensors(self.optimizer))}

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        """Memory: Σ over this rank's units of ⌈P_u/d⌉ (P_u = the unit's TP-local parameters,
        d = the DP size, 1 under NO_SHARD) params and grads, AdamW's m and v (2×) + a step
        counter per unit; activations: `activation_formula`. Comm: comm_formulas.comm_bytes_per_step."""
        handles = self.handles()
        shard = sum(h.shard_numel for h in handles)
        b = handles[0].flat_param.element_size()
        opt = (2 * shard * b + 4 * len(handles)) if self.args.optimizer == "adamw" else 0
        comm = comm_bytes_per_step(self, steps)
        return comm, {"params": shard * b, "grads": shard * b, "optimizer": opt,
                      "activations_peak": self.activation_formula()}

    def activation_meter(self) -> ActivationMeter:
        return StageActivationMeter(self.handles())

    def chunk_activation_bytes(self, chunk: int) -> float:
        """One micro-batch's saved activations in chunk `chunk` (memory_model's per-block count;
        the first stage adds token ids, the last the final norm, head input and the float32
        softmax over the local vocabulary; each stage its RoPE tables)."""
        cfg, t, sp = self.cfg, self.mesh3d.tp, self.sp
        b, s, e = self.layout.micro_batch, self.args.seq_len, self.compute_dtype.itemsize
        stage = self.schedule.stage(self.mesh3d.pp_rank, chunk)
        blocks = len(self.chunks[chunk].module.layers)
        total = blocks * layer_activation_bytes(cfg, b * s, s, t, sp, self.args.activation_checkpointing, e)
        total += s * cfg.head_dim * e  # cos, sin
        if stage == 0:
            total += b * s * (8 + (1 if t > 1 else 0))  # token ids (+ the out-of-range mask)
        if stage == self.schedule.n_stages - 1:
            local = 1 / t if sp else 1
            rows = -(-cfg.vocab_size // t)
            total += (2 * cfg.dim + 1) * b * s * e * local + b * s * cfg.dim * e
            total += b * s * (rows * max(e, 4) + 8 + (1 if t > 1 else 0))
        return total

    def activation_formula(self) -> float:
        """The peak over the schedule of Σ chunk_activation_bytes over the live (micro-batch,
        chunk) pairs: forwards whose backward has not run yet."""
        live, peak = set(), 0.0
        release = "W" if self.schedule.split_backward else "B"  # ZB-H1: the graph lives until W
        for a in self.schedule.actions[self.mesh3d.pp_rank]:
            if a.kind in ("F", release):
                (live.add if a.kind == "F" else live.discard)((a.microbatch, a.chunk))
            peak = max(peak, sum(self.chunk_activation_bytes(c) for _, c in live))
        return peak

    def report_extras(self) -> dict:
        s = self.schedule
        per_rank = [None] * dist.get_world_size()
        mem = self.memory()  # after zero_grad: the gradients are already freed
        dist.all_gather_object(per_rank, {"rank": self.mesh3d.rank, "dp": self.mesh3d.dp_rank,
                                          "pp": self.mesh3d.pp_rank, "tp": self.mesh3d.tp_rank,
                                          "params": mem["params"], "optimizer": mem["optimizer"]})
        return {"mfu": self.mfu(), "schedule": s.name, "microbatches": s.m, "virtual_stages": s.v,
                "sequence_parallel": self.sp, "sharding_strategy": self.sharding.name,
                "activation_checkpointing": self.args.activation_checkpointing,
                "lr_schedule": self.args.lr_schedule,
                "bubble_formula": float(closed_form_bubble(s.name, s.p, s.m, s.v)),
                "memory_per_rank": per_rank}


def build(args: argparse.Namespace, ctx: DistContext, layout: BatchLayout) -> Strategy:
    return Parallel3DStrategy(args, ctx, layout)


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=7)
