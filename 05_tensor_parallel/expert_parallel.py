"""Expert parallelism: the E experts of a MoE layer split over an EP group of `ep` ranks, tokens
sent to the rank holding their expert with an all-to-all, and the outputs sent back.

Rank r holds experts [r·E/ep, (r+1)·E/ep) (each rank's router, shared expert and every other
parameter are replicated, as under data parallelism: each rank routes its own tokens). One layer:

    rows, counts = permute(x, plan)                 kept slots grouped by global expert, counts [E]
    all-to-all(counts)                              recv[s][e] = rows rank s sends to my expert e
    all-to-all(rows; splits out = Σ_e counts of rank q's experts, in = Σ_e recv[s][e])
    regroup the received rows (source-major) by local expert (expert-major) → local experts
    … and back: un-regroup, all-to-all with the splits swapped, `unpermute` as on one device.

Autograd: the backward of an all-to-all is the all-to-all with in- and out-splits swapped
(`_AllToAll`), so the gradient of a row comes back to the rank that sent it. A rank may send or
receive no row (every split 0); each expert still runs, on 0 rows, and gets a zero gradient.

The host syncs: two per MoE layer forward, none in backward (the splits are kept). `permute` reads
the routing counts (as on one device), and the count exchange's result is read (`.tolist()`) to
size the receive buffer and the token all-to-all's splits: on NCCL, a device→host copy after the
collective (tests/test_moe_expert_parallel_plan.py counts them). gloo would accept host
splits computed any way; NCCL needs them on the host before the call and the counts tensor on the
rank's device. Every rank of the group calls the same collectives in the same order: two
all-to-alls per forward (counts, rows) and one more in combine, the reverse one in backward.

Gradients: with each rank's loss a sum over its own tokens, the expert gradients are complete on
their rank (every token that chose the expert, from every rank, backpropagated into it); the
replicated parameters' gradients are partial sums to all-reduce over the group, as under DP.

Load: each layer's all-to-all waits for the rank whose experts got the most rows, so a step's
imbalance is its worst dispatch's max/mean rows over the group (`load_imbalance`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.moe import GroupedExperts, MoEFeedForward, RoutingPlan, moe_layers, permute, unpermute


def is_expert(name: str) -> bool:
    """A routed expert's stacked weights (…feed_forward.experts.w1/w2/w3): what EP splits."""
    return ".experts." in name


def expert_slice(ep_rank: int, ep: int, n_experts: int) -> slice:
    """The experts rank `ep_rank` of an EP group of `ep` ranks holds: [r·E/ep, (r+1)·E/ep)."""
    local = n_experts // ep
    return slice(ep_rank * local, (ep_rank + 1) * local)


