"""Lab 05 · experts: write expert parallelism's all-to-alls and its gradient reduction.

You write the mechanism of the lesson's "Expert parallelism" page (expert_parallel.py is the
chapter's own). A MoE layer's E experts are split over an EP group of ep ranks: rank r holds the
*local* experts [r·E/ep, (r+1)·E/ep) (`expert_parallel` below does the split, given); its router,
shared expert and every other parameter are replicated. Each rank routes its own tokens
(common.kernel.moe: `route` gives a RoutingPlan, `permute` groups the kept slots by global expert, as
rows [Σ counts, dim] and counts [E] host ints). Then, in the layer's dispatcher:

    exchange_counts   all-to-all of the counts: received[s][e] = rows rank s sends my local expert e
    dispatch          rows to their expert's rank: all-to-all with splits
                          in_splits[q]  = Σ counts of rank q's experts        (what I send q)
                          out_splits[s] = Σ_e received[s][e]                 (what s sends me)
                      the rows arrive source-major (all of rank 0's, then rank 1's, …); regroup
                      them expert-major (local expert 0's rows from every source, then 1's, …),
                      as the local experts read them, with the local counts
    combine           the outputs back: undo the regrouping, all-to-all with the splits swapped,
                      then `unpermute` as on one device
    AllToAll          autograd: the backward of an all-to-all is the all-to-all with its splits
                      swapped, so the gradient of a row goes back to the rank that sent it

NCCL's rules (the grader checks your plan before it runs anything, common/kernel/a2a_plan.py): every rank
of the group posts every all-to-all, in the same order, even one by which it sends and receives
no row (skipping it hangs the others); what rank q sends p is what p expects from q; the counts
tensor is made on the rank's device (device=x.device) and the splits are host ints.

The gradients, with data parallelism over the world of n ranks (each rank its slice of the batch,
its loss the mean over it) and EP groups inside it: a replicated parameter's gradient is this
rank's own, averaged by an all-reduce over the world ÷ n; an expert's already sums the tokens
every rank of its EP group sent it, and its copies on the other EP groups (the ranks that hold the
same experts: `expert_group`) hold the rest: all-reduce over those ÷ n, the world's size. What EP
is for: each token's row travels to its expert's rank and back, once, so a rank sends exactly the
rows its routing sends away (the grader counts the bytes).

Tools: `dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes, group=group)`;
`torch.tensor(counts, dtype=torch.int64, device=...)`, `.tolist()`; `permute`, `unpermute` (below);
`torch.argsort` (the inverse of a permutation); `dist.all_reduce(t, op=dist.ReduceOp.SUM, group=…)`.

Check your work: `make lab-check N=5 LAB=expert` (from the repo root), or `grade(5, lab="expert")`
in the notebook. It runs a MoE layer on 4 ranks as two EP groups of 2 and as one of 4, with a
routing that sends some rank no token, and a small MoE LLaMA with data parallelism over 4 ranks
and EP 2, against one device in float64. Only this file is yours to edit; keep the names and
signatures.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.moe import GroupedExperts, MoEFeedForward, RoutingPlan, moe_layers, permute, unpermute  # noqa: F401


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
    """`counts` [E] (int64, on the rank's device): the rows this rank sends each global expert.
    Returns received[s][e] (host ints, ep × E/ep): the rows rank s sends my local expert e."""
    raise NotImplementedError("exchange_counts: one all-to-all of the count vector, then read it on the host")


class AllToAll(torch.autograd.Function):
    """Rows x [Σ in_splits, dim] → [Σ out_splits, dim]: in_splits[q] rows to rank q, out_splits[q]
    rows from rank q. Backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        raise NotImplementedError("AllToAll.forward: all_to_all_single with the splits; keep them")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise NotImplementedError("AllToAll.backward: the all-to-all with in- and out-splits swapped")


class ExpertDispatcher:
    """The MoE layer's dispatcher seam (common/kernel/moe.py's LocalDispatcher does both on one device)
    over an EP group; dispatch and combine come in pairs within one forward."""

    def __init__(self, group, n_experts: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.local = n_experts // self.ep
        self.state = None  # what combine needs from dispatch

    def dispatch(self, x: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, list[int]]:
        """x [N, dim] → (the rows of every source for my local experts, expert-major; the local
        counts [E/ep] as host ints)."""
        raise NotImplementedError("ExpertDispatcher.dispatch: permute, the counts, all-to-all, regroup")

    def combine(self, outputs: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        """The local experts' outputs (dispatch's order) → y [N, dim] for this rank's tokens."""
        raise NotImplementedError("ExpertDispatcher.combine: undo the regrouping, all-to-all back, unpermute")


def reduce_gradients(model: nn.Module, expert_group, group=None) -> None:
    """After backward, every gradient the average over the world's ranks: replicated parameters
    over `group`, experts (parameters named …experts…) over `expert_group`; ÷ the world's size."""
    raise NotImplementedError("reduce_gradients: all-reduce each gradient over its group, divide by n")
