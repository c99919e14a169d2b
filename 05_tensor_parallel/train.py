"""Chapter 05 demo: train LLaMA with Megatron tensor parallelism (and sequence parallelism).

    torchrun --standalone --nproc-per-node 4 05_tensor_parallel/train.py --tp 4 --check
    make run-5 ARGS="--tp 2 --sequence-parallel --dtype float64 --check"     (dp = 4 / 2 = 2)
    make run-5 ARGS="--tp 2 --cp 2 --sequence-parallel --dtype float64 --check"   (dp = 1)
    make run-5 ARGS="--cp 4 --cp-variant ulysses --dtype float64 --check"         (tp = 1)

The world is tp × cp × dp ranks, TP innermost (consecutive ranks, like Megatron: one node's
NVLink domain), then context parallelism, then the dp replicas. The ranks of one TP group take
the same rows and tokens and hold 1/tp of every block; the cp CP groups of a replica take the
same rows, each its zig-zag chunks of the sequence (RoPE at their global positions; under SP the
split into tp pieces happens inside those s/cp tokens), attending over the whole sequence by ring
attention (`--cp-variant all_gather`: Llama 3's all-gather of K/V; `ulysses`: two all-to-alls
trade the sequence split for a head split inside attention, ulysses.py). CP ranks hold the same
parameters, so gradients are averaged over dp × cp (SUM, then / (dp·cp)): each rank's
loss is the mean over its tokens, and their mean the global-token mean.
The report prints the comm and activation formulas of formulas.py beside the measurements.
A MoE model (--model tiny-moe) trains with expert parallelism (and --tp: every expert cut like the
SwiGLU, moe_tensor_parallel.py) in its own demo: train_expert.py, `make run-5-ep`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from common.cli import ConfigError, base_parser, batch_layout, model_config, require, validate_common
from common.data import split_inputs_targets
from common.dist import DistContext
from common.kernel.clip import clip_grads_by_global_norm_
from common.kernel.mesh import MeshError, build_mesh, mesh_shape
from common.kernel.model import build_model, initializer, materialize
from common.kernel.optimizer_bytes import optimizer_state_bytes
from common.memory import optimizer_state_tensors, storage_bytes
from common.mixed_precision import MasterWeights
from common.reference import make_optimizer
from common.run import Run, resolve_run
from common.training import Strategy, run_main
from tensor_parallel import (
    apply_context_parallel,
    check_cp_sizes,
    check_tp_sizes,
    gather_full,
    load_balance,
    local_piece,
    parallelize_llama,
    shard_sequence,
    vocab_parallel_loss,
    zigzag_positions,
)
from tensor_parallel.formulas import (
    Shape,
    block_comm_bytes,
    block_comm_terms,
    cp_activation_bytes,
    cp_comm_bytes,
    cp_model_activation_terms,
    layer_activation_bytes,
    local_parameter_count,
    model_activation_bytes,
    model_activation_terms,
    step_comm_bytes,
    ulysses_activation_bytes,
    ulysses_comm_bytes,
)
from tensor_parallel.ulysses import apply_ulysses, check_ulysses_sizes

CP_VARIANTS = ("ring", "all_gather", "ulysses")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (default: every rank); dp = world / tp")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="shard the norm/residual regions along the sequence (Korthikanti et al. 2022)")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: each rank holds s/cp tokens (zig-zag), ring attention")
    p.add_argument("--cp-variant", choices=CP_VARIANTS, default="ring",
                   help="how CP attends: K/V round the ring, all-gathered, or Ulysses' all-to-alls")
    return p.parse_args(argv)


@dataclass(frozen=True)
class TensorParallelOptions:
    """The chapter's resolved flags (the run's `options`); tp, cp and dp are the run's mesh."""

    sequence_parallel: bool = False
    cp_variant: str = "ring"


