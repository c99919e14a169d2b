"""Megatron's communication operators: autograd functions that move activations between ranks.

Tensor parallelism needs exactly two kinds of "region boundary" (Shoeybi et al. 2019, §3):

    f = copy_to_tp_region       forward: identity             backward: all-reduce (sum)
    g = reduce_from_tp_region   forward: all-reduce (sum)     backward: identity

f sits where a replicated activation enters a column-parallel layer (every rank uses the same X, so
dL/dX is the sum of every rank's partial dL/dX); g sits where the partial outputs of a row-parallel
layer leave it (Y = Σ_i Y_i). The two are conjugate: each one's backward is the other's forward.

Sequence parallelism (Korthikanti et al. 2022) splits the all-reduce into its two halves, so the
regions between the TP blocks (norms, residuals) hold only s/t tokens per rank:

    gather_from_sequence_parallel_region        forward: all-gather (seq)   backward: reduce-scatter
    reduce_scatter_to_sequence_parallel_region  forward: reduce-scatter     backward: all-gather

plus the trivial last-dim gather/scatter (for `gather_output=True` and `input_is_parallel=False`).

What the column layers after SP's all-gather save for backward is Megatron's choice too: not the
gathered s tokens (b·s·h per norm, whatever t) but this rank's s/t slice, gathered again in
backward (`gather_for_column_parallel` and `SequenceGather`; layers.py's linear).
Every function takes the TP `group` explicitly. The gathers and reduce-scatters go through
common/kernel/collectives.py (torch's name of the day, looked up at call time), always with SUM: never
ReduceOp.AVG. Megatron's tensors are [s, b, h] and its sequence dim is 0; ours are [b, s, h], so
the sequence-parallel operators take `dim` (default 1) and otherwise keep Megatron's contract.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.kernel.collectives import all_gather_single, reduce_scatter_single


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` (rank order). Wire: (t-1)/t of the output."""
    n = _size(group)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0], *front.shape[1:]))
    all_gather_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()  # one copy, so the layers after it share one storage


def reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's 1/t slice along `dim`. Wire: (t-1)/t of x."""
    n = _size(group)
    if n == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    if front.shape[0] % n:
        raise ValueError(f"dim {dim} of size {front.shape[0]} is not divisible by the group size {n}")
    out = front.new_empty((front.shape[0] // n, *front.shape[1:]))
    reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim)


def start_all_gather_along(x: torch.Tensor, dim: int, group) -> tuple[torch.Tensor, object]:
    """`all_gather_along`, launched asynchronously: (the output with `dim` moved first, the work
    handle or None); the output is complete after `work.wait()`."""
    front = x.movedim(dim, 0).contiguous()
    if _size(group) == 1:
        return front, None
    out = front.new_empty((_size(group) * front.shape[0], *front.shape[1:]))
    return out, all_gather_single(out, front, group=group, async_op=True)


def split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 1/t slice of `x` along `dim` (no communication)."""
    n = _size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    return x.chunk(n, dim)[_rank(group)].contiguous()


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group) > 1:
        x = x.contiguous()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, -1, ctx.group), None


class _ScatterLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, -1, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


class SequenceGather:
    """The all-gathered input of the column layers that read it, rebuilt in backward from the
    local s/t slice they save (Megatron's sequence-parallel linear, shared here by the layers of
    one input: wq, wk, wv; w1, w3). `readers` counts the layers that registered in forward. Each
    backward pass gathers once: its first reader starts the all-gather (asynchronously, so the
    reader's dx = dy·W GEMM runs while it travels), every reader waits for it, and the last one
    drops the full tensor. A split backward (chapter 06's ZB-H1: B, then W) is two passes, two
    gathers."""

    def __init__(self, group, dim: int):
        self.group, self.dim, self.readers = group, dim, 0
        self._pending, self._out, self._work = 0, None, None

    def start(self, local: torch.Tensor) -> None:
        """Launch this pass's all-gather of `local` unless an earlier reader of the pass did."""
        if self._out is None:
            self._out, self._work = start_all_gather_along(local, self.dim, self.group)
            self._pending = self.readers

    def wait(self) -> torch.Tensor:
        """The gathered input (a view, sequence dim at `dim`); dropped after the pass's last reader."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        full = self._out.movedim(0, self.dim)
        self._pending -= 1
        if self._pending <= 0:
            self._out = None
        return full


def gather_for_column_parallel(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """`gather_from_sequence_parallel_region` for column-parallel layers: the gathered tensor
    carries its local slice and a `SequenceGather` (`.sequence_gather`), so the sequence-parallel
    column layers that read it save the s/t tokens and gather them again in backward."""
    full = _GatherSequence.apply(x, group, dim)
    full.sequence_gather = (x.detach(), SequenceGather(group, dim))
    return full


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's f: identity forward; backward all-reduces dL/dx over the TP group."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's g: all-reduce forward (Y = Σ_i Y_i); identity backward."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the last dim (forward); keep this rank's slice of the gradient (backward)."""
    return _GatherLastDim.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's slice of the last dim (forward); all-gather the gradient (backward)."""
    return _ScatterLastDim.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """SP's entry into a TP region: all-gather the s/t tokens to s (forward), reduce-scatter the
    gradient back to s/t (backward). `dim` is the sequence dim (1 for our [B, T, H])."""
    return _GatherSequence.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """SP's exit from a TP region: sum the partial outputs and keep s/t tokens (forward);
    all-gather the gradient (backward). Replaces g's all-reduce: same bytes, 1/t of the result."""
    return _ReduceScatterSequence.apply(x, group, dim)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Keep this rank's s/t tokens (forward); all-gather the gradient (backward)."""
    return _ScatterSequence.apply(x, group, dim)


class _SumAmongReplicas(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks that hold the same shard
    (shard index = rank // copies), in one all-reduce over the TP group of a buffer laid out like
    the full tensor [num_shards, *shard]. For a K/V head replicated on t/n_kv ranks."""

    @staticmethod
    def forward(ctx, w, group, num_shards):
        ctx.group, ctx.num_shards = group, num_shards
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        n = _size(ctx.group)
        if n == 1:
            return grad, None, None
        index = _rank(ctx.group) // (n // ctx.num_shards)
        buffer = grad.new_zeros((ctx.num_shards, *grad.shape))
        buffer[index] = grad
        return all_reduce_sum(buffer, ctx.group)[index], None, None


def sum_among_replicas(w: torch.Tensor, group, num_shards: int) -> torch.Tensor:
    """Use a weight whose `num_shards` shards are each replicated on group_size/num_shards ranks:
    its gradient becomes the sum over the replicas (each saw only its own query heads)."""
    return _SumAmongReplicas.apply(w, group, num_shards)
