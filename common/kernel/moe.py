"""Mixture of experts: the feed-forward of a MoE LLaMA block, cut at the seams expert parallelism
replaces. A token goes through k of E expert SwiGLUs (plus an always-on shared one), weighted:

    y_n = shared(x_n) + Σ_{j<k} kept_nj · g_nj · E_{e_nj}(x_n)        E_i(x) = W2_i (silu(W1_i x) ⊙ W3_i x)

Routing, per token (router W_r: dim → E, no bias): the logits W_r x, the gates, the top-k and the
aux loss are computed in float32 or better whatever the activations' dtype (Megatron's
moe_router_dtype="fp32": under bf16 a logit rounded to 8 bits flips near-tied top-k choices, and a
bf16 softmax rounds every gate), only g cast back to the activations' dtype. e_n = the top-k of
the logits (= the top-k of either gate's scores: both are monotonic), and
    gate "softmax" (Mixtral; torchtitan's route_norm):  p = softmax(logits) over all E, g_nj = p_e / Σ_j' p_e'
    gate "sigmoid" (DeepSeek-V3):                       σ = sigmoid(logits),           g_nj = σ_e / Σ_j' σ_e'
With softmax and k = 1, g = 1: the router then learns only from the aux loss (Switch keeps
g = p_e unnormalised). DeepSeek-V3's routed scale 2.5 is not implemented.

DeepSeek-V3's router (`bias_update_rate` γ > 0, `n_expert_groups` G > 1; either gate, its own is
"sigmoid"). The choice, not the gate, is biased: with s = p (softmax) or σ (sigmoid),
    e_n = top-k of s_n + b (over the experts of the top-M groups),    g_nj = s_e / Σ_j' s_e'
    group score = the sum of a group's top-2 of s + b;   M = topk_groups of the G groups
Auxiliary-loss-free balancing: after each optimizer step (`update_expert_bias`),
    b_e += γ · sign(mean_e' load_e' − load_e)        load_e = tokens that chose e this step
counted over every training forward of the step (each micro-batch) and summed over the ranks that
route different tokens (the data-parallel group), so b is the same on every rank and the same as
one device's. b = γ · n with n the int64 buffer `bias_steps` (the net ±1 steps): no dtype cast (a
bf16 model) rounds it, and every rank holds exactly the same. A recomputed forward (activation
checkpointing) counts its tokens again: a layer's loads all double, and the signs stay. A step the
fp16 scaler skips updates nothing; its loads count into the next.

Load balance (DeepSeek-V3's sequence-wise loss; Switch's f·P, per sequence). Sequence b, T tokens:
    f_bi = E/(k·T) · #{t : i ∈ top-k(t)}    (the choices before capacity drops; no gradient)
    P_bi = 1/T · Σ_t p'_ti                  p' = p (softmax gate), σ / Σ_i σ_i (sigmoid gate)
    aux  = α · 1/B · Σ_b Σ_i f_bi · P_bi    α = aux_loss_coef; perfectly balanced: aux = α
The mean over sequences decomposes over data-parallel shards (the global-batch mean is the mean of
equal shards' means); one f·P over the whole batch would not. `MoEAuxLossAutoScaler` (Megatron's)
returns the layer output unchanged and, in backward, also backpropagates scale · aux, so every MoE
layer gets its aux gradient even on a pipeline stage that never sees the loss. Its `scale` is the
layer's `aux_loss_scale`, which whoever divides the loss by the number of micro-batches sets on
every module that has one (the shared loop: 1/k; the pipeline executor: 1/m; your own loop:
`set_aux_loss_scale(model, 1/k)`; the single-device reference keeps the default 1): they look for
the attribute, never import this file, so a dense copy of them leaves it out. The reported loss
stays the cross-entropy; `aux_loss(model)` is the Σ over layers of the last forward's aux.

Capacity (capacity_factor None: dropless, the default): C = ceil(cf · T · k / E) slots per expert
per sequence, kept first come first kept in position order (t < t' ⇒ (t, j) before (t', j')). A
dropped slot contributes 0 (its g is not redistributed); the token keeps its other slots and the
residual. Per sequence, decided by the router before dispatch: the same under DP and EP.

The seams (expert parallelism replaces the dispatcher and holds a slice of the experts):
    plan = route(logits, top_k, gate, capacity_factor)     RoutingPlan: [N, k] experts, g, kept
    inputs, counts = dispatcher.dispatch(x, plan)          rows grouped by expert; counts: host ints
    outputs = experts(inputs, counts)                      a function of (inputs, counts, w1, w2, w3)
    y = dispatcher.combine(outputs, plan)                  un-permute, Σ_j g_nj · out_nj
Tokens are rows n = b·T + t of x [N, dim]. `LocalDispatcher` holds every expert. An all-to-all
dispatcher over an EP group of size ep holds experts [r·E/ep, (r+1)·E/ep) (GroupedExperts' w1/w3
[E, hidden, dim] and w2 [E, dim, hidden] sliced on dim 0), sends the rows `permute` groups by
global expert to their ranks, returns the received rows grouped by local expert with the local
counts, and sends the outputs back in combine, then `unpermute` as here; it may keep what combine
needs between the two calls (they come in pairs within one forward). Route on the whole sequence:
sequence or context parallelism would need the per-sequence sums across ranks.

Host reads: `counts.tolist()` once per MoE layer forward (dropless group sizes, and an all-to-all's
split sizes, are data-dependent; grouped-GEMM kernels with device offsets avoid it on recent GPUs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.kernel.model import routing_error


@dataclass
class RoutingPlan:
    """The router's decision for N tokens: token n's k experts `experts[n]` (global ids), their
    gate weights `weights[n]` (autograd attached, the activations' dtype) and `kept[n]` (False:
    dropped by capacity). Slot s = n·k + j."""

    experts: torch.Tensor  # [N, k] int64
    weights: torch.Tensor  # [N, k]
    kept: torch.Tensor  # [N, k] bool
    n_experts: int

    @property
    def top_k(self) -> int:
        return self.experts.shape[1]

    @cached_property
    def order(self) -> torch.Tensor:
        """All N·k slots sorted by expert, stably (by position within an expert), dropped last:
        the first Σ counts are the kept slots, grouped by expert."""
        key = torch.where(self.kept, self.experts, self.n_experts).flatten()
        return torch.sort(key, stable=True).indices

    @cached_property
    def counts(self) -> torch.Tensor:
        """[E] kept slots per expert (on the device)."""
        key = torch.where(self.kept, self.experts, self.n_experts).flatten()
        return torch.bincount(key, minlength=self.n_experts + 1)[: self.n_experts]


def capacity(capacity_factor: float, seq_len: int, top_k: int, n_experts: int) -> int:
    """C = ceil(cf · T · k / E), the factor taken as written (1.1 is 11/10: no float rounding)."""
    return math.ceil(Fraction(str(capacity_factor)) * seq_len * top_k / n_experts)


def capacity_mask(experts: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """experts [B, T, k] → kept [B, T, k]: slot (t, j) of a sequence is kept iff fewer than `cap`
    slots of earlier positions t' < t of that sequence chose the same expert."""
    B, T, k = experts.shape
    one_hot = F.one_hot(experts, n_experts).flatten(1, 2)  # [B, T·k, E], slot order (t, j)
    arrival = (one_hot.cumsum(1) * one_hot).sum(-1)  # 1-based place of the slot in its expert's queue
    return (arrival <= cap).view(B, T, k)


