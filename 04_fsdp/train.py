"""Chapter 04 demo: train LLaMA with FSDP (ours, torch's API shape) on every rank torchrun started.

    torchrun --standalone --nproc-per-node 4 04_fsdp/train.py --sharding-strategy FULL_SHARD --check

Each TransformerBlock is a unit (transformer_auto_wrap_policy), the root unit holds the
embeddings, the final norm and the head. Every rank keeps 1/N of each unit's flat parameter, its
gradient and its AdamW state; units are gathered just before they run and freed after.
`--mixed-precision bf16` is the source article's MixedPrecision(bf16, fp32, bf16): bf16 compute,
fp32 reduce-scatter, fp32 master shard and optimizer state. `--check` trains the single-device
reference alongside and exits 1 when the two differ beyond the README's tolerance.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from common.cli import DTYPES, BatchLayout, base_parser, batch_layout, model_config, require, validate_common
from common.data import split_inputs_targets
from common.dist import DistContext
from common.memory import ActivationMeter, model_state_bytes, optimizer_state_tensors, storage_bytes
from common.model import TransformerBlock, build_model, initializer, loss_fn
from common.reference import make_optimizer
from common.training import Strategy, run_main
from fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy, transformer_auto_wrap_policy

BF16_MIXED = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                            buffer_dtype=torch.bfloat16)  # the source article's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--sharding-strategy", default="FULL_SHARD",
                   help="FULL_SHARD (ZeRO-3) | SHARD_GRAD_OP | NO_SHARD")
    p.add_argument("--no-sync", action="store_true",
                   help="gradient accumulation under model.no_sync() (one reduce-scatter per step, "
                        "unsharded gradients kept meanwhile); default: reduce every micro-batch")
    p.add_argument("--impl", choices=("ours", "torch-fsdp2"), default="ours",
                   help="ours, or torch's FSDP2 (fully_shard) with the same units, for comparison")
    p.add_argument("--no-prefetch", action="store_true",
                   help="gather each unit only when it runs (no forward/backward prefetch)")
    return p.parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> BatchLayout:
    """Everything that can be wrong with the input, checked before any collective."""
    validate_common(args)
    names = [s.name for s in ShardingStrategy]
    require(args.sharding_strategy in names,
            f"--sharding-strategy {args.sharding_strategy!r} is unknown: use one of {', '.join(names)}")
    require(args.impl == "ours" or args.sharding_strategy != "NO_SHARD",
            "--impl torch-fsdp2 with --sharding-strategy NO_SHARD: FSDP2 has no NO_SHARD (use "
            "torch's DDP, chapter 01), pick FULL_SHARD or SHARD_GRAD_OP")
    return batch_layout(args.global_batch, world_size, args.micro_batch, args.grad_accum)


def wrap_llama(model: nn.Module, args: argparse.Namespace, process_group=None, device=None,
               param_init_fn=None) -> FullyShardedDataParallel:
    """The source article's wrapping, with our class (a meta model: see `param_init_fn`)."""
    return FullyShardedDataParallel(
        model, process_group=process_group, device_id=device, param_init_fn=param_init_fn,
        auto_wrap_policy=partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock}),
        mixed_precision=BF16_MIXED if args.mixed_precision == "bf16" else None,
        sharding_strategy=ShardingStrategy[args.sharding_strategy],
        forward_prefetch=not args.no_prefetch, backward_prefetch=not args.no_prefetch)


