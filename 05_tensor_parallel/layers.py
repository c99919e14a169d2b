"""The parallel layers: column- and row-parallel linears, the vocab-parallel embedding, and the
RMSNorm of a sequence-parallel region. Each is built from the full (reference) module's weights,
so a rank's shard is a slice of the very numbers the single-device model starts from.

torch stores a linear's weight as A = [out, in] and computes Y = X Aᵀ. Split over t ranks:

    ColumnParallelLinear: rows of A (output features)     RowParallelLinear: columns of A (inputs)
        ┌──── A_0 ────┐ rank 0                               ┌─────┬─────┬─────┐
        ├──── A_1 ────┤ rank 1       Y_i = X A_iᵀ            │ A_0 │ A_1 │ ... │   Y = Σ_i X_i A_iᵀ
        └──── ... ────┘              (no communication)      └─────┴─────┴─────┘   (one all-reduce)

A column layer followed by a row layer needs no communication between them (Y_i feeds X_i):
Megatron's MLP, Y = GeLU(X A_i) B_i summed by one all-reduce. Every layer takes the TP `group`.

The names are Megatron's, and so are the arguments' meanings: `gather_output` all-gathers Y (else
rank i keeps Y_i), `input_is_parallel` says X arrives already split along its last dim (else the
layer keeps its slice), `sequence_parallel` all-gathers the s/t tokens of the input (column) or
reduce-scatters the output over them (row; it needs input_is_parallel, as in Megatron). A
sequence-parallel column layer saves its input's local s/t tokens, not the gathered s, and
gathers them again in backward while it computes dx (Megatron's
LinearWithGradAccumulationAndAsyncCommunication): `linear_with_sequence_gather`.
input_is_parallel defaults to True (the output of a column layer; Megatron-core makes you say it,
Megatron 1 defaulted to False): a full-width X then fails on its shape, never silently. forward
returns the output tensor like nn.Linear (Megatron 1's contract; Megatron-core returns (output,
bias) for its skip_bias_add fusion, which we do not have). Ours also pads a vocab t does not
divide, and `input_is_mapped` (our name) lets several column layers share one input mapping.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .mappings import (
    copy_to_tp_region,
    gather_for_column_parallel,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    sum_among_replicas,
)
from .sharding import TPShard, group_rank, group_size


def _shard_rows(full: torch.Tensor, index: int, rows: int) -> torch.Tensor:
    """Rows [index·rows, (index+1)·rows) of `full`, zero-padded past its end."""
    out = full.new_zeros((rows, *full.shape[1:]))
    part = full[index * rows:(index + 1) * rows]
    out[:part.shape[0]] = part
    return out


class _SequenceParallelLinear(torch.autograd.Function):
    """y = x Wᵀ + b where x = all-gather(x_local) over the sequence. Saves x_local (s/t tokens)
    and W; backward: start the all-gather of x_local, dx = dy W while it runs, then dW = dyᵀ x
    (x's gradient goes on to the gather's reduce-scatter, summed over the layers that read it).
    A zero-bubble split backward (chapter 06's backward_split) runs it twice, setting
    `split_backward`: "input" computes only dx (no gather), "weight" only dW."""

    @staticmethod
    def forward(ctx, x, local, weight, bias, gather):
        gather.readers += 1
        ctx.gather, ctx.has_bias, ctx.split_backward = gather, bias is not None, None
        ctx.save_for_backward(local, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        local, weight = ctx.saved_tensors
        want_dx = ctx.needs_input_grad[0] and ctx.split_backward != "weight"
        if ctx.split_backward == "input":
            return (dy.matmul(weight) if want_dx else None), None, None, None, None
        ctx.gather.start(local)
        dx = dy.matmul(weight) if want_dx else None
        x = ctx.gather.wait()
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = dy2.t().matmul(x.reshape(-1, x.shape[-1]))
        db = dy2.sum(0) if ctx.has_bias else None
        return dx, None, dw, db, None


def linear_with_sequence_gather(x: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear on the output of `gather_for_column_parallel`, saving only its local slice."""
    carried = getattr(x, "sequence_gather", None)
    if carried is None:
        raise ValueError("a sequence-parallel column layer with input_is_mapped=True reads the output "
                         "of gather_for_column_parallel (it carries the local s/t tokens the layer "
                         "saves); gather_from_sequence_parallel_region's output does not")
    local, gather = carried
    return _SequenceParallelLinear.apply(x, local, weight, bias, gather)


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_iᵀ with A_i = rows [i·o/t, (i+1)·o/t) of the full weight.

    Input mapping (once per layer, unless `input_is_mapped`): Megatron's f (copy; backward
    all-reduce), or with `sequence_parallel` the all-gather of the s/t tokens (backward
    reduce-scatter), after which the layer saves only the s/t tokens and gathers them again in
    backward. `input_is_mapped=True` when the caller did it once for several layers reading
    the same input (Q, K, V; gate and up): with `sequence_parallel`, by gather_for_column_parallel.
    `gather_output` all-gathers Y (else Y stays split).
    `num_shards` < t replicates each shard on t/num_shards consecutive ranks (K/V heads when
    n_kv_heads < t); their gradients are summed over the replicas. `out_features` not divisible by
    `num_shards` is padded with zero rows (the vocab of the output head)."""

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = False,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 input_is_mapped: bool = False, num_shards: int | None = None,
                 device=None, dtype=None):
        super().__init__()
        t = group_size(group)
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.num_shards = num_shards or t
        if t % self.num_shards:
            raise ValueError(f"num_shards={self.num_shards} must divide the TP size {t}")
        if gather_output and self.num_shards != t:
            raise ValueError("gather_output needs one shard per rank (num_shards == TP size)")
        self.shard_index = group_rank(group) // (t // self.num_shards)
        self.rows = math.ceil(out_features / self.num_shards)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.input_is_mapped = input_is_mapped
        self.weight = nn.Parameter(torch.empty(self.rows, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.rows, device=device, dtype=dtype)) if bias else None

    @property
    def output_offset(self) -> int:
        """The first full output feature this rank computes (e.g. its first vocab id)."""
        return self.shard_index * self.rows

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs) -> ColumnParallelLinear:
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_shard_rows(linear.weight, layer.shard_index, layer.rows))
            if linear.bias is not None:
                layer.bias.copy_(_shard_rows(linear.bias, layer.shard_index, layer.rows))
        return layer

    def tp_specs(self) -> dict[str, TPShard]:
        spec = TPShard(0, self.num_shards, self.group, self.out_features)
        return {"weight": spec, **({"bias": spec} if self.bias is not None else {})}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_mapped:
            x = (gather_for_column_parallel(x, self.group) if self.sequence_parallel
                 else copy_to_tp_region(x, self.group))
        weight, bias = self.weight, self.bias
        if self.num_shards < group_size(self.group):
            weight = sum_among_replicas(weight, self.group, self.num_shards)
            bias = None if bias is None else sum_among_replicas(bias, self.group, self.num_shards)
        y = (linear_with_sequence_gather(x, weight, bias) if self.sequence_parallel
             else F.linear(x, weight, bias))
        if self.gather_output:
            y = gather_from_tp_region(y, self.group)[..., :self.out_features]
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} → {self.rows} rows on shard "
                f"{self.shard_index}/{self.num_shards}, sp={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = Σ_i X_i A_iᵀ with A_i = columns [i·n/t, (i+1)·n/t) of the full weight; the sum is
    Megatron's g (one all-reduce), or with `sequence_parallel` a reduce-scatter that leaves s/t
    tokens per rank. `input_is_parallel=False` first keeps this rank's slice of X's last dim."""

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = False,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        t = group_size(group)
        if in_features % t:
            raise ValueError(f"in_features={in_features} is not divisible by the TP size {t}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.cols = in_features // t
        self.weight = nn.Parameter(torch.empty(out_features, self.cols, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs) -> RowParallelLinear:
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        r = group_rank(group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, r * layer.cols:(r + 1) * layer.cols])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def tp_specs(self) -> dict[str, TPShard]:
        t = group_size(self.group)
        specs = {"weight": TPShard(1, t, self.group, self.in_features)}
        if self.bias is not None:
            specs["bias"] = TPShard(None, 1, self.group, self.out_features)
        return specs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = reduce_from_tp_region(y, self.group)
        if self.bias is not None:  # replicated; under SP each rank saw s/t tokens: sum its grad
            y = y + (copy_to_tp_region(self.bias, self.group) if self.sequence_parallel else self.bias)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} → {self.cols} cols, out={self.out_features}, "
                f"sp={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Rank i holds the rows of vocab ids [i·V'/t, (i+1)·V'/t), V' = V rounded up to a multiple of
    t (padding rows are zero and never looked up). Ids outside the range give 0; the partial
    embeddings are summed by one all-reduce (or reduce-scattered over the sequence under SP)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group, *,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        t = group_size(group)
        self.group, self.num_embeddings, self.embedding_dim = group, num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.rows = math.ceil(num_embeddings / t)
        self.vocab_start = group_rank(group) * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim, device=device, dtype=dtype))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group, **kwargs) -> VocabParallelEmbedding:
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group,
                    device=embedding.weight.device, dtype=embedding.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_shard_rows(embedding.weight, group_rank(group), layer.rows))
        return layer

    def tp_specs(self) -> dict[str, TPShard]:
        return {"weight": TPShard(0, group_size(self.group), self.group, self.num_embeddings)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.rows)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return reduce_from_tp_region(partial, self.group)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} → ids [{self.vocab_start}, "
                f"{self.vocab_start + self.rows}), dim={self.embedding_dim}, sp={self.sequence_parallel}")


class SequenceParallelRMSNorm(nn.Module):
    """RMSNorm(x) = x / sqrt(mean(x²) + eps) · g on this rank's s/t tokens. g is replicated, and
    each rank's dL/dg covers only its tokens, so g enters through f: its gradient is all-reduced
    over the TP group in backward (Megatron all-reduces the norms' grads after backward)."""

    def __init__(self, dim: int, eps: float, group, device=None, dtype=None):
        super().__init__()
        self.eps, self.group = eps, group
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    @classmethod
    def from_norm(cls, norm: nn.Module, group) -> SequenceParallelRMSNorm:
        layer = cls(norm.weight.shape[0], norm.eps, group, norm.weight.device, norm.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(norm.weight)
        return layer

    def tp_specs(self) -> dict[str, TPShard]:
        return {"weight": TPShard(None, 1, self.group, self.weight.shape[0])}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tp_region(self.weight, self.group)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight
