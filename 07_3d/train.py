"""Chapter 07 demo: train LLaMA with TP × PP × FSDP (× CP) on one mesh.

    torchrun --standalone --nproc-per-node 8 07_3d/train.py --dp 2 --pp 2 --tp 2 --schedule 1f1b
    torchrun --standalone --nproc-per-node 8 07_3d/train.py --cp 2 --tp 2 --pp 2 --sequence-parallel
    torchrun --standalone --nproc-per-node 8 07_3d/train.py --model tiny-moe --ep 2 --tp 2 --pp 2
    torchrun --standalone --nproc-per-node 8 07_3d/train.py --dp-replicate 2 --dp-shard 2 --tp 2

`validate` turns the flags into the frozen run (common/run.py: every default resolved, the mesh
among them; its options are Train3DOptions), and `build` makes the strategy from it. Build: every
rank builds the full model on the meta device (no memory) and applies the recipe of
parallelize.py: its pipeline stages (06), cut into tensor-parallel pieces (05), blocks wrapped for
recomputation, sharded over its DP × CP group by FSDP (04), the only values ever drawn. Step: a
schedule of 06 runs the stages; gradients are clipped by the global norm over the whole mesh
(clip.py), AdamW steps on the FSDP shards, the LR follows warm-up + cosine. Check: full tensors
assembled from what each rank holds (shards.py).
With `--cp c` each CP rank of a replica takes its zig-zag chunks (2 of 2·c) of the same rows,
attention passes K/V around the CP ring, and FSDP averages the gradients over dp·c ranks:

    loss_rank = (1/n_local) Σ_local ℓ_i,   n_local = n/(dp·c)   ⇒   mean over dp·c of ∇loss_rank
              = (1/n) Σ_all ∇ℓ_i                                    (the global-token mean)

`--check` gathers full gradients and parameters from the mesh against the single-device reference.
HSDP (`--dp-replicate R`, HYBRID_SHARD): FSDP shards over dp_shard × cp, all-reduces each shard
over the R replicas. A MoE model (`--ep N`): the recipe's EP step, each MoE layer's experts split
over EP groups of N consecutive data-parallel ranks and cut over TP (experts_and_hybrid.md). The
checkpoint flags: train_checkpoint_flags.py.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from common.cli import (
    BatchLayout,
    ConfigError,
    base_parser,
    batch_layout,
    model_config,
    require,
    validate_common,
)
from common.dist import DistContext
from common.kernel.mesh import MeshError, MeshShape, build_mesh, mesh_shape
from common.kernel.model import LlamaConfig, build_model
from common.kernel.moe import update_bias_after_each_step
from common.kernel.patch import patch_dist
from common.memory import ActivationMeter
from common.reference import make_optimizer
from common.run import Run, resolve_run
from common.training import Strategy, run_main
from parallel3d.accounting import describe_rank, memory_formula, memory_per_rank, schedule_extras
from parallel3d.checkpoint.trainer import Checkpointing, CheckpointPlan, TrainerState
from parallel3d.clip import clip_grad_norm_3d
from parallel3d.comm_formulas import comm_bytes_by_dim, cp_bytes_per_step, formulas_by_group, group_labels
from parallel3d.experts import all_to_all_formula, dispatch_logs, expert_slices, load_imbalance
from parallel3d.lr_schedule import warmup_cosine_scheduler
from parallel3d.parallelize import (
    HYBRID,
    STRATEGIES,
    Parallel3DConfig,
    activation_shape,
    parallelize_3d,
    rank_inputs,
)
from parallel3d.recompute import MODES
from parallel3d.shards import gather_full, shard_map
from parallel3d.train_checkpoint_flags import add_checkpoint_flags, validate_checkpoint_flags
from pipeline import PipelineExecutor, make_schedule, partition_error, schedule_error
from pipeline.schedules import SCHEDULES, virtual_stages
from tensor_parallel import check_cp_sizes, check_tp_sizes, vocab_parallel_loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=None, help="data-parallel (FSDP) size (default: inferred)")
    p.add_argument("--dp-replicate", type=int, default=None, metavar="R", help="HSDP: the replicas of "
                   "FSDP's shards (e.g. nodes), each shard all-reduced over them; dp = R × dp_shard")
    p.add_argument("--dp-shard", type=int, default=None, metavar="S",
                   help="the ranks FSDP shards over in each replica (default: dp / R)")
    p.add_argument("--ep", type=int, default=1, help="MoE models: expert-parallel size, borrowed from "
                   "dp_shard: EP groups of ep consecutive data-parallel ranks, each with E/ep experts")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages (default: 2 when the world size is a multiple of 4, else 1)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size, innermost: one node "
                   "(default: 2 when the world size is a multiple of 4, else 1)")
    p.add_argument("--bias-update-rate", type=float, default=None, metavar="GAMMA", help="MoE "
                   "models: DeepSeek-V3's router bias moves by GAMMA a step (default: the model's)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size: each rank holds s/cp "
                   "tokens of a sequence, attention passes K/V around the CP ring (inside DP)")
    p.add_argument("--schedule", default="1f1b", help=" | ".join(SCHEDULES))
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="micro-batches per step per pipeline (default: --grad-accum, else 2·pp)")
    p.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="model chunks per pipeline rank (interleaved: default 2, else 1)")
    p.add_argument("--sequence-parallel", action="store_true", help="SP inside the TP regions")
    p.add_argument("--activation-checkpointing", default="none", help=" | ".join(MODES))
    p.add_argument("--sharding-strategy", default=None,
                   help="FSDP over the DP group: FULL_SHARD (ZeRO-3, the default) | SHARD_GRAD_OP | NO_SHARD "
                        "| HYBRID_SHARD (HSDP, the default with --dp-replicate) | _HYBRID_SHARD_ZERO2")
    p.add_argument("--lr-schedule", default=None, help="cosine (warm-up + cosine) | constant "
                   "(default: cosine, constant under --check: the reference trains at a fixed LR)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor, × --lr")
    add_checkpoint_flags(p)
    return p.parse_args(argv)


@dataclass(frozen=True)
class Train3DOptions:
    """The chapter's resolved flags (the run's `options`; the mesh, the batch layout with the
    schedule's m = grad_accum, the dtypes are the run's): the recipe's choices, the LR schedule
    and the checkpoints."""

    parallel: Parallel3DConfig
    lr_schedule: str  # cosine | constant
    warmup_steps: int
    min_lr_ratio: float
    checkpoint: CheckpointPlan


def validate(args: argparse.Namespace, world_size: int) -> Run:
    """Everything that can be wrong with the input, checked on every rank before any collective;
    returns the run."""
    validate_common(args)
    cp = 1 if getattr(args, "cp", None) is None else args.cp  # namespaces built without it
    replicate, shard = getattr(args, "dp_replicate", None), getattr(args, "dp_shard", None)
    tp, pp, ep, cfg = args.tp, args.pp, getattr(args, "ep", 1), model_config(args)
    if (rate := getattr(args, "bias_update_rate", None)) is not None:
        require(rate >= 0 and (cfg.n_experts or not rate), f"--bias-update-rate {rate} with --model "
                f"{args.model}: use >= 0, and a mixture-of-experts model (e.g. --model tiny-moe)")
        cfg = replace(cfg, bias_update_rate=rate)
    require(not (args.check and cfg.bias_update_rate), f"--bias-update-rate {cfg.bias_update_rate} "
            "with --check: the single-device reference does not update the router's bias")
    given = (args.dp, replicate, shard)
    if tp is None and pp is None and given == (None,) * 3 and world_size % (4 * max(cp, 1)) == 0:
        tp, pp = 2, 2  # the demo's default: 8 ranks → dp 2 × pp 2 × tp 2 (--cp 2: dp 1)
    require(ep == 1 or cfg.n_experts, f"--ep {ep} with --model {args.model}: the model has no experts: "
            "drop --ep, or use a mixture-of-experts model (e.g. --model tiny-moe)")
    require(not cfg.n_experts or cp == 1, f"--cp {cp} with --model {args.model}, a mixture-of-experts "
            "model: routing, capacity and the per-sequence aux loss need whole sequences; use --cp 1")
    try:
        mesh = mesh_shape(world_size, tp or 1, pp or 1, args.dp, cp, dp_replicate=replicate,
                          dp_shard=shard, ep=ep, n_experts=cfg.n_experts or None)
    except MeshError as error:
        raise ConfigError(str(error)) from None
    dp, pp, cp, tp = mesh.dp, mesh.pp, mesh.cp, mesh.tp
    validate_context_parallel(args, cp)
    require(args.activation_checkpointing in MODES, f"--activation-checkpointing "
            f"{args.activation_checkpointing!r}: use one of {', '.join(MODES)}")
    sharding = validate_sharding(args.sharding_strategy, mesh)
    lr_schedule = args.lr_schedule or ("constant" if args.check else "cosine")
    require(lr_schedule in ("cosine", "constant"), f"--lr-schedule {lr_schedule!r}: use cosine or constant")
    require(not (args.check and lr_schedule != "constant"),
            f"--check with --lr-schedule {lr_schedule}: the single-device reference trains at "
            "a constant LR; drop --lr-schedule (it defaults to constant under --check)")
    require(args.warmup_steps is None or args.warmup_steps >= 0,
            f"--warmup-steps {args.warmup_steps}: must be >= 0")
    require(0 <= args.min_lr_ratio <= 1, f"--min-lr-ratio {args.min_lr_ratio}: must be in [0, 1]")
    try:
        check_tp_sizes(tp, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim, args.seq_len // cp,
                       args.sequence_parallel, cfg.expert_hidden_dim if cfg.n_experts else 0)
    except ValueError as error:
        within = f" (the {args.seq_len // cp} tokens of a CP rank: --seq-len {args.seq_len} / --cp {cp})"
        raise ConfigError(f"--tp {tp}: {error}" + (within if cp > 1 else "")) from None
    layout = validate_batch(args, dp, pp)
    v = virtual_stages(args.schedule, args.virtual_stages)
    require((error := schedule_error(args.schedule, pp, layout.grad_accum, v)) is None,
            f"{error} (on a mesh dp {dp} × pp {pp} × cp {cp} × tp {tp})")
    require((error := partition_error(cfg.n_layers, pp, v)) is None, str(error))
    require(not SCHEDULES[args.schedule].split_backward or args.activation_checkpointing == "none",
            f"--schedule {args.schedule} with --activation-checkpointing {args.activation_checkpointing}: "
            "not supported (its W runs one autograd pass per weight GEMM, and each reruns the "
            "recomputed block's forward: exact gradients for one more forward per weight); use "
            "--activation-checkpointing none, or --schedule 1f1b")
    checkpoint = validate_checkpoint_flags(args, cfg)  # reads metadata only: no collective
    parallel = Parallel3DConfig(args.schedule, v, args.sequence_parallel, args.activation_checkpointing,
                                sharding, args.mixed_precision, args.seed)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 10)
    return resolve_run(args, mesh, layout, Train3DOptions(parallel, lr_schedule, warmup, args.min_lr_ratio,
                                                          checkpoint), model=cfg)


def validate_batch(args: argparse.Namespace, dp: int, pp: int) -> BatchLayout:
    """--global-batch over dp ranks, in micro-batches: --microbatches, --grad-accum or
    --micro-batch, else 2·pp micro-batches (1 without a pipeline)."""
    m = args.microbatches or args.grad_accum
    if m is None and args.micro_batch is None:
        m, per_rank = (2 * pp if pp > 1 else 1), args.global_batch // dp
        require(args.global_batch % dp or per_rank % m == 0,
                f"--global-batch {args.global_batch} gives {per_rank} sequences per data-parallel "
                f"rank (dp {dp}), not divisible into the default 2·pp = {m} micro-batches: pass "
                f"--microbatches (a divisor of {per_rank}) or a --global-batch multiple of {dp * m}")
    layout = batch_layout(args.global_batch, dp, args.micro_batch, m)
    require(args.microbatches in (None, layout.grad_accum),
            f"--microbatches {args.microbatches} != {layout.grad_accum} micro-batches of "
            f"--micro-batch {args.micro_batch} per data-parallel rank: drop one of the flags")
    return layout


def validate_sharding(strategy: str | None, mesh: MeshShape) -> str:
    """--sharding-strategy (default: HYBRID_SHARD with --dp-replicate R > 1, else FULL_SHARD):
    HSDP's strategies exactly when there are replicas."""
    hsdp = mesh.dp_replicate > 1
    strategy = strategy or ("HYBRID_SHARD" if hsdp else "FULL_SHARD")
    require(strategy in STRATEGIES, f"--sharding-strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    require(not hsdp or strategy in HYBRID,
            f"--dp-replicate {mesh.dp_replicate} with --sharding-strategy {strategy}: {strategy} "
            f"shards over all dp ranks; HSDP is --sharding-strategy {' or '.join(HYBRID)} (the "
            "default with --dp-replicate), or drop --dp-replicate")
    require(hsdp or strategy not in HYBRID,
            f"--sharding-strategy {strategy} (HSDP) needs --dp-replicate R > 1, the replicas its "
            f"shards are all-reduced over (dp {mesh.dp} = R × --dp-shard S), e.g. --dp-replicate 2")
    return strategy


