"""Lab 05, the reference: Megatron's f and g, column- and row-parallel linears, the tensor-parallel
SwiGLU MLP and attention, and the two optional extras (sequence parallelism's pair, the merge of
two partial attention results).

`make lab-check N=5 SOLUTION=1` grades this file with the same properties as your lab.py. Read it
after you have passed them, or when you are stuck for good.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def all_gather_along(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order."""
    n = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0], *front.shape[1:]))
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, front, group=group)
    return out.movedim(0, dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The sum of every rank's `x`, of which this rank keeps its 1/t slice along `dim`."""
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
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_gather_along(y, -1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=-1)[r].contiguous(), None


def copy_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    return ReduceFromTP.apply(x, group)


def gather_from_tp_region(y: torch.Tensor, group=None) -> torch.Tensor:
    return GatherFromTP.apply(y, group)


# --- 2 · the parallel linears ---------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, group=None, gather_output: bool = False,
                 input_is_mapped: bool = False):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        if linear.out_features % t:
            raise ValueError(f"out_features={linear.out_features} is not divisible by the TP size {t}")
        self.group, self.gather_output, self.input_is_mapped = group, gather_output, input_is_mapped
        rows = slice(r * linear.out_features // t, (r + 1) * linear.out_features // t)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_mapped:
            x = copy_to_tp_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        if linear.in_features % t:
            raise ValueError(f"in_features={linear.in_features} is not divisible by the TP size {t}")
        self.group = group
        cols = slice(r * linear.in_features // t, (r + 1) * linear.in_features // t)
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


# --- 3 · the MLP and attention --------------------------------------------------------------------

def _f_on_input(group):
    """A forward pre-hook: f on the module's first argument, once per sub-layer."""
    return lambda module, args: (copy_to_tp_region(args[0], group), *args[1:])


def parallelize_mlp(mlp: nn.Module, group=None) -> nn.Module:
    mlp.w1 = ColumnParallelLinear(mlp.w1, group, input_is_mapped=True)
    mlp.w3 = ColumnParallelLinear(mlp.w3, group, input_is_mapped=True)
    mlp.w2 = RowParallelLinear(mlp.w2, group)
    mlp.register_forward_pre_hook(_f_on_input(group))
    return mlp


def parallelize_attention(attention: nn.Module, group=None) -> nn.Module:
    for name in ("wq", "wk", "wv"):
        setattr(attention, name, ColumnParallelLinear(getattr(attention, name), group, input_is_mapped=True))
    attention.wo = RowParallelLinear(attention.wo, group)
    attention.register_forward_pre_hook(_f_on_input(group))
    return attention


# --- 4 · optional: sequence parallelism's pair ----------------------------------------------------

class GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    return GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    return ReduceScatterToSequence.apply(x, group, dim)


# --- 5 · optional: ring attention's merge ---------------------------------------------------------

def merge_attention(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                    lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logaddexp(lse1, lse2)
    out = torch.exp(lse1 - lse)[..., None] * out1 + torch.exp(lse2 - lse)[..., None] * out2
    return out, lse
