"""Tensor parallelism of a mixture-of-experts feed-forward: every expert cut like the dense SwiGLU,
the router whole on every rank (torchtitan's expert tensor parallelism with ETP = TP; Megatron's
MoE layer under TP). A MoE model's plan is LLAMA_TP_PLAN with one `ExpertSplit` in place of each
MoE layer's three SwiGLU entries (`moe_tp_plan`).

One MoE layer over t ranks, rank r holding hidden units [r·H/t, (r+1)·H/t) of every expert:

    x ──f──┬─ router W_r (whole) ──→ plan: the same on every rank (the same x, the same W_r)
           ├─ dispatch → expert i: W2_i[:, r] (silu(W1_i[r] x) ⊙ W3_i[r] x) → combine Σ_j g_nj · out_nj^r
           └─ shared expert, cut the same way: W2[:, r] (silu(W1[r] x) ⊙ W3[r] x)
       y = g(combine + shared)                  one all-reduce of b·s·h, as for the dense SwiGLU

Exact: an expert's output is a sum over its hidden units, so out_nj = Σ_r out_nj^r, and combine
(Σ_j g_nj ·) and the shared expert are linear in them: g's sum is the layer's output. Under
sequence parallelism f is the all-gather of the s/t tokens and g a reduce-scatter over them: the
router still sees whole sequences, so routing, capacity and the per-sequence aux loss are exact.

Backward. The gate g_nj's gradient on rank r is ⟨dy_n, out_nj^r⟩, a partial sum: the router's
weight gradient is partial too, and enters through f (copy_to_tp_region on the weight, like SP's
norm weights), whose backward all-reduces it over the t ranks; the path into x is completed by
the f before the layer, with the experts' partial input gradients. The aux loss is whole on
every rank and flows through the same two sums, so each rank backpropagates 1/t of it
(`aux_loss_scale / t`): it counts once.

Expert parallelism composes unchanged (expert_parallel.py): an EP group is ranks of one TP index,
which hold the same hidden slice of different experts; the rows they exchange are whole tokens.

Bytes per MoE block and micro-batch: the dense block's (formulas.block_comm_terms) + the router's
weight gradient, 2(t-1)/t · E·h·e, and under SP one all-gather fewer: the MoE layer keeps the
s tokens it gathered (the router, the permuted rows and the shared expert read them) instead of
gathering its s/t again in backward as the dense SwiGLU's w1/w3 do (`moe_block_extra_bytes`).
Depends only on torch, the chapter and common/kernel/moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.kernel.moe import MoEAuxLossAutoScaler, MoEFeedForward

from .formulas import Shape
from .mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
)
from .parallelize import LLAMA_TP_PLAN, Style, apply_tp_plan
from .sharding import TPShard, group_rank, group_size


class _SwiGLU(nn.Module):
    """The shared expert's slice: W2[:, r] (silu(W1[r] x) ⊙ W3[r] x), its output a partial sum
    (common.kernel.model.FeedForward's names, so the reference's parameter names stay)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TensorParallelMoE(MoEFeedForward):
    """A MoEFeedForward cut over the TP `group` (see the module docstring), built from the full
    layer's weights (the same on every rank; the meta device allowed). Its dispatcher is the
    full layer's: expert parallelism may swap it afterwards."""

    def __init__(self, layer: MoEFeedForward, group, sequence_parallel: bool = False):
        t, r = group_size(group), group_rank(group)
        E, H, D = layer.experts.w1.shape
        full_shared = layer.shared_expert
        Hs = 0 if full_shared is None else full_shared.w1.weight.shape[0]
        if H % t or Hs % t:
            raise ValueError(f"the experts' hidden size {H or Hs} is not divisible by the TP size {t}")
        w = layer.router.weight
        with torch.device(w.device):
            super().__init__(D, H // t, E, layer.top_k, layer.gate, layer.aux_loss_coef,
                             layer.capacity_factor, None if full_shared is None else _SwiGLU(D, Hs // t),
                             layer.bias_update_rate, *layer.groups)
        self.to(w.dtype)
        if layer.bias_update_rate:  # the router's bias: whole on every TP rank, like the router
            self.bias_steps = layer.bias_steps.clone()
        self.group, self.sequence_parallel, self.tp = group, sequence_parallel, t
        self.dispatcher, self.aux_loss_scale = layer.dispatcher, layer.aux_loss_scale
        self.hidden, self.shared_hidden = H, Hs
        with torch.no_grad():
            self.router.weight.copy_(w)
            for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
                full = getattr(layer.experts, name)
                getattr(self.experts, name).copy_(full.narrow(dim, r * H // t, H // t))
            if full_shared is not None:
                for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
                    getattr(self.shared_expert, name).weight.copy_(
                        getattr(full_shared, name).weight.narrow(dim, r * Hs // t, Hs // t))

    def tp_specs(self) -> dict[str, TPShard]:
        g, t, H, Hs = self.group, self.tp, self.hidden, self.shared_hidden
        specs = {"router.weight": TPShard(None, 1, g, self.router.weight.shape[0]),
                 "experts.w1": TPShard(1, t, g, H), "experts.w3": TPShard(1, t, g, H),
                 "experts.w2": TPShard(2, t, g, H)}
        if self.shared_expert is not None:
            specs |= {"shared_expert.w1.weight": TPShard(0, t, g, Hs),
                      "shared_expert.w3.weight": TPShard(0, t, g, Hs),
                      "shared_expert.w2.weight": TPShard(1, t, g, Hs)}
        return specs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, sp = self.group, self.sequence_parallel
        x = gather_from_sequence_parallel_region(x, g) if sp else copy_to_tp_region(x, g)
        B, T, D = x.shape
        router_dtype = torch.promote_types(x.dtype, torch.float32)  # bf16 activations: fp32 logits
        weight = copy_to_tp_region(self.router.weight, g)  # its gradient summed over TP
        logits = F.linear(x.to(router_dtype), weight.to(router_dtype))
        plan, balance = self.route(logits, x.dtype)  # the same on every TP rank
        flat = x.reshape(B * T, D)
        inputs, counts = self.dispatcher.dispatch(flat, plan)
        y = self.dispatcher.combine(self.experts(inputs, counts), plan)  # partial over the TP ranks
        if self.shared_expert is not None:
            y = y + self.shared_expert(flat)
        y = y.view(B, T, D)
        y = reduce_scatter_to_sequence_parallel_region(y, g) if sp else reduce_from_tp_region(y, g)
        aux = self.aux_loss_coef * balance.mean()
        self.last_aux_loss = aux.detach()
        if self.aux_loss_coef and torch.is_grad_enabled():  # 1/t per rank: the sums count it once
            y = MoEAuxLossAutoScaler.apply(y, aux, self.aux_loss_scale / self.tp)
        return y


@dataclass(frozen=True)
class ExpertSplit:
    """The plan's style for a MoE layer's feed-forward: MoEFeedForward → TensorParallelMoE. A
    style with an `apply` method: apply_tp_plan calls it (parallelize.py stays free of MoE)."""

    def apply(self, name: str, module: nn.Module, group, sequence_parallel: bool) -> nn.Module:
        if not isinstance(module, MoEFeedForward):
            raise ValueError(f"{name}: {type(module).__name__} is not a MoEFeedForward for ExpertSplit")
        return TensorParallelMoE(module, group, sequence_parallel)


FFN = "layers.*.feed_forward"


def moe_tp_plan(model: nn.Module) -> dict[str, Style]:
    """LLAMA_TP_PLAN for `model`'s layers (a model or a pipeline chunk): the SwiGLU entries for
    each dense layer, one ExpertSplit for each MoE layer's feed-forward."""
    plan = {k: v for k, v in LLAMA_TP_PLAN.items() if not k.startswith(FFN)}
    for name, block in model.layers.named_children():
        if isinstance(block.feed_forward, MoEFeedForward):
            plan[f"layers.{name}.feed_forward"] = ExpertSplit()
        else:
            plan |= {k.replace("*", name, 1): v for k, v in LLAMA_TP_PLAN.items() if k.startswith(FFN)}
    return plan


def parallelize_moe_llama(model: nn.Module, tp_group, sequence_parallel: bool = False) -> dict[str, TPShard]:
    """A MoE LLaMA (or a pipeline chunk of one) → its TP form by `moe_tp_plan`, in place; dense
    models too (the plan is then LLAMA_TP_PLAN's)."""
    return apply_tp_plan(model, tp_group, moe_tp_plan(model), sequence_parallel)


def moe_block_extra_bytes(x: Shape, n_experts: int) -> float:
    """Wire bytes per rank that one MoE block's forward + backward adds to the dense block's
    (formulas.block_comm_bytes, per micro-batch): the router's weight-gradient all-reduce,
    2(t-1)/t · E·h·e, less under SP the backward re-gather of the s/t tokens, (t-1)/t · b·s·h·e."""
    if x.t == 1:
        return 0.0
    regather = (x.t - 1) / x.t * x.b * x.s * x.h * x.e if x.sequence_parallel else 0.0
    return 2 * (x.t - 1) / x.t * n_experts * x.h * x.e - regather
