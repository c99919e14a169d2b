"""Chapter 03 demo: train LLaMA with ZeRO stage 0-3 (optionally offloaded), DeepSpeed-style config.

    torchrun --standalone --nproc-per-node 4 03_zero/train.py --stage 3 --check
    torchrun --standalone --nproc-per-node 4 03_zero/train.py --config 03_zero/configs/stage2.json

Flags override the config file's keys (--stage, --offload, the bucket sizes, the threshold); the
file's micro-batch and accumulation set the batch layout unless the flags do, and must agree with
--global-batch and the rank count. The report prints each stage's memory and communication
formula beside the measured values.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from common.cli import ConfigError, base_parser, batch_layout, require, validate_common
from common.dist import DistContext
from common.kernel.mesh import mesh_shape
from common.kernel.model import TransformerBlock, build_model, initializer
from common.loss_scaler import agreement_bytes, make_scaler
from common.memory import ActivationMeter, storage_bytes
from common.reference import make_optimizer
from common.run import Run, resolve_run
from common.training import Strategy, run_main
from zero.accounting import comm_formula, memory_formula, optimizer_bytes_per_param
from zero.config import ZeroConfig, ZeroConfigError, load_config, to_dict
from zero.engine import ZeroEngine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.set_defaults(global_batch=None)
    p.add_argument("--stage", type=int, default=None, help="ZeRO stage 0-3 (default: the config's, else 2)")
    p.add_argument("--offload", action="store_true",
                   help="offload_optimizer (and at stage 3 offload_param) to the CPU")
    p.add_argument("--config", default=None, metavar="FILE", help="DeepSpeed-style JSON config")
    p.add_argument("--reduce-bucket-size", type=float, default=None, metavar="ELEMENTS",
                   help="gradient bucket (elements; DeepSpeed's default 5e8)")
    p.add_argument("--allgather-bucket-size", type=float, default=None, metavar="ELEMENTS",
                   help="parameter all-gather elements in flight after the step")
    p.add_argument("--param-persistence-threshold", type=float, default=None, metavar="ELEMENTS",
                   help="stage 3: parameters smaller than this stay whole (default 1e5)")
    p.add_argument("--no-overlap", action="store_true", help="overlap_comm false: reduce after backward")
    return p.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> ZeroConfig:
    """The config file (or the defaults) with the flags applied on top, validated as one."""
    try:
        config = load_config(args.config) if args.config else ZeroConfig(stage=2)
    except ZeroConfigError as error:
        raise ConfigError(f"--config {args.config}: {error}") from None
    if args.stage is not None:
        require(args.stage in (0, 1, 2, 3), f"--stage {args.stage}: ZeRO has stages 0 (plain DP), 1 "
                "(optimizer state), 2 (+ gradients) and 3 (+ parameters); use one of 0, 1, 2, 3")
        config = replace(config, stage=args.stage)
    for flag, key, minimum in (("--reduce-bucket-size", "reduce_bucket_size", 1),
                               ("--allgather-bucket-size", "allgather_bucket_size", 1),
                               ("--param-persistence-threshold", "param_persistence_threshold", 0)):
        value = getattr(args, key)
        if value is not None:
            require(value >= minimum and float(value).is_integer(),
                    f"{flag} {value:g}: must be a whole number of elements >= {minimum} (e.g. 5e8)")
            config = replace(config, **{key: int(value)})
    if args.offload:
        config = replace(config, offload_optimizer="cpu",
                         offload_param="cpu" if config.stage == 3 else "none")
    if args.no_overlap:
        config = replace(config, overlap_comm=False)
    require(config.offload_param == "none" or config.stage == 3,
            f"offload_param with stage {config.stage}: only stage 3 partitions the parameters; use "
            "--stage 3 or remove offload_param from the config")
    flag = getattr(args, "mixed_precision", "none")
    require(flag == "none" or not config.mixed or getattr(config, flag, False),
            f"--mixed-precision {flag} disagrees with the config's {'bf16' if config.bf16 else 'fp16'} "
            "section: drop one of the two")
    if flag in ("bf16", "fp16"):
        config = replace(config, **{flag: True})
    require(not config.mixed or args.dtype == "float32",
            f"{'bf16' if config.bf16 else 'fp16'} (the config's, or --mixed-precision) with --dtype "
            f"{args.dtype}: the master weights are float32, use --dtype float32")
    if config.clip is not None:
        require(args.clip_grad in (None, config.clip),
                f"--clip-grad {args.clip_grad} disagrees with the config's gradient_clipping "
                f"{config.gradient_clipping}: drop one of the two")
    elif args.clip_grad is not None:
        config = replace(config, gradient_clipping=args.clip_grad)
    return config


def validate(args: argparse.Namespace, world_size: int) -> Run:
    """Everything that can be wrong with the input, checked on every rank before any collective;
    the run, whose options are the engine's ZeroConfig (the flags over the file, with the batch
    layout written into it, as DeepSpeed's engine holds it) and whose global batch, clipping and
    mixed precision are the config's."""
    config = resolve_config(args)
    validate_common(args, loss_scaling=True)
    micro, accum = args.micro_batch, args.grad_accum
    for flag, value, key in (("--micro-batch", micro, "train_micro_batch_size_per_gpu"),
                             ("--grad-accum", accum, "gradient_accumulation_steps")):
        require(value is None or getattr(config, key) in (None, value),
                f"{flag} {value} disagrees with the config's {key} {getattr(config, key)}: drop one")
    micro = micro or config.train_micro_batch_size_per_gpu
    accum = accum or config.gradient_accumulation_steps
    implied = micro * accum * world_size if micro and accum else None
    global_batch = args.global_batch or config.train_batch_size or implied or 16
    for source, value in (("train_batch_size", config.train_batch_size),
                          ("train_micro_batch_size_per_gpu × gradient_accumulation_steps × ranks", implied)):
        require(value in (None, global_batch),
                f"the config's {source} = {value} disagrees with --global-batch {global_batch} on "
                f"{world_size} ranks: make them agree (DeepSpeed: train_batch_size = micro × accumulation "
                "× ranks), or drop --global-batch")
    layout = batch_layout(global_batch, world_size, micro, accum)
    config = replace(config, gradient_accumulation_steps=layout.grad_accum,
                     train_micro_batch_size_per_gpu=layout.micro_batch)
    return resolve_run(args, mesh_shape(world_size), layout, config, global_batch=global_batch,
                       clip_grad=config.clip,
                       mixed_precision="bf16" if config.bf16 else "fp16" if config.fp16 else "none")


