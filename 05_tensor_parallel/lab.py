"""Lab 05: write tensor parallelism's pieces, from Megatron's f and g up to a parallel LLaMA block.

You write the mechanism of README "The conjugate operators f and g". t ranks compute one layer
together, each holding 1/t of its weights. Two operators mark where a tensor-parallel region
starts and ends (Shoeybi et al. 2019):

    f  identity forward, all-reduce (sum) backward   where a replicated X enters: dL/dX = Σ_r dL_r/dX
    g  all-reduce (sum) forward, identity backward   where partial outputs leave:    Y = Σ_r Y_r

With torch's linear Y = X Aᵀ + b (A stored as [out, in]):

    column-parallel   rank r owns output features [r·out/t, (r+1)·out/t):  Y_r = f(X) A_rᵀ + b_r
                      (Y stays split, or `gather_output` all-gathers it along the last dim)
    row-parallel      rank r owns input features  [r·in/t, (r+1)·in/t):    Y = g(X_r A_rᵀ) + b
                      (X_r: this rank's slice of X's last dim, what a column layer leaves)

Megatron's MLP is column then row: the element-wise activation runs on the split features, so
one g per MLP forward and one f backward. LLaMA's SwiGLU W2(silu(W1 x) ⊙ W3 x) has two column
layers (W1, W3) reading the same x: apply f once to x, not once per layer. Attention: wq, wk, wv
column (whole heads per rank), wo row.

Tools (all in torch):
- a `torch.autograd.Function`: `forward(ctx, ...)` and `backward(ctx, grad)`, which returns one
  gradient per input of forward (None for the group); keep what backward needs on `ctx`.
- `dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)` sums in place on every rank (never
  ReduceOp.AVG); `dist.get_world_size(group)`, `dist.get_rank(group)`.
- `all_gather_along` / `reduce_scatter_along` below (given).
- `module.register_forward_pre_hook(hook)`: hook(module, args) runs before forward and may return
  new args (a tuple).

Check your work: `make lab-check N=5` (from the repo root), or `grade(5)` in the notebook. It runs
each piece on 4 ranks, as two TP groups of 2 and as one of 4 (so use the `group` you are given,
never the whole world), in float64, compares outputs and gradients with one device, counts the
collectives, checks that a split the group does not divide is refused, then trains a 2-layer
LLaMA built from your pieces against one device. Parts 4 and 5
are optional: the grader reports them but passes the lab without them. Only this file is yours to
edit; keep the names and signatures.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: F401  (you will want F.linear)
from torch import nn


def all_gather_along(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (given)."""
    n = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0], *front.shape[1:]))
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, front, group=group)
    return out.movedim(0, dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The sum of every rank's `x`, of which this rank keeps its 1/t slice along `dim` (given)."""
    n = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, front, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim)


# --- 1 · f and g ----------------------------------------------------------------------------------

class CopyToTP(torch.autograd.Function):
    """f: identity forward; backward all-reduces (sums) the gradient over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        raise NotImplementedError("f (CopyToTP.forward): identity; keep the group for backward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise NotImplementedError("f (CopyToTP.backward): the gradient summed over the group")


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        raise NotImplementedError("g (ReduceFromTP.forward): x summed over the group")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise NotImplementedError("g (ReduceFromTP.backward): identity")


class GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward (the full Y from each rank's Y_r, in rank order).
    Backward: every rank computed the same loss from the same gathered Y; what does rank r's
    Y_r get?"""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group) -> torch.Tensor:
        raise NotImplementedError("GatherFromTP.forward: all-gather along the last dim")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise NotImplementedError("GatherFromTP.backward: the gradient of this rank's Y_r")


def copy_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return ReduceFromTP.apply(x, group)


def gather_from_tp_region(y: torch.Tensor, group=None) -> torch.Tensor:
    return GatherFromTP.apply(y, group)


