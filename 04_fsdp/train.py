"""Chapter 04 demo: train LLaMA with FSDP (ours, torch's API shape) on every rank torchrun started.

    torchrun --standalone --nproc-per-node 4 04_fsdp/train.py --sharding-strategy FULL_SHARD --check

Each TransformerBlock is a unit (transformer_auto_wrap_policy), the root unit holds the
embeddings, the final norm and the head. Every rank keeps 1/N of each unit's flat parameter, its
gradient and its AdamW state; units are gathered just before they run and freed after.
`--mixed-precision bf16` is the source article's MixedPrecision(bf16, fp32, bf16): bf16 compute,
fp32 reduce-scatter, fp32 master shard and optimizer state; `fp16` the same in fp16, with the
loop's dynamic loss scaling (the overflow flag agreed by every rank). `--check` trains the
single-device reference alongside and exits 1 when the two differ beyond the README's tolerance.

HSDP (FSDP across nodes): `--sharding-strategy HYBRID_SHARD --nodes 2` on 4 ranks shards over
ranks {0,1} and {2,3} (two "nodes") and all-reduces each shard over {0,2} and {1,3}; without
--nodes a node is LOCAL_WORLD_SIZE ranks (torch's default under a multi-node torchrun). The report
splits the bytes: comm_bytes_intra / _inter beside their formulas, and comm_bytes_flat_formula,
the same units sharded over all ranks (FULL_SHARD), per rank over every link (which bytes leave a
node, per node: fsdp.formulas.network_bytes; 04_fsdp/hsdp.md).
"""

from __future__ import annotations

import argparse
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from common.cli import ConfigError, base_parser, batch_layout, require, validate_common
from common.dist import DistContext, pick_backend
from common.kernel.mesh import MeshShape, build_mesh, mesh_shape
from common.kernel.model import TransformerBlock, build_model, initializer
from common.kernel.optimizer_bytes import optimizer_state_bytes
from common.loss_scaler import agreement_bytes, make_scaler
from common.memory import ActivationMeter, model_state_bytes
from common.reference import make_optimizer
from common.run import Run, resolve_run
from common.training import Strategy, run_main
from fsdp import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
    fsdp_comm_bytes,
    fsdp_comm_bytes_by_group,
    transformer_auto_wrap_policy,
    unit_traffic,
)
from fsdp.torch_fsdp2 import TorchFSDP2Strategy, fsdp2_unavailable
from fsdp.wrap import node_size, reshards_after_forward

BF16_MIXED = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                            buffer_dtype=torch.bfloat16)  # the source article's
MIXED = {"bf16": BF16_MIXED, "fp16": MixedPrecision(torch.float16, torch.float32, torch.float16)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--sharding-strategy", default="FULL_SHARD",
                   help="FULL_SHARD (ZeRO-3) | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | _HYBRID_SHARD_ZERO2")
    p.add_argument("--nodes", type=int, default=None,
                   help="HYBRID_SHARD: simulate N nodes of world/N consecutive ranks (shard within a node, "
                        "replicate across nodes); default: a node = LOCAL_WORLD_SIZE ranks (torch's)")
    p.add_argument("--no-sync", action="store_true",
                   help="gradient accumulation under model.no_sync() (one reduce-scatter per step, "
                        "unsharded gradients kept meanwhile); default: reduce every micro-batch")
    p.add_argument("--impl", choices=("ours", "torch-fsdp2"), default="ours",
                   help="ours, or torch's FSDP2 (fully_shard) with the same units, for comparison")
    p.add_argument("--no-prefetch", action="store_true",
                   help="gather each unit only when it runs (no forward/backward prefetch)")
    return p.parse_args(argv)


@dataclass(frozen=True)
class FSDPOptions:
    """The chapter's resolved flags (the run's `options`); HSDP's nodes are the run's mesh."""

    sharding_strategy: str = "FULL_SHARD"  # a ShardingStrategy's name
    no_sync: bool = False  # accumulate under model.no_sync(): one reduce-scatter per step
    prefetch: bool = True  # forward and backward prefetch
    impl: str = "ours"  # ours | torch-fsdp2

    @property
    def hybrid(self) -> bool:
        return ShardingStrategy[self.sharding_strategy] in HYBRID_STRATEGIES


