"""Lab 05 · experts, the reference: the count exchange, dispatch and combine by all-to-all, and the
expert-gradient reduction.

`make lab-check N=5 LAB=expert SOLUTION=1` grades this file with the same properties as your
lab_expert.py. Read it after you have passed them, or when you are stuck for good.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.moe import GroupedExperts, MoEFeedForward, RoutingPlan, moe_layers, permute, unpermute


def expert_parallel(model: nn.Module, group, dispatcher_class) -> None:
    """Every MoE layer of `model` (or `model` itself) keeps this rank's experts [r·E/ep, (r+1)·E/ep)
    and dispatches with `dispatcher_class(group, E)`, in place (given)."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    for layer in [model] if isinstance(model, MoEFeedForward) else moe_layers(model):
        E, full = layer.experts.w1.shape[0], layer.experts
        if E % ep:
            raise ValueError(f"{E} experts do not split over an expert-parallel group of {ep} ranks")
        lo, hi = rank * E // ep, (rank + 1) * E // ep
        layer.experts = GroupedExperts(hi - lo, full.w1.shape[2], full.w1.shape[1]).to(full.w1)
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                getattr(layer.experts, name).copy_(getattr(full, name)[lo:hi])
        layer.dispatcher = dispatcher_class(group, E)


def exchange_counts(counts: torch.Tensor, group) -> list[list[int]]:
    """One all-to-all of the count vector: rank q gets counts[q·local : (q+1)·local] of every rank."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received.view(ep, -1).tolist()  # the host read: the splits must be on the host


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty(sum(out_splits), x.shape[1])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.in_splits), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


class ExpertDispatcher:
    def __init__(self, group, n_experts: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.local = n_experts // self.ep
        self.state = None  # what combine needs from dispatch

    def dispatch(self, x: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, list[int]]:
        rows, counts = permute(x, plan)  # grouped by global expert = by destination rank
        received = exchange_counts(torch.tensor(counts, dtype=torch.int64, device=x.device), self.group)
        in_splits = [sum(counts[q * self.local : (q + 1) * self.local]) for q in range(self.ep)]
        out_splits = [sum(row) for row in received]
        arrived = AllToAll.apply(rows, out_splits, in_splits, self.group)  # source-major
        starts = list(itertools.accumulate(out_splits, initial=0))  # host arithmetic, no tensor
        order = [torch.arange(starts[s] + sum(received[s][:e]), starts[s] + sum(received[s][: e + 1]),
                              device=x.device) for e in range(self.local) for s in range(self.ep)]
        regroup = torch.cat(order)  # expert-major
        self.state = (in_splits, out_splits, regroup)
        return arrived[regroup], [sum(received[s][e] for s in range(self.ep)) for e in range(self.local)]

    def combine(self, outputs: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        in_splits, out_splits, regroup = self.state
        self.state = None
        back = AllToAll.apply(outputs[torch.argsort(regroup)], in_splits, out_splits, self.group)
        return unpermute(back, plan)


def reduce_gradients(model: nn.Module, expert_group, group=None) -> None:
    """Every gradient is the average over the world's ranks' losses: a replicated parameter's over
    `group` (the world), an expert's over `expert_group` (the ranks holding the same experts); ÷ n."""
    n = dist.get_world_size(group)
    for name, p in model.named_parameters():
        if p.grad is not None:
            over = expert_group if ".experts." in name else group
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=over)
            p.grad.div_(n)