class _AllToAll(torch.autograd.Function):
    """Rows x [Σ in_splits, dim] → [Σ out_splits, dim]: in_splits[q] rows to rank q, out_splits[q]
    rows from rank q. Backward: the same call with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty(sum(out_splits), x.shape[1])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_in = grad.new_empty(sum(ctx.in_splits), grad.shape[1])
        dist.all_to_all_single(grad_in, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows of x out by `in_splits` to each rank of `group`, `out_splits` rows in from each (autograd:
    the gradient goes back the same way). Not dist.all_to_all, which takes lists of tensors."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatcher:
    """The MoE layer's dispatcher seam (common/kernel/moe.py) over an EP group; dispatch and combine come
    in pairs within one forward, so dispatch keeps the splits and the regrouping for combine."""

    def __init__(self, group, n_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.local = n_experts // self.ep
        self._state: tuple[list[int], list[int], torch.Tensor] | None = None

    def dispatch(self, x: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, list[int]]:
        rows, counts = permute(x, plan)  # grouped by global expert = by destination rank
        send = torch.tensor(counts, dtype=torch.int64, device=x.device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # [ep · local]: source-major
        received = recv.view(self.ep, self.local).tolist()  # the host sync (see the docstring)
        in_splits = [sum(counts[expert_slice(q, self.ep, len(counts))]) for q in range(self.ep)]
        out_splits = [sum(row) for row in received]
        arrived = all_to_all_rows(rows, out_splits, in_splits, self.group)
        starts, at = [], 0  # where rows (source s, local expert e) begin in `arrived`
        for row in received:
            starts.append([])
            for n in row:
                starts[-1].append(at)
                at += n
        order = [torch.arange(starts[s][e], starts[s][e] + received[s][e], device=x.device)
                 for e in range(self.local) for s in range(self.ep)]
        regroup = torch.cat(order)
        self._state = (in_splits, out_splits, regroup)
        local_counts = [sum(received[s][e] for s in range(self.ep)) for e in range(self.local)]
        return arrived[regroup], local_counts

    def combine(self, expert_outputs: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        if self._state is None:
            raise RuntimeError("AllToAllDispatcher.combine without a dispatch before it")
        in_splits, out_splits, regroup = self._state
        self._state = None
        source_major = expert_outputs[torch.argsort(regroup)]
        returned = all_to_all_rows(source_major, in_splits, out_splits, self.group)
        return unpermute(returned, plan)


class CountingDispatcher(AllToAllDispatcher):
    """The all-to-all dispatcher, logging per dispatch from the routing counts (A, B, rows): the
    rows this rank sends to the other EP ranks, the rows it receives, the rows its experts process
    (for the reports' byte formula and load imbalance; `log` is emptied by whoever reads it)."""

    def __init__(self, group, n_experts: int):
        super().__init__(group, n_experts)
        self.mine = expert_slice(dist.get_rank(group), self.ep, n_experts)
        self.log: list[tuple[int, int, int]] = []

    def dispatch(self, x: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, list[int]]:
        counts = plan.counts.tolist()
        rows, local_counts = super().dispatch(x, plan)
        own = sum(counts[self.mine])
        self.log.append((sum(counts) - own, sum(local_counts) - own, sum(local_counts)))
        return rows, local_counts


def all_to_all_bytes(sent: int, received: int, dim: int, e: int, ep: int, n_experts: int,
                     backward: bool = True) -> float:
    """Wire bytes one rank sends for one dispatch + combine: the count exchange (ep-1)/ep · E · 8
    (int64), `sent` rows of dim·e bytes out (dispatch) and `received` back (combine); their
    backward sends the same rows again the other way: (1 + backward)·(A + B)·dim·e + counts."""
    counts = (ep - 1) / ep * n_experts * 8
    return counts + (2 if backward else 1) * (sent + received) * dim * e


def load_imbalance(rows: torch.Tensor, ep: int) -> torch.Tensor:
    """rows [steps, dispatches, ranks]: the rows each rank's experts took in each dispatch (one per
    MoE layer and micro-batch; EP groups: ep consecutive ranks) → per step, the max over
    dispatches and groups of max/mean over the group. Each layer's all-to-all waits for its
    slowest rank, so a step is as slow as its worst dispatch: rows summed over a step's layers
    would average the stragglers out."""
    grouped = rows.unflatten(-1, (-1, ep))
    return (grouped.amax(-1) / grouped.mean(-1).clamp_min(1e-300)).flatten(1).amax(-1)


def expert_parallel(model: nn.Module, group, dispatcher: type[AllToAllDispatcher] = AllToAllDispatcher
                    ) -> list[MoEFeedForward]:
    """Every MoE layer of `model` (a model, a block or a layer) keeps only this rank's experts
    [r·E/ep, (r+1)·E/ep) and dispatches by all-to-all over `group` (a `dispatcher`(group, E):
    AllToAllDispatcher or a subclass), in place. Checks before any collective: E divisible by the
    group's size."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = [model] if isinstance(model, MoEFeedForward) else moe_layers(model)
    for layer in layers:
        E = layer.experts.w1.shape[0]
        if E % ep:
            raise ValueError(f"{E} experts do not split over an expert-parallel group of {ep} ranks: "
                             f"use an EP size that divides {E}")
    for layer in layers:
        full = layer.experts
        E, mine = full.w1.shape[0], expert_slice(rank, ep, full.w1.shape[0])
        local = GroupedExperts(E // ep, full.w1.shape[2], full.w1.shape[1]).to(full.w1)
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                getattr(local, name).copy_(getattr(full, name)[mine])
        layer.experts = local
        layer.dispatcher = dispatcher(group, E)
    return layers