def validate(args: argparse.Namespace, world_size: int) -> Run:
    """Everything that can be wrong with the input, checked before any collective; the run."""
    validate_common(args, loss_scaling=True)
    names = [s.name for s in ShardingStrategy]
    require(args.sharding_strategy in names,
            f"--sharding-strategy {args.sharding_strategy!r} is unknown: use one of {', '.join(names)}")
    require(args.impl == "ours" or args.sharding_strategy != "NO_SHARD",
            "--impl torch-fsdp2 with --sharding-strategy NO_SHARD: FSDP2 has no NO_SHARD (use "
            "torch's DDP, chapter 01), pick FULL_SHARD or SHARD_GRAD_OP")
    require(args.impl == "ours" or args.mixed_precision != "fp16",
            "--impl torch-fsdp2 with --mixed-precision fp16: the FSDP2 yardstick runs no loss scaler; "
            "use --impl ours (or --mixed-precision bf16)")
    mesh = validate_nodes(args, world_size)
    missing = fsdp2_unavailable(device_type()) if args.impl == "torch-fsdp2" else None
    require(missing is None, f"--impl torch-fsdp2: {missing}")
    layout = batch_layout(args.global_batch, world_size, args.micro_batch, args.grad_accum)
    return resolve_run(args, mesh, layout, FSDPOptions(args.sharding_strategy, args.no_sync,
                                                       not args.no_prefetch, args.impl))


def validate_nodes(args: argparse.Namespace, world_size: int) -> MeshShape:
    """HSDP's split of the ranks into equal nodes (every rank trains on its own data: dp = world):
    the mesh, dp_replicate = nodes × dp_shard = ranks per node (--nodes, else LOCAL_WORLD_SIZE)."""
    hybrid = ShardingStrategy[args.sharding_strategy] in HYBRID_STRATEGIES
    require(args.nodes is None or hybrid, f"--nodes {args.nodes} with --sharding-strategy "
            f"{args.sharding_strategy}: --nodes splits HSDP's ranks into nodes; use --sharding-strategy "
            "HYBRID_SHARD (or _HYBRID_SHARD_ZERO2), or drop --nodes")
    if not hybrid:
        return mesh_shape(world_size)
    require(args.impl == "ours", f"--impl torch-fsdp2 with --sharding-strategy {args.sharding_strategy}: "
            "the FSDP2 yardstick shards over one group; use --impl ours")
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    require(args.nodes is None or args.nodes in divisors,
            f"--nodes {args.nodes}: {world_size} ranks do not split into {args.nodes} equal nodes; use "
            f"one of {', '.join(map(str, divisors))}")
    if args.nodes is not None:
        return mesh_shape(world_size, dp_shard=world_size // args.nodes)
    try:
        return mesh_shape(world_size, dp_shard=node_size(world_size))
    except ValueError as error:
        raise ConfigError(f"--sharding-strategy {args.sharding_strategy} without --nodes: {error}; "
                          "or pass --nodes N to simulate N nodes") from None


def hsdp_groups(run: Run):
    """HSDP's (shard group, replicate group) from the run's mesh (a node = dp_shard consecutive
    ranks), else None. A collective: every rank makes every group."""
    if not run.options.hybrid:
        return None
    mesh = build_mesh(run.mesh, ("dp_shard", "dp_replicate"))
    return mesh.group("dp_shard"), mesh.group("dp_replicate")


def wrap_llama(model: nn.Module, run: Run, process_group=None, device=None,
               shard_init_fn=None) -> FullyShardedDataParallel:
    """The source article's wrapping, with our class (a meta model: see `shard_init_fn`), and
    prefetching in both directions unless --no-prefetch (torch's forward_prefetch default is off)."""
    options = run.options
    return FullyShardedDataParallel(
        model, process_group=process_group, device_id=device, shard_init_fn=shard_init_fn,
        auto_wrap_policy=partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock}),
        mixed_precision=MIXED.get(run.mixed_precision),
        sharding_strategy=ShardingStrategy[options.sharding_strategy], forward_prefetch=options.prefetch,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE if options.prefetch else None)