class UnitActivationMeter(ActivationMeter):
    """Saved activations, not counting the gathered weights that autograd saves (they are the
    units' full parameters, reported separately as `full_params_peak`)."""

    def __init__(self, fsdp: FullyShardedDataParallel):
        super().__init__(fsdp.parameters())
        self.fsdp = fsdp

    def _add(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if any(h.allocated and h.full.untyped_storage().data_ptr() == ptr for h in self.fsdp.handles()):
            return None
        return super()._add(t)


class FSDPStrategy(Strategy):
    """LLaMA under our FullyShardedDataParallel; the optimizer holds only the 1/N flat shards."""

    def __init__(self, args: argparse.Namespace, ctx: DistContext, process_group=None):
        cfg = model_config(args)
        # a meta model: each unit draws only the parameters that overlap this rank's shard, on CPU
        init, meta = initializer(cfg, args.seed), build_model(cfg, dtype=DTYPES[args.dtype], device="meta")
        self.model = wrap_llama(meta, args, process_group, ctx.device, lambda name, _: init(name))
        self.model.memory_trace = []
        self.optimizer = make_optimizer(self.model.parameters(), args.optimizer, args.lr)
        self.args, self.n_params = args, sum(h.numel for h in self.model.handles())
        self.name = f"fsdp-{args.sharding_strategy.lower()}"
        self.dp_rank, self.dp_size = ctx.rank, ctx.world_size
        self.mesh = {"dp": ctx.world_size}

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        losses = []
        for i, tokens in enumerate(micro_batches):
            inputs, targets = split_inputs_targets(tokens)
            accumulate = self.args.no_sync and i < len(micro_batches) - 1
            with self.model.no_sync() if accumulate else nullcontext():
                loss = loss_fn(self.model(inputs), targets) / len(micro_batches)
                loss.backward()
            losses.append(loss.detach())  # no .item(): a host sync per micro-batch
        return torch.stack(losses).sum(dtype=torch.float64)

    def step(self) -> None:
        if self.args.clip_grad is not None:
            self.model.clip_grad_norm_(self.args.clip_grad)
        self.optimizer.step()

    def full_gradients(self) -> dict[str, torch.Tensor] | None:
        return self.model.full_gradients()

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        return self.model.full_state_dict()

    def memory(self) -> dict[str, int]:
        return model_state_bytes(self.model.parameters(), self.optimizer)

    def activation_meter(self) -> ActivationMeter:
        return UnitActivationMeter(self.model)

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        """Per rank, n = group size, P_u = a unit's padded numel, S_u = P_u/n its shard:
        comm per micro-batch = (n-1)/n · b_param · (gathers) + (n-1)/n · b_reduce · P per
        reduce-scatter (2× for NO_SHARD's all-reduce); memory = Σ S_u · (b + b + 2b) + 4 bytes of
        AdamW step counter per unit (b = the shard's dtype: fp32 in mixed precision)."""
        comm = steps * comm_bytes_per_step(self.model, len_micro(self.args, self.dp_size),
                                           self.args.no_sync, self.args.clip_grad is not None)
        shards = sum(h.shard_numel for h in self.model.handles())
        b = self.model.handles()[0].flat_param.element_size()
        opt = (2 * shards * b + 4 * len(self.model.handles())) if self.args.optimizer == "adamw" else 0
        return comm, {"params": shards * b, "grads": shards * b, "optimizer": opt}

    def report_extras(self) -> dict:
        """The ledger of gathered parameters, and the ratios to plain data parallelism."""
        trace = self.model.memory_trace or []
        n, P = self.dp_size, self.n_params
        b_reduce = self.model.handles()[0].reduce_dtype.itemsize
        ddp_comm = 2 * (n - 1) / n * P * b_reduce
        b = self.model.handles()[0].flat_param.element_size()
        ddp_state = P * b * (4 if self.args.optimizer == "adamw" else 2)
        _, mem = self.formulas(1)
        return {
            "sharding_strategy": self.args.sharding_strategy, "units": len(self.model.handles()),
            "full_params_peak": max((e["live_bytes"] for e in trace), default=0),
            "full_params_peak_formula": full_params_peak_formula(self.model),
            "comm_per_step_vs_ddp": comm_bytes_per_step(self.model, 1, True, False) / ddp_comm
            if n > 1 else None,
            "state_vs_ddp": sum(mem.values()) / ddp_state,
        }


def len_micro(args: argparse.Namespace, dp: int) -> int:
    return batch_layout(args.global_batch, dp, args.micro_batch, args.grad_accum).grad_accum


def comm_bytes_per_step(model: FullyShardedDataParallel, grad_accum: int, no_sync: bool,
                        clip: bool) -> float:
    """Accounted wire bytes of one optimizer step on one rank (nccl-tests' conventions)."""
    n = torch.distributed.get_world_size(model.process_group)
    if n == 1:
        return 0.0
    frac, strategy = (n - 1) / n, model.sharding_strategy
    reduces = 1 if no_sync else grad_accum
    total = 0.0
    for unit in model.units():
        h = unit._handle
        if h is None:
            continue
        b_param, b_reduce = h.full.element_size(), h.reduce_dtype.itemsize
        if strategy == ShardingStrategy.NO_SHARD:
            total += reduces * 2 * frac * h.padded * b_reduce
            continue
        gathers = 1 if strategy == ShardingStrategy.SHARD_GRAD_OP or unit._is_root else 2
        total += grad_accum * gathers * frac * h.padded * b_param + reduces * frac * h.padded * b_reduce
    if clip and strategy != ShardingStrategy.NO_SHARD:
        total += 2 * frac * model.handles()[0].flat_param.element_size()
    return total


def full_params_peak_formula(model: FullyShardedDataParallel) -> int:
    """Most gathered bytes alive at once: FULL_SHARD = root + the two largest units (the one
    computing and the one prefetched); otherwise every unit (SHARD_GRAD_OP keeps them all to
    the end of backward; NO_SHARD never frees the full copy)."""
    handles = model.handles()
    sizes = sorted((h.full_bytes for h in handles if h is not model._handle and not h.alias), reverse=True)
    root = model._handle.full_bytes if model._handle is not None and not model._handle.alias else 0
    if model.sharding_strategy == ShardingStrategy.FULL_SHARD:
        prefetch = model.forward_prefetch or model.backward_prefetch
        return root + sum(sizes[: 2 if prefetch else 1])
    return root + sum(sizes)


# --- torch's FSDP2 as a yardstick under the same interface (--impl torch-fsdp2) ---------------
# torch's own FSDP2 (`torch.distributed.fsdp.fully_shard`) under the shared Strategy interface,
# with our units (each TransformerBlock, then the root), so `train.py --impl torch-fsdp2 --check`
# holds torch's implementation to the same single-device reference as ours.
#
# FSDP2 shards every parameter along dim 0 (a DTensor per parameter, each padded to a multiple of
# N rows) instead of one flat parameter per unit; the bytes it gathers and reduces are the same up
# to that padding. The formulas below count its padding. On torch 2.6-2.8 with gloo, FSDP2's
# reduce-scatter asks for ReduceOp.AVG, which gloo silently computes as a SUM: gradients come out
# N× too large — a loss curve under AdamW barely shows it, `--check`'s gradient comparison does.


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a DTensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def padded_numel(p: torch.Tensor, n: int) -> int:
    """FSDP2 pads dim 0 to a multiple of n."""
    rows = p.shape[0] if p.dim() else 1
    return -(-rows // n) * n * (p.numel() // max(rows, 1))


class TorchFSDP2Strategy(Strategy):
    def __init__(self, args: argparse.Namespace, ctx: DistContext, grad_accum: int = 1):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.args, self.mixed, self.grad_accum = args, args.mixed_precision == "bf16", grad_accum
        model = build_model(model_config(args), dtype=DTYPES[args.dtype], device="meta")
        self.sizes = ([[padded_numel(p, ctx.world_size) for p in b.parameters()] for b in model.layers],
                      [padded_numel(p, ctx.world_size) for n, p in model.named_parameters()
                       if not n.startswith("layers.")])
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if self.mixed else MixedPrecisionPolicy())
        reshard = args.sharding_strategy == "FULL_SHARD"
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        # the root stays gathered from forward to backward, as ours (torch's own heuristic)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        model.to_empty(device=ctx.device)  # this rank's dim-0 chunk of each parameter, uninitialized
        init = initializer(model_config(args), args.seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                chunks = init(name).chunk(ctx.world_size)  # FSDP2's layout: torch.chunk on dim 0
                if ctx.rank < len(chunks):
                    p.to_local().copy_(chunks[ctx.rank])
        self.model = model
        self.optimizer = make_optimizer(model.parameters(), args.optimizer, args.lr)
        self.name, self.mesh = f"torch-fsdp2-{args.sharding_strategy.lower()}", {"dp": ctx.world_size}
        self.dp_rank, self.dp_size = ctx.rank, ctx.world_size

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        losses = []
        for i, tokens in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            self.model.set_requires_gradient_sync(last or not self.args.no_sync)
            inputs, targets = split_inputs_targets(tokens)
            loss = loss_fn(self.model(inputs), targets) / len(micro_batches)
            loss.backward()
            losses.append(loss.detach())  # no .item(): a host sync per micro-batch
        return torch.stack(losses).sum(dtype=torch.float64)

    def step(self) -> None:
        if self.args.clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_grad, foreach=False)
        self.optimizer.step()

    def _full(self, grads: bool) -> dict[str, torch.Tensor] | None:
        out = {n: (p.grad if grads else p).full_tensor().detach() for n, p in self.model.named_parameters()}
        return out if dist.get_rank() == 0 else None

    def full_gradients(self) -> dict[str, torch.Tensor] | None:
        return self._full(grads=True)

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        return self._full(grads=False)

    def memory(self) -> dict[str, int]:
        params = [local(p) for p in self.model.parameters()]
        return {"params": storage_bytes(params),
                "grads": storage_bytes(local(p.grad) for p in self.model.parameters() if p.grad is not None),
                "optimizer": storage_bytes(local(t) for t in optimizer_state_tensors(self.optimizer))}

    def activation_meter(self) -> ActivationMeter:
        return ActivationMeter(local(p) for p in self.model.parameters())

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        """Our FSDP's formulas with FSDP2's per-parameter dim-0 padding: the root gathered once
        per micro-batch, each block twice (FULL_SHARD) or once (SHARD_GRAD_OP), one reduce-
        scatter per micro-batch; the state is each parameter's padded 1/N shard. Clipping's norm
        all-reduce runs through DTensor's functional collectives, which the meter does not see,
        so it is not counted here either."""
        n = self.dp_size
        blocks, root = self.sizes
        accum = self.grad_accum
        b_param = 2 if self.mixed else DTYPES[self.args.dtype].itemsize
        b_reduce = 4 if self.mixed else b_param
        b = DTYPES[self.args.dtype].itemsize
        total = sum(map(sum, blocks)) + sum(root)
        per_block = 2 if self.args.sharding_strategy == "FULL_SHARD" else 1
        gathers = sum(root) + sum(map(sum, blocks)) * per_block
        reduces = 1 if self.args.no_sync else accum
        comm = steps * (n - 1) / n * (accum * gathers * b_param + reduces * total * b_reduce)
        shard = total // n * b
        opt = 2 * shard + 4 * len(list(self.model.parameters())) if self.args.optimizer == "adamw" else 0
        return comm, {"params": shard, "grads": shard, "optimizer": opt}

    def report_extras(self) -> dict:
        return {"impl": "torch-fsdp2", "torch": torch.__version__,
                "sharding_strategy": self.args.sharding_strategy}


def build(args: argparse.Namespace, ctx: DistContext, layout: BatchLayout) -> Strategy:
    if args.impl == "torch-fsdp2":
        return TorchFSDP2Strategy(args, ctx, layout.grad_accum)
    return FSDPStrategy(args, ctx)


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=4)