class FlatActivationMeter(ActivationMeter):
    """Saved-tensor bytes, not counting the engine's flat parameter storages (stage 3 gathers them
    into fresh allocations, so the parameter keys taken at construction would miss them)."""

    def __init__(self, engine: ZeroEngine):
        super().__init__(engine.module.parameters())
        self.engine = engine

    def _add(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if any(g.flat.untyped_storage().data_ptr() == ptr for g in self.engine.groups):
            return None
        return super()._add(t)


class ZeroStrategy(Strategy):
    """The model's parameters live in ZeroEngine's flat buffers; each rank steps its own slice.
    Stage 3 gathers one unit per TransformerBlock (`unit_policy`, FSDP's auto-wrap policy). The
    engine's hooks reduce (it counts the micro-batches itself: no no_sync); clipping is its norm
    over the shards. fp16: the loss scaler unscales each rank's gradient shards, and the ranks
    agree the overflow flag over the engine's group (an inf lands in one owner's shard only)."""

    unit_policy = staticmethod(lambda module: isinstance(module, TransformerBlock))

    def __init__(self, run: Run, ctx: DistContext, process_group=None):
        config = run.options
        # stage 3 builds on the meta device: the engine draws one unit at a time and keeps its
        # shard (stages 0-2 replicate the parameters: every rank holds the whole model anyway)
        sharded = config.stage == 3
        model = build_model(run.model, run.seed, run.dtype, "meta" if sharded else ctx.device)
        init = initializer(run.model, run.seed) if sharded else None
        self.engine = ZeroEngine(model, lambda ps: make_optimizer(ps, run.optimizer, run.lr), config,
                                 process_group, gradient_accumulation_steps=run.grad_accum,
                                 unit_policy=self.unit_policy, init_values_fn=init, device=ctx.device)
        self.model, self.optimizer, self.config = model, self.engine.optimizer, config
        self.clip_grad, self.grad_norm = config.clip, None
        self.name = f"zero-{config.stage}" + ("-offload" if config.offload else "")
        self.dp_rank, self.dp_size = self.engine.rank, self.engine.world
        self.optimizer_name, self.itemsize = run.optimizer, run.dtype.itemsize
        self.scaler = make_scaler(run.mixed_precision, run.loss_scaling, ctx.device)
        self.scaler_group = self.engine.optimizer.group

    def local_gradients(self) -> list[torch.Tensor]:
        return [g.shard_grad for g in self.engine.groups]  # what this rank's optimizer steps

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        self.grad_norm = self.engine.clip_grad_norm_(max_norm)  # read once, by the report
        return self.grad_norm

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self.engine.full_gradients()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.engine.full_parameters()

    def memory(self) -> dict[str, int]:
        return {kind: storage_bytes(ts) for kind, ts in self.engine.state_tensors().items()}

    def memory_offloaded(self) -> dict[str, int]:
        """The part of `memory()` that lives off the compute device (0 on a CPU-only run)."""
        device = self.engine.device
        return {kind: storage_bytes(t for t in ts if t.device != device)
                for kind, ts in self.engine.state_tensors().items()}

    def activation_meter(self) -> ActivationMeter:
        return FlatActivationMeter(self.engine)

    def sizes(self) -> dict[str, int]:
        """Ψ and the persistent part of it, and the byte sizes of the formulas."""
        psi = sum(p.numel() for g in self.engine.groups for p in g.params)
        persistent = sum(g.numel for g in self.engine.groups if g.persistent) if self.config.stage == 3 else 0
        mixed = self.config.mixed
        return {"psi": psi, "psi_persistent": persistent, "b_param": 2 if mixed else self.itemsize,
                "b_grad": 4 if mixed else self.itemsize,
                "k": optimizer_bytes_per_param(self.optimizer_name, mixed, self.itemsize)}

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        s, c, n = self.sizes(), self.config, self.dp_size
        comm = steps * comm_formula(c.stage, s["psi"], n, s["b_param"], s["b_grad"],
                                    self.engine.gas, s["psi_persistent"], clip=c.clip is not None)
        comm += steps * agreement_bytes(n) if self.scaler else 0  # fp16's overflow flag
        return comm, memory_formula(c.stage, s["psi"], n, s["b_param"], s["b_grad"], s["k"],
                                    s["psi_persistent"])

    def report_extras(self) -> dict:
        return {"zero_config": to_dict(self.config), "memory_offloaded": self.memory_offloaded(),
                "zero_sizes": self.sizes(),
                "grad_norm": None if self.grad_norm is None else self.grad_norm.item()}


def build(run: Run, ctx: DistContext) -> Strategy:
    return ZeroStrategy(run, ctx)


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=3)