class FSDPStrategy(Strategy):
    """LLaMA under our FullyShardedDataParallel; the optimizer holds only the 1/N flat shards.
    Each micro-batch's backward reduce-scatters (unless --no-sync); clipping is FSDP's own. fp16:
    the loss scaler unscales the shards' gradients and every data-parallel rank agrees the flag."""

    def __init__(self, run: Run, ctx: DistContext, process_group=None):
        # a meta model: each unit draws only the parameters that overlap this rank's shard, on CPU
        init, meta = initializer(run.model, run.seed), build_model(run.model, dtype=run.dtype, device="meta")
        process_group = process_group or hsdp_groups(run)
        self.model = wrap_llama(meta, run, process_group, ctx.device, lambda name, _: init(name))
        self.model.memory_trace = []
        self.optimizer = make_optimizer(self.model.parameters(), run.optimizer, run.lr)
        self.run, self.n_params = run, sum(u.numel for u in self.model.shard_layout())
        self.clip_grad = run.clip_grad
        self.scaler = make_scaler(run.mixed_precision, run.loss_scaling, ctx.device)
        # every data-parallel rank agrees (HSDP: both groups, the world; an inf found after the
        # replicas' all-reduce would otherwise stay on one node)
        self.scaler_group = None if self.model.replicate_group is not None else self.model.process_group
        self.name = f"fsdp-{run.options.sharding_strategy.lower()}"
        self.dp_rank, self.dp_size, self.steps_done = ctx.rank, ctx.world_size, 0
        if self.model.replicate_group is not None:  # HSDP: all ranks are data-parallel, in two groups
            self.comm_groups = (("intra", self.model.process_group), ("inter", self.model.replicate_group))

    def no_sync(self) -> AbstractContextManager:
        return self.model.no_sync() if self.run.options.no_sync else nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.model.clip_grad_norm_(max_norm)

    def full_gradients(self) -> dict[str, torch.Tensor] | None:
        return self.model.full_gradients()

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        return self.model.full_state_dict()

    def memory(self) -> dict[str, int]:
        return model_state_bytes(self.model.parameters(), self.optimizer)

    def activation_meter(self) -> ActivationMeter:
        # the gathered weights autograd saves are the units' full parameters (`full_params_peak`)
        gathered = [u.full for u in self.model.shard_layout()]
        return ActivationMeter(self.model.parameters(), gathered=lambda: gathered)

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        """Per rank, n = group size, P_u = a unit's padded numel, S_u = P_u/n its shard:
        comm per micro-batch = (n-1)/n · b_param · (gathers) + (n-1)/n · b_reduce · P per
        reduce-scatter (2× for NO_SHARD's all-reduce); memory = Σ S_u · (b + b + 2b) + 4 bytes of
        AdamW step counter per unit (b = the shard's dtype: fp32 in mixed precision)."""
        run = self.run
        comm = steps * comm_bytes(self.model, run.grad_accum, run.options.no_sync, run.clip_grad is not None)
        group = dist.get_world_size(self.model.process_group)
        comm += steps * agreement_bytes(group) if self.scaler else 0  # fp16's overflow flag
        units = self.model.shard_layout()
        shards = sum(u.shard_numel for u in units)
        b = units[0].flat_param.element_size()
        opt = optimizer_state_bytes(run.optimizer, shards, b, len(units))
        return comm, {"params": shards * b, "grads": shards * b, "optimizer": opt}

    def after_step(self, done: int) -> None:
        self.steps_done = done

    def hsdp_extras(self) -> dict:
        """HSDP's bytes per group (formulas beside the meter's comm_bytes_intra / _inter) and what
        the same units sharded flat over all ranks would send (all of it across nodes)."""
        if self.model.replicate_group is None:
            return {}
        k, no_sync = self.run.grad_accum, self.run.options.no_sync
        clip = self.run.clip_grad is not None
        split = comm_by_group(self.model, k, no_sync, clip)
        flat = flat_comm_bytes(self.model, k, no_sync, clip)
        return {"comm_bytes_intra_formula": self.steps_done * split["intra"],
                "comm_bytes_inter_formula": self.steps_done * split["inter"],
                "comm_bytes_flat_formula": self.steps_done * flat, "inter_vs_flat": split["inter"] / flat}

    def report_extras(self) -> dict:
        """The ledger of gathered parameters, and the ratios to plain data parallelism."""
        trace = self.model.memory_trace or []
        n, P = self.dp_size, self.n_params
        units = self.model.shard_layout()
        ddp_comm = 2 * (n - 1) / n * P * units[0].reduce_dtype.itemsize
        b = units[0].flat_param.element_size()
        ddp_state = 2 * P * b + optimizer_state_bytes(self.run.optimizer, P, b, n_tensors=0)
        _, mem = self.formulas(1)
        return {
            "sharding_strategy": self.run.options.sharding_strategy, "units": len(units),
            "full_params_peak": max((e["live_bytes"] for e in trace), default=0),
            "full_params_peak_formula": full_params_peak_formula(self.model),
            "comm_per_step_vs_ddp": comm_bytes(self.model, 1, True, False) / ddp_comm
            if n > 1 else None,
            "state_vs_ddp": sum(mem.values()) / ddp_state, **self.hsdp_extras(),
        }