def sequence_balance_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """[B] per-sequence Σ_i f_bi · P_bi from p' [B, T, E] and the chosen experts [B, T, k]."""
    _, T, E = probs.shape
    k = experts.shape[-1]
    chosen = F.one_hot(experts, E).sum((1, 2)).to(probs.dtype)  # [B, E]
    f = chosen * E / (k * T)
    return (f * probs.mean(1)).sum(-1)


def limit_to_groups(scores: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """scores [..., E] → the same, -inf outside each token's `topk_groups` best of `n_groups`
    groups of E/G consecutive experts; a group's score is the sum of its top-2 (DeepSeek-V3)."""
    grouped = scores.unflatten(-1, (n_groups, -1))  # [..., G, E/G]
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    top = group_scores.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, top, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


def route(logits: torch.Tensor, top_k: int, gate: str, capacity_factor: float | None,
          dtype: torch.dtype | None = None, bias: torch.Tensor | None = None,
          groups: tuple[int, int] = (1, 1)) -> tuple[RoutingPlan, torch.Tensor]:
    """logits [B, T, E] → (the plan over N = B·T tokens, the per-sequence balance terms [B]),
    computed in float32 or better; the gate weights g in `dtype` (default: the logits'). `bias`
    [E] is added to the scores for the choice only; `groups` = (G, M): the top-k among the
    experts of each token's top M of G groups."""
    _, T, E = logits.shape
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if gate == "softmax":
        probs = scores.softmax(-1)
        normalised = probs
    elif gate == "sigmoid":
        probs = scores.sigmoid()
        normalised = probs / probs.sum(-1, keepdim=True)
    else:
        raise ValueError(f"gate={gate!r}: use 'softmax' or 'sigmoid'")
    select = scores  # the top-k of the logits = of either gate's scores (both monotonic)
    if bias is not None or groups[0] > 1:
        select = probs if bias is None else probs + bias.to(probs.dtype)
        select = select if groups[0] == 1 else limit_to_groups(select, *groups)
    experts = select.topk(top_k, dim=-1).indices  # [B, T, k]
    chosen = probs.gather(-1, experts)  # the gates: from the unbiased scores
    weights = (chosen / chosen.sum(-1, keepdim=True)).to(dtype or logits.dtype)
    kept = (torch.ones_like(experts, dtype=torch.bool) if capacity_factor is None
            else capacity_mask(experts, E, capacity(capacity_factor, T, top_k, E)))
    plan = RoutingPlan(experts.flatten(0, 1), weights.flatten(0, 1), kept.flatten(0, 1), E)
    return plan, sequence_balance_loss(normalised, experts)


def permute(x: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, list[int]]:
    """x [N, dim] → (one row per kept slot, grouped by expert [Σ counts, dim], counts as ints)."""
    counts = plan.counts.tolist()  # the layer's one host read
    return x[plan.order[: sum(counts)] // plan.top_k], counts


def unpermute(outputs: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Outputs of the kept slots, in `permute`'s order → y [N, dim] = Σ_j g_nj · out_nj (a dropped
    slot's out is 0). Un-permuted by a plain store into slot order, then summed over k per token:
    no scatter-add, so the sum order is fixed on every device."""
    N, k = plan.experts.shape
    slots = outputs.new_zeros(N * k, outputs.shape[-1])
    slots[plan.order[: outputs.shape[0]]] = outputs
    return (slots.view(N, k, -1) * plan.weights.unsqueeze(-1)).sum(1)


class LocalDispatcher:
    """Every expert on this device: dispatch = `permute`, combine = `unpermute`."""

    def dispatch(self, x: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, list[int]]:
        return permute(x, plan)

    def combine(self, expert_outputs: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        return unpermute(expert_outputs, plan)


def grouped_swiglu(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert (counts[i] rows for expert i, possibly 0) → each group through its
    expert: W2_i (silu(W1_i x) ⊙ W3_i x). Every expert runs, an empty one on 0 rows, so every
    weight gets a gradient (zeros for an expert without tokens)."""
    outs = [F.linear(F.silu(F.linear(xi, a)) * F.linear(xi, c), b)
            for xi, a, b, c in zip(x.split(counts), w1.unbind(0), w2.unbind(0), w3.unbind(0), strict=True)]
    return torch.cat(outs)


class GroupedExperts(nn.Module):
    """E expert SwiGLUs as stacked weights (torchtitan's shapes): w1, w3 [E, hidden, dim], w2
    [E, dim, hidden]. Expert parallelism keeps a slice of dim 0 (this module with E/ep experts)."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return grouped_swiglu(x, counts, self.w1, self.w2, self.w3)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Megatron's trick: forward returns `output`; backward passes its gradient through and gives
    `aux_loss` the gradient `scale` (as if scale · aux_loss were added to the loss). Unlike
    Megatron's class-wide scale, the scale is an argument, fixed at forward."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_shape = scale, aux_loss.shape
        ctx.aux_dtype, ctx.aux_device = aux_loss.dtype, aux_loss.device
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device)
        return grad_output, aux_grad, None


class MoEFeedForward(nn.Module):
    """The MoE feed-forward: router → plan → dispatch → experts → combine (+ the shared expert),
    the aux loss attached to the output by MoEAuxLossAutoScaler. x [B, T, dim] → [B, T, dim].
    `dispatcher` is the seam expert parallelism swaps (like Attention.attend for CP)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int, gate: str = "softmax",
                 aux_loss_coef: float = 0.0, capacity_factor: float | None = None,
                 shared_expert: nn.Module | None = None, bias_update_rate: float = 0.0,
                 n_expert_groups: int = 1, topk_groups: int = 1):
        super().__init__()
        if (error := routing_error(n_experts, top_k, n_expert_groups, topk_groups)) is not None:
            raise ValueError(error)
        self.top_k, self.gate = top_k, gate
        self.aux_loss_coef, self.capacity_factor = aux_loss_coef, capacity_factor
        self.bias_update_rate, self.groups = bias_update_rate, (n_expert_groups, topk_groups)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, hidden_dim)
        self.shared_expert = shared_expert
        self.dispatcher: LocalDispatcher = LocalDispatcher()
        self.aux_loss_scale = 1.0  # set_aux_loss_scale: 1/(micro-batches the loss is divided by)
        self.last_aux_loss: torch.Tensor | None = None  # detached, for reports
        self.last_tokens_per_expert: torch.Tensor | None = None  # [E] choices before drops
        self.step_load: torch.Tensor | None = None  # [E] choices of this step's training forwards
        if bias_update_rate:  # on the CPU even under the meta device: nothing to materialize
            self.register_buffer("bias_steps", torch.zeros(n_experts, dtype=torch.int64, device="cpu"))

    @property
    def expert_bias(self) -> torch.Tensor | None:
        """b = γ · bias_steps [E] (float64), None without the bias."""
        return self.bias_steps.double() * self.bias_update_rate if self.bias_update_rate else None

    def route(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[RoutingPlan, torch.Tensor]:
        """`route` with this layer's settings and bias; counts the choices (step_load in training)."""
        if self.bias_update_rate and self.bias_steps.device != logits.device:
            self.bias_steps = self.bias_steps.to(logits.device)  # built on the CPU
        plan, balance = route(logits, self.top_k, self.gate, self.capacity_factor, dtype,
                              self.expert_bias, self.groups)
        chosen = torch.bincount(plan.experts.flatten(), minlength=plan.n_experts)
        self.last_tokens_per_expert = chosen
        if self.bias_update_rate and torch.is_grad_enabled():
            self.step_load = chosen if self.step_load is None else self.step_load + chosen
        return plan, balance

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        router_dtype = torch.promote_types(x.dtype, torch.float32)  # bf16 activations: fp32 logits
        logits = F.linear(x.to(router_dtype), self.router.weight.to(router_dtype))
        plan, balance = self.route(logits, x.dtype)
        flat = x.reshape(B * T, D)
        inputs, counts = self.dispatcher.dispatch(flat, plan)
        y = self.dispatcher.combine(self.experts(inputs, counts), plan)
        if self.shared_expert is not None:
            y = y + self.shared_expert(flat)
        y = y.view(B, T, D)
        aux = self.aux_loss_coef * balance.mean()
        self.last_aux_loss = aux.detach()
        if self.aux_loss_coef and torch.is_grad_enabled():
            y = MoEAuxLossAutoScaler.apply(y, aux, self.aux_loss_scale)
        return y


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Every MoE layer of `model` (a wrapper, a pipeline chunk) backpropagates scale · its aux
    loss: the factor its caller divides each micro-batch's loss by (1/k, 1/m; 1 on one device)."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = scale


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Σ over the MoE layers of the last forward's aux loss (detached), None without MoE layers."""
    values = [m.last_aux_loss for m in moe_layers(model) if m.last_aux_loss is not None]
    return torch.stack(values).sum() if values else None


def update_expert_bias(model: nn.Module, data_group=None) -> None:
    """After an optimizer step, every MoE layer of `model` with γ > 0: b_e += γ·sign(mean − load_e),
    the loads of this step's training forwards summed over `data_group` (the ranks that route
    other tokens: DP, EP; not TP, whose ranks route the same ones) in one all-reduce; None: one
    device. Every rank of the group calls it with the same layers (one pipeline stage's); a step
    with no training forward (an lr-0 step that builds the optimizer's state) changes nothing."""
    layers = [m for m in moe_layers(model) if m.bias_update_rate]
    counted = [m.step_load for m in layers if m.step_load is not None]
    if not counted:  # no training forward since the last update (the ranks of a group agree)
        return
    loads = torch.stack([counted[0].new_zeros(counted[0].shape) if m.step_load is None else m.step_load
                         for m in layers])
    if data_group is not None:
        dist.all_reduce(loads, group=data_group)
    E = loads.shape[-1]
    step = torch.sign(loads.sum(-1, keepdim=True) - E * loads)  # sign(mean − load), exactly in int64
    for m, s in zip(layers, step, strict=True):
        m.bias_steps += s.to(m.bias_steps.device)
        m.step_load = None


def update_bias_after_each_step(optimizer: torch.optim.Optimizer, model: nn.Module, data_group=None):
    """`update_expert_bias(model, data_group)` after every `optimizer.step()` (a step post-hook);
    returns the hook's handle. Nothing to do without a layer with γ > 0."""
    return optimizer.register_step_post_hook(lambda *_: update_expert_bias(model, data_group))


def active_parameters(model: nn.Module) -> int:
    """Parameters a token runs through: all, less the (E - k) routed experts it skips per layer."""
    total = sum(p.numel() for p in model.parameters())
    for m in moe_layers(model):
        E = m.experts.w1.shape[0]
        total -= sum(p.numel() for p in m.experts.parameters()) * (E - m.top_k) // E
    return total