def validate_context_parallel(args: argparse.Namespace, cp: int) -> None:
    """--cp: the zig-zag layout cuts each sequence into 2·cp equal chunks (without CP, any length)."""
    try:
        if cp > 1:
            check_cp_sizes(args.seq_len, cp)
    except ValueError as error:
        raise ConfigError(f"--cp {cp} with --seq-len {args.seq_len}: {error}") from None


# the mesh's lines the trainer uses: TP, CP, PP; FSDP's (dp_shard_cp, HSDP's dp_replicate), the
# experts' (ep, dp_shard_mod_ep); dp and dp_cp for the data and the lab's recipe
DIMS = ("tp", "cp", "ep", "dp_shard_cp", "dp_replicate", "dp", "dp_cp", "dp_shard_mod_ep", "pp")


class Parallel3DStrategy(Strategy):
    """Build: this rank's pipeline chunks, TP-split, attending over the CP ring, FSDP-sharded over
    its DP × CP group (parallelize_3d), run by a schedule. Step: the schedule, clipping, AdamW.
    Check: full tensors from the ShardMap. The formulas are accounting.py's."""

    def __init__(self, run: Run, ctx: DistContext):
        options, parallel = run.options, run.options.parallel
        self.run, self.device, self.clip_grad = run, ctx.device, run.clip_grad
        self.device_mesh = mesh = build_mesh(run.mesh, DIMS)
        meta = build_model(run.model, dtype=run.dtype, device="meta")
        moe = run.model.n_experts > 0
        self.chunks, tp_specs = parallelize_3d(meta, mesh, parallel, ctx.device)  # MoE: + EP before FSDP
        slices = expert_slices(tp_specs, mesh, run.model.n_experts) if moe else None
        self.shards = shard_map(self.chunks, tp_specs, mesh, slices)  # which reference elements it holds
        # the report's bytes over each line of more than one rank, beside their formulas
        self.comm_groups = tuple((label, mesh.group(g)) for label, g in group_labels(mesh.ranks, moe).items())
        self.group_formulas: dict[str, float] = {}
        self.ep_steps: list[list[tuple[int, int, int]]] = []  # each step's dispatches (A, B, rows)
        self.model = nn.ModuleList(self.chunks)
        self.optimizer = make_optimizer(self.model.parameters(), run.optimizer, run.lr)
        update_bias_after_each_step(self.optimizer, self.model, mesh.dp_group)  # MoE, γ > 0 (cp = 1)
        self.scheduler = (warmup_cosine_scheduler(self.optimizer, run.steps, options.warmup_steps,
                                                  options.min_lr_ratio)
                          if options.lr_schedule == "cosine" else None)
        self.schedule = make_schedule(parallel.schedule, mesh.pp, run.grad_accum, parallel.v)
        self.head = self.chunks[-1].module.output  # the vocab-parallel head on the last stage, else None
        shape = activation_shape(run.model, mesh, parallel, run.micro_batch, run.seq_len)
        self.executor = PipelineExecutor(self.schedule, mesh.pp_rank, self.chunks, self.loss, shape,
                                         run.compute_dtype, ctx.device, mesh.pp_group)
        self.name = f"3d-{parallel.schedule}"
        self.dp_rank, self.dp_size = mesh.dp_rank, mesh.dp
        self.rank3d = describe_rank(run.model, mesh, self.schedule, self.chunks, parallel, run.micro_batch,
                                    run.seq_len, run.compute_dtype, run.clip_grad is not None, run.optimizer)
        self.busy_s, self.steps_done, self.cp_sent = 0.0, 0, [0.0]  # cp_sent: counting_sends
        state = TrainerState(self.shards, self.optimizer, self.scheduler, ctx.device,
                             {"mesh": run.mesh.as_dict(), "dtype": run.dtype_name,
                              "mixed_precision": run.mixed_precision}, self.chunks)
        self.checkpoints = Checkpointing(state, options.checkpoint, run.steps, mesh.rank, mesh.size)
        self.start_step = self.checkpoints.resume()

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_loss(self.head, logits, targets)

    # --- the step -------------------------------------------------------------------------------

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> torch.Tensor | None:
        self.checkpoints.restore_rng_once()
        start = time.perf_counter()
        inputs, targets, positions = zip(*(rank_inputs(t, self.device_mesh) for t in micro_batches),
                                         strict=True)
        ring = self.device_mesh.cp_group if self.device_mesh.cp > 1 else None
        with counting_sends(ring, self.cp_sent):
            loss = self.executor.run(inputs, targets, positions)
        self.busy_s += self.elapsed(start)
        return loss  # a 0-dim tensor on the last stage (the loop reads it once), else None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global norm over the whole mesh, each reference element counted once (clip.py)."""
        return clip_grad_norm_3d(self.shards, max_norm)

    def step(self) -> None:
        """The shared step (clip, optimizer), then the LR schedule; timed for the MFU."""
        start = time.perf_counter()
        super().step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.busy_s += self.elapsed(start)
        self.steps_done += 1

    def elapsed(self, start: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def after_step(self, done: int) -> None:
        self.ep_steps.append(dispatch_logs(self.model))
        self.checkpoints.after_step(done)

    # --- --check: every element once, from the rank that counts it -------------------------------

    def full_gradients(self) -> dict[str, torch.Tensor] | None:
        return gather_full(self.shards, lambda u: u.flat_param.grad)

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        return gather_full(self.shards, lambda u: u.flat_param)

    # --- what the loop measures against accounting.py's closed forms ---------------------------

    def activation_meter(self) -> ActivationMeter:
        units = self.shards.units  # the gathered weights autograd saves are parameters, not activations
        return ActivationMeter([u.flat_param for u in units], gathered=lambda: [u.full for u in units])

    def all_to_all_formula(self) -> float:
        cfg, par = self.run.model, self.run.options.parallel
        return all_to_all_formula(self.ep_steps, cfg.dim, self.rank3d.elem, self.device_mesh.ep,
                                  cfg.n_experts, par.activation_checkpointing == "full")

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        by_dim = {**comm_bytes_by_dim(self.rank3d, steps), "ep": self.all_to_all_formula()}
        self.group_formulas = formulas_by_group(by_dim, self.device_mesh.ranks, self.device_mesh.size,
                                                self.run.model.n_experts > 0)
        return sum(by_dim.values()), memory_formula(self.rank3d)

    def report_extras(self) -> dict:
        mesh = self.device_mesh
        extras = {f"comm_bytes_{label}_formula": v for label, v in self.group_formulas.items()}
        if mesh.cp > 1:
            extras |= {"cp_comm_bytes": self.cp_sent[0],
                       "cp_comm_bytes_formula": cp_bytes_per_step(self.rank3d, self.steps_done)}
        if mesh.ep > 1:  # the meter's all_to_all_single bytes against the routing counts
            imbalance, rows = load_imbalance(self.ep_steps, mesh, self.device)
            extras |= {"ep_all_to_all_bytes_formula": self.all_to_all_formula(), "ep_rows_per_dispatch": rows,
                       "ep_load_imbalance": imbalance, "ep_load_imbalance_max": max(imbalance)}
        tokens = self.steps_done * self.run.global_batch * self.run.seq_len
        return {**extras, **schedule_extras(self.rank3d), "lr_schedule": self.run.options.lr_schedule,
                "mfu": mfu(self.run.model, self.run.seq_len, tokens, self.busy_s,
                           self.device_mesh.size, self.device),
                "memory_per_rank": memory_per_rank(self.device_mesh, self.memory())}  # grads freed


def mfu(cfg: LlamaConfig, seq_len: int, tokens: int, seconds: float, world: int,
        device: torch.device) -> float | None:
    """Model FLOPs utilisation on CUDA: (6N' + 12·L·h·s) per token × tokens/s / (world · bf16
    peak), N' = parameters without the embedding (common.gpu_check's convention)."""
    if device.type != "cuda" or not seconds:
        return None
    from common.gpu_check import flops_per_token, peak_tflops

    peak = peak_tflops(torch.cuda.get_device_name(device))
    n = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    return flops_per_token(cfg, n, seq_len) * tokens / seconds / (world * peak * 1e12) if peak else None


@contextmanager
def counting_sends(group, sent: list[float]) -> Iterator[None]:
    """Add to sent[0] the bytes of every isend that `dist.batch_isend_irecv` posts on `group`
    while inside (the CP ring's, apart from the pipeline's on its own group); None: nothing."""
    def counting(post):
        def counted(ops):
            sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                           if op.group is group and getattr(op.op, "__name__", "") == "isend")
            return post(ops)
        return counted

    with patch_dist({} if group is None else {"batch_isend_irecv": counting}):
        yield


def build(run: Run, ctx: DistContext) -> Strategy:
    return Parallel3DStrategy(run, ctx)


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=7)