def validate(args: argparse.Namespace, world_size: int) -> Run:
    """Everything that can be wrong with the input, checked before any collective; the run."""
    validate_common(args)
    cfg, cp = model_config(args), args.cp
    variant = getattr(args, "cp_variant", "ring")  # a Namespace built without the flag: the ring
    require(not cfg.n_experts, f"--model {args.model} is a mixture-of-experts model: train it with expert "
                               "parallelism, make run-5-ep (05_tensor_parallel/train_expert.py)")
    tp = args.tp if args.tp is not None else world_size // cp if cp >= 1 and world_size % cp == 0 else 1
    try:
        mesh = mesh_shape(world_size, tp=tp, cp=cp)  # world = dp × cp × tp, each size refused there
    except MeshError as error:
        raise ConfigError(str(error)) from None
    try:
        if cp > 1:  # the zig-zag chunks; without CP any length trains
            check_cp_sizes(args.seq_len, cp)
        if cp > 1 and variant == "ulysses":  # the heads it splits, within a TP rank's
            check_ulysses_sizes(args.seq_len, cfg.n_heads, cfg.n_kv_heads, cp, tp)
    except ValueError as error:
        raise ConfigError(f"--cp {cp} --cp-variant {variant} with --seq-len {args.seq_len}, "
                          f"--tp {tp}, --model {args.model}: {error}") from None
    try:
        check_tp_sizes(tp, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim, args.seq_len // cp,
                       args.sequence_parallel)
    except ValueError as error:
        within = f" (the {args.seq_len // cp} tokens of a CP rank)" if cp > 1 else ""
        raise ConfigError(f"--tp {tp} with --model {args.model}: {error}{within}") from None
    layout = batch_layout(args.global_batch, mesh.dp, args.micro_batch, args.grad_accum)
    return resolve_run(args, mesh, layout, TensorParallelOptions(args.sequence_parallel, variant))


