"""Chapter 05 demo: train LLaMA with Megatron tensor parallelism (and sequence parallelism).

    torchrun --standalone --nproc-per-node 4 05_tensor_parallel/train.py --tp 4 --check
    make run-5 ARGS="--tp 2 --sequence-parallel --dtype float64 --check"     (dp = 4 / 2 = 2)

The world is cut into dp = world / tp replicas of tp consecutive ranks (TP innermost, like
Megatron: one node's NVLink domain). The ranks of one TP group take the same rows of the batch
and hold 1/tp of every block; across the replicas gradients are averaged (SUM, then / dp). The
report prints the comm and activation formulas of formulas.py beside the measurements.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

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
from common.memory import optimizer_state_tensors, storage_bytes
from common.mixed_precision import MasterWeights
from common.model import build_model, initializer, materialize
from common.reference import make_optimizer
from common.training import Strategy, run_main
from tensor_parallel import (
    check_tp_sizes,
    gather_full,
    local_piece,
    parallelize_llama,
    vocab_parallel_loss,
)
from tensor_parallel.formulas import (
    Shape,
    block_comm_bytes,
    layer_activation_bytes,
    local_parameter_count,
    model_activation_bytes,
    model_activation_terms,
    step_comm_bytes,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (default: every rank); dp = world / tp")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="shard the norm/residual regions along the sequence (Korthikanti et al. 2022)")
    return p.parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> BatchLayout:
    """Everything that can be wrong with the input, checked before any collective."""
    validate_common(args)
    tp = world_size if args.tp is None else args.tp
    require(tp >= 1, f"--tp {tp}: must be >= 1")
    require(tp <= world_size, f"--tp {tp} is larger than the world of {world_size} ranks: use "
                              f"--tp {world_size} or launch {tp} ranks (NPROC={tp})")
    require(world_size % tp == 0, f"--tp {tp} does not divide the world of {world_size} ranks: "
                                  f"dp = world / tp must be whole; use a divisor of {world_size}")
    cfg = model_config(args)
    try:
        check_tp_sizes(tp, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim, args.seq_len,
                       args.sequence_parallel)
    except ValueError as error:
        raise ConfigError(f"--tp {tp} with --model {args.model}: {error}") from None
    return batch_layout(args.global_batch, world_size // tp, args.micro_batch, args.grad_accum)


def tp_dp_groups(rank: int, world: int, tp: int):
    """(this rank's TP group, its DP group): TP = consecutive ranks, DP = the same TP index in
    every replica. Every rank creates every group, in the same order (new_group is collective)."""
    tp_group = dp_group = None
    for d in range(world // tp):
        group = dist.new_group(list(range(d * tp, (d + 1) * tp)))
        tp_group = group if rank // tp == d else tp_group
    for i in range(tp):
        group = dist.new_group(list(range(i, world, tp)))
        dp_group = group if rank % tp == i else dp_group
    return tp_group, dp_group


class TensorParallelStrategy(Strategy):
    """parallelize_llama on a TP group of `tp` ranks, gradient averaging over the DP group. In
    mixed precision the TP model computes in bf16, each micro-batch's gradients accumulate into
    fp32 master gradients, the DP all-reduce is fp32, AdamW updates the fp32 master shards."""

    def __init__(self, args: argparse.Namespace, ctx: DistContext, layout: BatchLayout):
        cfg, self.mixed = model_config(args), args.mixed_precision == "bf16"
        self.tp = ctx.world_size if args.tp is None else args.tp
        self.dp_size, self.dp_rank = ctx.world_size // self.tp, ctx.rank // self.tp
        self.tp_group, self.dp_group = tp_dp_groups(ctx.rank, ctx.world_size, self.tp)
        self.sequence_parallel = args.sequence_parallel
        # split the model on the meta device, then draw only this rank's slices onto its device
        self.model = build_model(cfg, dtype=torch.float32 if self.mixed else DTYPES[args.dtype],
                                 device="meta")
        self.specs = parallelize_llama(self.model, self.tp_group, self.sequence_parallel)
        materialize(self.model, initializer(cfg, args.seed), ctx.device,
                    lambda name, full: local_piece(full, self.specs[name]))
        self.names = [n for n, _ in self.model.named_parameters()]
        self.weights = MasterWeights(self.model.parameters(), enabled=self.mixed)
        if self.mixed:
            self.model.to(torch.bfloat16)  # in place: the masters keep the fp32 values
        self.optimizer = make_optimizer(self.weights.master, args.optimizer, args.lr)
        self.optimizer_name, self.clip_grad = args.optimizer, args.clip_grad
        self.name = "tp+sp" if self.sequence_parallel else "tp"
        self.mesh = {"dp": self.dp_size, "tp": self.tp}
        e = self.model.output.weight.itemsize
        self.shape = Shape(layout.micro_batch, args.seq_len, cfg.dim, cfg.n_heads, cfg.n_kv_heads,
                           cfg.hidden_dim, cfg.n_layers, cfg.vocab_size, cfg.head_dim, self.tp,
                           self.sequence_parallel, e)
        self.grad_accum, self.reduce_itemsize = layout.grad_accum, (4 if self.mixed else e)

    def forward_backward(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        losses = []
        for tokens in micro_batches:
            inputs, targets = split_inputs_targets(tokens)
            loss = vocab_parallel_loss(self.model.output, self.model(inputs), targets) / len(micro_batches)
            loss.backward()
            losses.append(loss.detach())  # no .item(): a host sync per micro-batch
            self.weights.grads_to_master(accumulate=True)  # fp32 sum, as the reference casts
        if self.dp_size > 1:  # SUM over the replicas, then / dp (never ReduceOp.AVG)
            grads = [m.grad for m in self.weights.master]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
            flat.div_(self.dp_size)
            for g, chunk in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(chunk.view_as(g))
        return torch.stack(losses).sum(dtype=torch.float64)

    def _named(self, grads: bool) -> dict[str, torch.Tensor]:
        return {n: (m.grad if grads else m) for n, m in zip(self.names, self.weights.master, strict=True)}

    def step(self) -> None:
        """Clip by the norm of the full model: summed over the TP group, each piece counted on one
        of its copies; the DP replicas hold the same averaged gradients, so no sum over DP."""
        if self.clip_grad is not None:
            grads = self._named(True)
            counted = [g for n, g in grads.items() if self.specs[n].counted_here]
            clip_grad_norm_(grads.values(), self.clip_grad, counted, groups=(self.tp_group,))
        self.optimizer.step()
        self.weights.copy_to_model()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return gather_full(self._named(True), self.specs)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return gather_full(self._named(False), self.specs)

    def memory(self) -> dict[str, int]:
        extra = self.weights.master if self.mixed else []
        return {"params": storage_bytes(self.model.parameters()),
                "grads": storage_bytes(m.grad for m in self.weights.master),
                "optimizer": storage_bytes([*optimizer_state_tensors(self.optimizer), *extra])}

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        """Per rank: formulas.step_comm_bytes per step; params P_local·e, grads P_local·e_reduce,
        AdamW m, v (2·P_local·4 or ·e) + 4 B per tensor, + the fp32 master in mixed precision;
        activations: formulas.model_activation_bytes (one micro-batch: backward only frees)."""
        P, n_tensors = local_parameter_count(self.shape)
        e, master = self.shape.e, self.weights.master[0].itemsize
        opt = 2 * P * master + 4 * n_tensors if self.optimizer_name == "adamw" else 0
        opt += P * master if self.mixed else 0
        comm = steps * step_comm_bytes(self.shape, self.grad_accum, self.dp_size, self.reduce_itemsize,
                                       self.clip_grad is not None)
        return comm, {"params": P * e, "grads": P * self.reduce_itemsize, "optimizer": opt,
                      "activations_peak": model_activation_bytes(self.shape)}

    def report_extras(self) -> dict:
        return {"tp": self.tp, "sequence_parallel": self.sequence_parallel,
                "activation_per_layer_formula": layer_activation_bytes(self.shape),
                "activation_terms": model_activation_terms(self.shape),
                "comm_per_block_formula": block_comm_bytes(self.shape)}


def build(args: argparse.Namespace, ctx: DistContext, layout: BatchLayout) -> Strategy:
    return TensorParallelStrategy(args, ctx, layout)


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=5)
