"""Chapter 07 demo: train LLaMA with TP × PP × FSDP (× CP) on one mesh.

    torchrun --standalone --nproc-per-node 8 07_3d/train.py --dp 2 --pp 2 --tp 2 --schedule 1f1b
    torchrun --standalone --nproc-per-node 8 07_3d/train.py --cp 2 --tp 2 --pp 2 --sequence-parallel

Every rank builds the full model on the meta device (no memory) and applies the recipe of
parallelize.py: its pipeline stages (06), cut into tensor-parallel pieces (05), blocks wrapped for
recomputation, sharded over its DP × CP group by FSDP (04), the only values ever drawn. A schedule of
06 runs the stages; gradients are clipped by the global norm over the whole mesh
(common/clip.py), AdamW steps on the FSDP shards, the LR follows warm-up + cosine.
With `--cp c` each CP rank of a replica takes its zig-zag chunks (2 of 2·c) of the same rows,
attention passes K/V around the CP ring, and FSDP averages the gradients over dp·c ranks:

    loss_rank = (1/n_local) Σ_local ℓ_i,   n_local = n/(dp·c)   ⇒   mean over dp·c of ∇loss_rank
              = (1/n) Σ_all ∇ℓ_i                                    (the global-token mean)

`--check` gathers full gradients and parameters from the mesh against the single-device reference.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager

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
from common.clip import clip_grad_norm_
from common.data import split_inputs_targets
from common.dist import DistContext
from common.memory import ActivationMeter, optimizer_state_bytes, optimizer_state_tensors, storage_bytes
from common.model import build_model
from common.reference import make_optimizer
from common.training import Strategy, run_main
from fsdp import ShardingStrategy
from parallel3d.checkpoint.trainer import ResumableStrategy, add_checkpoint_flags, validate_checkpoint_flags
from parallel3d.comm_formulas import comm_bytes_per_step, cp_bytes_per_step
from parallel3d.lr_schedule import warmup_cosine_scheduler
from parallel3d.memory_model import head_activation_bytes, layer_activation_bytes
from parallel3d.mesh import MeshError, init_device_mesh, mesh_shape
from parallel3d.parallelize import parallelize_3d
from parallel3d.recompute import MODES, unwrapped_name
from pipeline import PipelineExecutor, make_schedule, partition_error, schedule_error
from pipeline.schedules import SCHEDULES, virtual_stages
from pipeline.simulator import closed_form_bubble
from tensor_parallel import (
    check_cp_sizes,
    check_tp_sizes,
    gather_full,
    load_balance,
    shard_sequence,
    vocab_parallel_loss,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=None, help="data-parallel (FSDP) size (default: inferred)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages (default: 2 when the world size is a multiple of 4, else 1)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size, innermost: one node "
                   "(default: 2 when the world size is a multiple of 4, else 1)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size: each rank holds s/cp "
                   "tokens of a sequence, attention passes K/V around the CP ring (inside DP)")
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


def validate(args: argparse.Namespace, world_size: int) -> BatchLayout:
    """Everything that can be wrong with the input, checked on every rank before any collective."""
    validate_common(args)
    args.cp = 1 if getattr(args, "cp", None) is None else args.cp  # namespaces built without it
    if args.tp is None and args.pp is None and args.dp is None and world_size % (4 * max(args.cp, 1)) == 0:
        args.tp, args.pp = 2, 2  # the demo's default: 8 ranks → dp 2 × pp 2 × tp 2 (--cp 2: dp 1)
    args.tp, args.pp = args.tp or 1, args.pp or 1
    try:
        dp, pp, cp, tp = mesh_shape(world_size, args.tp, args.pp, args.dp, args.cp)
    except MeshError as error:
        raise ConfigError(str(error)) from None
    cfg = model_config(args)
    validate_context_parallel(args, cp)
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
        check_tp_sizes(tp, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim, args.seq_len // cp,
                       args.sequence_parallel)
    except ValueError as error:
        within = f" (the {args.seq_len // cp} tokens of a CP rank: --seq-len {args.seq_len} / --cp {cp})"
        raise ConfigError(f"--tp {tp}: {error}" + (within if cp > 1 else "")) from None
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
    v = virtual_stages(args.schedule, args.virtual_stages)
    require((error := schedule_error(args.schedule, pp, layout.grad_accum, v)) is None,
            f"{error} (on a mesh dp {dp} × pp {pp} × cp {cp} × tp {tp})")
    require((error := partition_error(cfg.n_layers, pp, v)) is None, str(error))
    require(args.schedule != "zb" or args.activation_checkpointing == "none",
            f"--schedule zb with --activation-checkpointing {args.activation_checkpointing}: not "
            "supported (W runs one autograd pass per weight GEMM, and each reruns the recomputed "
            "block's forward: exact gradients for one more forward per weight); use "
            "--activation-checkpointing none, or --schedule 1f1b")
    args.resume_from = validate_checkpoint_flags(args, cfg)  # reads metadata only: no collective
    return layout


def validate_context_parallel(args: argparse.Namespace, cp: int) -> None:
    """--cp: the zig-zag layout cuts each sequence into 2·cp equal chunks."""
    try:
        check_cp_sizes(args.seq_len, cp)
    except ValueError as error:
        raise ConfigError(f"--cp {cp} with --seq-len {args.seq_len}: {error}") from None


class Parallel3DStrategy(ResumableStrategy, Strategy):
    """This rank's pipeline chunks, TP-split, attending over the CP ring, FSDP-sharded over its
    DP × CP group, run by a schedule."""

    def __init__(self, args: argparse.Namespace, ctx: DistContext, layout: BatchLayout):
        cfg, mixed = model_config(args), args.mixed_precision == "bf16"
        self.cfg, self.args, self.layout, self.sp = cfg, args, layout, args.sequence_parallel
        self.mesh3d = mesh = init_device_mesh(args.tp, args.pp, args.dp, cp=args.cp)
        master_dtype = torch.float32 if mixed else DTYPES[args.dtype]
        self.compute_dtype = torch.bfloat16 if mixed else master_dtype
        v = virtual_stages(args.schedule, args.virtual_stages)
        self.schedule = make_schedule(args.schedule, mesh.pp, layout.grad_accum, v)
        meta = build_model(cfg, dtype=master_dtype, device="meta")
        self.chunks, self.tp_specs = parallelize_3d(meta, mesh, args, ctx.device)
        self.head = self.chunks[-1].module.output  # the vocab-parallel head on the last stage, else None
        self.unit_shards = [u for chunk in self.chunks for u in chunk.shard_layout()]  # FSDP's description
        self.sharding = ShardingStrategy[args.sharding_strategy]
        self.model = nn.ModuleList(self.chunks)
        self.optimizer = make_optimizer(self.model.parameters(), args.optimizer, args.lr)
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
        self.scheduler = (warmup_cosine_scheduler(self.optimizer, args.steps, warmup, args.min_lr_ratio)
                          if args.lr_schedule == "cosine" else None)
        seq = args.seq_len // mesh.cp // (mesh.tp if self.sp else 1)
        self.activation_shape = (layout.micro_batch, seq, cfg.dim)
        self.executor = PipelineExecutor(self.schedule, mesh.pp_rank, self.chunks, self.loss,
                                         self.activation_shape, self.compute_dtype, ctx.device,
                                         mesh.pp_group)
        self.name = f"3d-{args.schedule}"
        self.mesh, self.dp_rank, self.dp_size = mesh.as_dict(), mesh.dp_rank, mesh.dp
        self.clip_grad, self.device = args.clip_grad, ctx.device
        self.counted = self._counted_segments()
        self._busy_s, self._steps = 0.0, 0
        self._cp_sent = [0.0]  # bytes this rank sent on the CP ring (counting_sends)
        self.resume(getattr(args, "resume_from", None))  # sets start_step (checkpoint/trainer.py)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_loss(self.head, logits, targets)

    # --- the step -------------------------------------------------------------------------------

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> torch.Tensor | None:
        self.restore_rng_once()
        start = time.perf_counter()
        inputs, targets = zip(*(self.context_shard(t) for t in micro_batches), strict=True)
        with counting_sends(self.mesh3d.cp_group if self.mesh3d.cp > 1 else None, self._cp_sent):
            loss = self.executor.run(inputs, targets)
        self._busy_s += self._elapsed(start)
        return loss  # a 0-dim tensor on the last stage (the loop reads it once), else None

    def context_shard(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of a micro-batch [mb, s + 1]; under CP this rank's zig-zag chunks of
        both (the same positions: the target of token i stays beside it)."""
        inputs, targets = split_inputs_targets(tokens)
        cp, rank = self.mesh3d.cp, self.mesh3d.cp_rank
        if cp == 1:
            return inputs, targets
        return shard_sequence(inputs, cp, rank, dim=1), shard_sequence(targets, cp, rank, dim=1)

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
        world = self.mesh3d.size
        flops = flops_per_token(self.cfg, n, self.args.seq_len) * tokens / self._busy_s
        return flops / (world * peak * 1e12) if peak else None

    def _counted_segments(self) -> list[tuple[int, int, int]]:
        """(unit index, start, end) of the slices of this rank's flat shards that enter the
        global norm: every element of the full model once. FSDP shards are disjoint across DP × CP
        (NO_SHARD: only the group's rank 0, DP and CP rank 0, counts); a TP-replicated tensor
        counts on one rank of each piece's copies (tp_rank % copies == 0)."""
        out = []
        replica = self.mesh3d.dp_rank != 0 or self.mesh3d.cp_rank != 0
        for i, unit in enumerate(self.unit_shards):
            if unit.shard_world == 1 and replica:
                continue
            for p in unit.params:
                if p.numel and self.mesh3d.tp_rank % self.tp_specs[unwrapped_name(p.name)].copies == 0:
                    out.append((i, p.shard_offset, p.shard_offset + p.numel))
        return out

    def step(self) -> None:
        start = time.perf_counter()
        self._step_impl()
        self._busy_s += self._elapsed(start)
        self._steps += 1

    def _step_impl(self) -> None:
        if self.clip_grad is not None:
            grads = [u.flat_param.grad for u in self.unit_shards]
            counted = [grads[i][a:b] for i, a, b in self.counted if grads[i] is not None]
            clip_grad_norm_(grads, self.clip_grad, counted, groups=(dist.group.WORLD,), device=self.device)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    # --- --check: full tensors from every dimension ----------------------------------------------

    def _gather(self, per_chunk) -> dict[str, torch.Tensor] | None:
        """FSDP gathers over DP × CP (to its rank 0: DP and CP rank 0), TP gathers over the TP
        group, then the stages are collected on global rank 0 over its PP group."""
        local = {}
        for chunk in self.chunks:
            part = per_chunk(chunk)
            if part is not None:
                local.update({unwrapped_name(n): t for n, t in part.items()})
        if self.mesh3d.dp_rank != 0 or self.mesh3d.cp_rank != 0:
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
        d = dp·cp, the FSDP group, 1 under NO_SHARD) params and grads, AdamW's m and v (2×) + a step
        counter per unit; activations: `activation_formula`. Comm: comm_formulas.comm_bytes_per_step."""
        shard = sum(u.shard_numel for u in self.unit_shards)
        b = self.unit_shards[0].flat_param.element_size()
        opt = optimizer_state_bytes(self.args.optimizer, shard, b, len(self.unit_shards))
        comm = comm_bytes_per_step(self, steps)
        return comm, {"params": shard * b, "grads": shard * b, "optimizer": opt,
                      "activations_peak": self.activation_formula()}

    def activation_meter(self) -> ActivationMeter:
        units = self.unit_shards  # the gathered weights autograd saves are parameters, not activations
        return ActivationMeter([u.flat_param for u in units], gathered=lambda: [u.full for u in units])

    def chunk_activation_bytes(self, chunk: int) -> float:
        """One micro-batch's saved activations in chunk `chunk` (memory_model's per-block and head
        counts, chapter 05's terms, on the s/cp tokens of this CP rank; the first stage adds token
        ids, each stage its RoPE tables)."""
        cfg, t, sp, cp = self.cfg, self.mesh3d.tp, self.sp, self.mesh3d.cp
        b, seq, e = self.layout.micro_batch, self.args.seq_len, self.compute_dtype.itemsize
        s = seq // cp
        stage = self.schedule.stage(self.mesh3d.pp_rank, chunk)
        blocks = len(self.chunks[chunk].module.layers)
        total = blocks * layer_activation_bytes(cfg, b * s, seq, t, sp, self.args.activation_checkpointing,
                                                e, cp=cp)
        total += s * cfg.head_dim * e  # cos, sin
        if stage == 0:
            total += b * s * (8 + (1 if t > 1 else 0))  # token ids (+ the out-of-range mask)
        if stage == self.schedule.n_stages - 1:
            total += head_activation_bytes(cfg, b * s, seq, t, sp, e, cp=cp)
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
                                          "pp": self.mesh3d.pp_rank, "cp": self.mesh3d.cp_rank,
                                          "tp": self.mesh3d.tp_rank,
                                          "params": mem["params"], "optimizer": mem["optimizer"]})
        cp = {} if self.mesh3d.cp == 1 else {
            "cp_comm_bytes": self._cp_sent[0], "cp_comm_bytes_formula": cp_bytes_per_step(self, self._steps),
            "cp_load_balance": load_balance(self.args.seq_len, self.mesh3d.cp)}
        return {**cp, "mfu": self.mfu(), "schedule": s.name, "microbatches": s.m, "virtual_stages": s.v,
                "sequence_parallel": self.sp, "sharding_strategy": self.sharding.name,
                "activation_checkpointing": self.args.activation_checkpointing,
                "lr_schedule": self.args.lr_schedule,
                "bubble_formula": float(closed_form_bubble(s.name, s.p, s.m, s.v)),
                "memory_per_rank": per_rank}


@contextmanager
def counting_sends(group, sent: list[float]) -> Iterator[None]:
    """Add to sent[0] the bytes of every isend that `dist.batch_isend_irecv` posts on `group`
    while inside (the CP ring's, apart from the pipeline's on its own group); None: nothing."""
    if group is None:
        yield
        return
    post = dist.batch_isend_irecv

    def counted(ops):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                       if op.group is group and getattr(op.op, "__name__", "") == "isend")
        return post(ops)

    dist.batch_isend_irecv = counted
    try:
        yield
    finally:
        dist.batch_isend_irecv = post


def build(args: argparse.Namespace, ctx: DistContext, layout: BatchLayout) -> Strategy:
    return Parallel3DStrategy(args, ctx, layout)


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=7)