class TensorParallelStrategy(Strategy):
    """parallelize_llama on a TP group of `tp` ranks, gradient averaging over the DP group after
    the last micro-batch. In mixed precision the TP model computes in bf16, each micro-batch's
    gradients accumulate into fp32 master gradients as backward produces them, the DP all-reduce
    is fp32, AdamW updates the fp32 master shards."""

    def __init__(self, run: Run, ctx: DistContext):
        cfg, self.mixed = run.model, run.mixed
        # rank = (d·cp + c)·tp + i: TP consecutive, CP the same replica d and TP index i,
        # gradients averaged over the dp × cp ranks of TP index i (common/kernel/mesh.py)
        grid = build_mesh(run.mesh, ("tp", "cp", "dp_cp"))
        self.tp_group, self.cp_group, self.grad_group = grid.tp_group, grid.cp_group, grid.dp_cp_group
        self.tp, self.cp, self.dp_size = grid.tp, grid.cp, grid.dp
        self.dp_rank, self.cp_rank = grid.dp_rank, grid.cp_rank
        self.sequence_parallel = run.options.sequence_parallel
        # split the model on the meta device, then draw only this rank's slices onto its device
        self.model = build_model(cfg, dtype=run.dtype, device="meta")
        self.specs = parallelize_llama(self.model, self.tp_group, self.sequence_parallel)
        self.cp_variant = run.options.cp_variant
        if self.cp > 1 and self.cp_variant == "ulysses":
            apply_ulysses(self.model, self.cp_group)
        elif self.cp > 1:
            apply_context_parallel(self.model, self.cp_group, self.cp_variant)
        materialize(self.model, initializer(cfg, run.seed), ctx.device,
                    lambda name, full: local_piece(full, self.specs[name]))
        self.names = [n for n, _ in self.model.named_parameters()]
        self.weights = MasterWeights(self.model.parameters(), enabled=self.mixed)
        if self.mixed:
            self.model.to(torch.bfloat16)  # in place: the masters keep the fp32 values
        self.weights.accumulate_in_backward()  # fp32 sum of the micro-batches, as the reference casts
        self.optimizer = make_optimizer(self.weights.master, run.optimizer, run.lr)
        self.optimizer_name, self.clip_grad = run.optimizer, run.clip_grad
        self.name = ("tp+sp" if self.sequence_parallel else "tp") + ("+cp" if self.cp > 1 else "")
        self.seq_len = run.seq_len
        e = self.model.output.weight.itemsize
        self.shape = Shape(run.micro_batch, run.seq_len // self.cp, cfg.dim, cfg.n_heads, cfg.n_kv_heads,
                           cfg.hidden_dim, cfg.n_layers, cfg.vocab_size, cfg.head_dim, self.tp,
                           self.sequence_parallel, e)
        self.grad_accum, self.reduce_itemsize = run.grad_accum, (4 if self.mixed else e)

    def micro_batch_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = split_inputs_targets(tokens)
        positions = None
        if self.cp > 1:  # this CP rank's zig-zag tokens; RoPE at their global positions
            inputs, targets = (shard_sequence(x, self.cp, self.cp_rank) for x in (inputs, targets))
            positions = zigzag_positions(self.seq_len, self.cp, self.cp_rank, inputs.device)
        return vocab_parallel_loss(self.model.output, self.model(inputs, positions), targets)

    def after_backward(self) -> None:
        """SUM over dp × cp, then / (dp·cp) (never ReduceOp.AVG): one flat all-reduce per step."""
        if self.dp_size * self.cp > 1:
            grads = [m.grad for m in self.weights.master]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.grad_group)
            flat.div_(self.dp_size * self.cp)
            for g, chunk in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(chunk.view_as(g))

    def _named(self, grads: bool) -> dict[str, torch.Tensor]:
        return {n: (m.grad if grads else m) for n, m in zip(self.names, self.weights.master, strict=True)}

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The norm of the full model: summed over the TP group, each piece counted on one of its
        copies; the DP and CP ranks hold the same averaged gradients, so no sum over them."""
        grads = self._named(True)
        counted = [g for n, g in grads.items() if self.specs[n].counted_here]
        return clip_grads_by_global_norm_(grads.values(), max_norm, counted, groups=(self.tp_group,))

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
        """Per rank: formulas.step_comm_bytes per step (on the s/cp local tokens, gradients over
        dp·cp) + the ring's cp_comm_bytes per layer per micro-batch; params P_local·e, grads
        P_local·e_reduce, AdamW m, v (2·P_local·4 or ·e) + 4 B per tensor, + the fp32 master in
        mixed precision; activations: formulas.model_activation_bytes (one micro-batch: backward
        only frees), its attention terms replaced by cp_activation_bytes under CP."""
        self.steps_run = steps  # report_extras' CP row covers the same steps
        P, n_tensors = local_parameter_count(self.shape)
        e, master = self.shape.e, self.weights.master[0].itemsize
        opt = optimizer_state_bytes(self.optimizer_name, P, master, n_tensors)
        opt += P * master if self.mixed else 0
        comm = steps * step_comm_bytes(self.shape, self.grad_accum, self.dp_size * self.cp,
                                       self.reduce_itemsize, self.clip_grad is not None)
        activations = (sum(cp_model_activation_terms(self.shape, self.cp, self.cp_variant).values())
                       if self.cp > 1 else model_activation_bytes(self.shape))
        return comm + self._cp_bytes(steps), {"params": P * e, "grads": P * self.reduce_itemsize,
                                              "optimizer": opt, "activations_peak": activations}

    def _cp_bytes(self, steps: int) -> float:
        """CP attention's bytes per rank over `steps` steps (every layer, micro-batch): the ring's
        K/V and dK/dV messages, the all-gather's, or Ulysses' all-to-alls."""
        x = self.shape
        kv = x.kv // x.t if x.kv >= x.t else 1
        layer = (ulysses_comm_bytes(x.b, self.seq_len, x.a // x.t, kv, x.head_dim, self.cp, x.e)
                 if self.cp_variant == "ulysses" else
                 cp_comm_bytes(x.b, self.seq_len, kv, x.head_dim, self.cp, x.e, self.cp_variant))
        return steps * self.grad_accum * x.L * sum(layer.values())

    def report_extras(self) -> dict:
        extras = {"tp": self.tp, "sequence_parallel": self.sequence_parallel,
                  "activation_per_layer_formula": layer_activation_bytes(self.shape),
                  "activation_terms": model_activation_terms(self.shape),
                  "comm_per_block_formula": block_comm_bytes(self.shape),
                  "comm_per_block_terms": {k: v for k, (_, v) in block_comm_terms(self.shape).items()}}
        if self.cp > 1:
            x = self.shape
            kv = x.kv // x.t if x.kv >= x.t else 1
            saved = (ulysses_activation_bytes if self.cp_variant == "ulysses"
                     else partial(cp_activation_bytes, variant=self.cp_variant))
            # the report's CP row reads the ring's sends; the other variants' bytes are collectives
            name = "comm" if self.cp_variant == "ring" else self.cp_variant
            extras |= {"cp": self.cp, "cp_variant": self.cp_variant,
                       f"cp_{name}_bytes_formula": self._cp_bytes(self.steps_run),
                       "cp_load_balance": load_balance(self.seq_len, self.cp),
                       "activation_terms": cp_model_activation_terms(x, self.cp, self.cp_variant),
                       "cp_attention_activation_per_layer_formula": saved(
                           x.b, self.seq_len, x.a // x.t, kv, x.head_dim, self.cp, x.e)}
        return extras


def build(run: Run, ctx: DistContext) -> Strategy:
    return TensorParallelStrategy(run, ctx)


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=5)