def device_type() -> str:
    """Where the ranks will run, read before any process group exists: CUDA under NCCL."""
    return "cuda" if pick_backend() == "nccl" else "cpu"


def comm_by_group(model: FullyShardedDataParallel, grad_accum: int, no_sync: bool,
                  clip: bool) -> dict[str, float]:
    """Accounted wire bytes of one optimizer step on one rank, {"intra": over the shard group,
    "inter": over the replicate group (HSDP)}: `fsdp.formulas` over the units' descriptions (their
    MixedPrecision dtypes, not what the handles do)."""
    replicate = model.replicate_group
    return fsdp_comm_bytes_by_group(unit_traffic(model.shard_layout()),
                                    dist.get_world_size(model.process_group), model.sharding_strategy,
                                    grad_accum, no_sync, clip,
                                    1 if replicate is None else dist.get_world_size(replicate))


def comm_bytes(model: FullyShardedDataParallel, grad_accum: int, no_sync: bool, clip: bool) -> float:
    """Accounted wire bytes of one optimizer step on one rank, both groups."""
    return sum(comm_by_group(model, grad_accum, no_sync, clip).values())


FLAT = {ShardingStrategy.HYBRID_SHARD: ShardingStrategy.FULL_SHARD,
        ShardingStrategy._HYBRID_SHARD_ZERO2: ShardingStrategy.SHARD_GRAD_OP}


def flat_comm_bytes(model: FullyShardedDataParallel, grad_accum: int, no_sync: bool, clip: bool) -> float:
    """An HSDP model's units sharded flat over all its s·r ranks (HYBRID_SHARD → FULL_SHARD)."""
    n = dist.get_world_size(model.process_group) * dist.get_world_size(model.replicate_group)
    return fsdp_comm_bytes(unit_traffic(model.shard_layout(), n), n, FLAT[model.sharding_strategy],
                           grad_accum, no_sync, clip)


def full_params_peak_formula(model: FullyShardedDataParallel) -> int:
    """Most gathered bytes alive at once: FULL_SHARD (HYBRID_SHARD) = root + the two largest units
    (the one computing and the one prefetched); otherwise every unit (SHARD_GRAD_OP keeps them all
    to the end of backward; NO_SHARD never frees the full copy)."""
    units = [u for u in model.shard_layout() if not u.aliased]
    sizes = sorted((u.full_bytes for u in units if u.name != ""), reverse=True)
    root = sum(u.full_bytes for u in units if u.name == "")
    if reshards_after_forward(model.sharding_strategy):
        prefetch = model.forward_prefetch or model.backward_prefetch == BackwardPrefetch.BACKWARD_PRE
        return root + sum(sizes[: 2 if prefetch else 1])
    return root + sum(sizes)


def build(run: Run, ctx: DistContext) -> Strategy:
    if run.options.impl == "torch-fsdp2":
        return TorchFSDP2Strategy(run, ctx)
    return FSDPStrategy(run, ctx)


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=4)