# --- 2 · the parallel linears ---------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """Built from the full `linear` (the same numbers on every rank): rank r keeps the part of
    its weight and bias that computes output features [r·out/t, (r+1)·out/t).

        forward(X) = f(X) A_rᵀ + b_r          (f skipped when `input_is_mapped`: the caller
                                                applied it once for several layers)
        gather_output=True: all-gather Y along the last dim (every rank gets the full Y)

    Parameters: `self.weight` and `self.bias` (None when the linear has none). When the group's
    size t does not divide out_features, raise ValueError naming both, before any collective."""

    def __init__(self, linear: nn.Linear, group=None, gather_output: bool = False,
                 input_is_mapped: bool = False):
        super().__init__()
        self.group, self.gather_output, self.input_is_mapped = group, gather_output, input_is_mapped
        raise NotImplementedError("ColumnParallelLinear.__init__: this rank's weight and bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("ColumnParallelLinear.forward: f, the local linear, the optional gather")


class RowParallelLinear(nn.Module):
    """Built from the full `linear`: rank r keeps the part of its weight that reads input
    features [r·in/t, (r+1)·in/t), and the whole bias.

        forward(X_r) = g(X_r A_rᵀ) + b        X_r: this rank's slice of the input's last dim

    Parameters: `self.weight` and `self.bias` (None when the linear has none). When the group's
    size t does not divide in_features, raise ValueError naming both, before any collective."""

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        self.group = group
        raise NotImplementedError("RowParallelLinear.__init__: this rank's weight, the bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("RowParallelLinear.forward: the local linear, g, the bias")


# --- 3 · the MLP and attention --------------------------------------------------------------------

def parallelize_mlp(mlp: nn.Module, group=None) -> nn.Module:
    """In place: LLaMA's SwiGLU `mlp` (w1, w2, w3 linears; forward w2(silu(w1 x) * w3 x)) made
    tensor-parallel: swap its three linears for parallel ones (keep the names), and see that its
    input goes through f exactly once. Return it. Its forward is unchanged."""
    raise NotImplementedError("parallelize_mlp: w1, w3 column; w2 row; f once on the input")


def parallelize_attention(attention: nn.Module, group=None) -> nn.Module:
    """In place: LLaMA's attention (wq, wk, wv, wo linears; forward(x, cos, sin)) made
    tensor-parallel, each rank holding whole heads. Its forward reads the number of heads from
    the projections' shapes, so it runs unchanged on a rank's heads. Return it."""
    raise NotImplementedError("parallelize_attention: wq, wk, wv column; wo row; f once on x")


# --- 4 · optional: sequence parallelism's pair ----------------------------------------------------
# Between the TP regions each rank holds s/t tokens (dim 1 of [B, T, H]). sequence_parallel.md
# (05.2): g's all-reduce splits into its two halves. Each one's backward is the other.

def gather_from_sequence_parallel_region(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Forward: every rank's s/t tokens → all s tokens (all-gather along `dim`). Backward: every
    rank used all the tokens; what does rank r's slice get?"""
    raise NotImplementedError("gather_from_sequence_parallel_region (an autograd Function)")


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Forward: the sum of every rank's partial x (all s tokens), of which this rank keeps its
    s/t tokens along `dim`. Backward: the gradient of x, given the gradient of this rank's slice."""
    raise NotImplementedError("reduce_scatter_to_sequence_parallel_region (an autograd Function)")


# --- 5 · optional: ring attention's merge ---------------------------------------------------------

def merge_attention(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                    lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same queries attended to two disjoint sets of keys: out_i [..., T, d] = softmax over
    set i's keys of the scores, times its values; lse_i [..., T] = log Σ_{k in set i} exp(score)
    (−inf where a query saw no key of set i, its out_i row then 0). Return (out, lse) over both
    sets together, exactly (context_parallel.md, 05.3). Scores may be in the thousands."""
    raise NotImplementedError("merge_attention: the log-sum-exp rule")
