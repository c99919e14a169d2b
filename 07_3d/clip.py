"""Gradient clipping by the true global norm of a model split over TP, PP and DP.

    ‖g‖₂ = sqrt( Σ_ranks Σ_{tensors this rank counts} ‖g_i‖² )       one all-reduce (SUM) of a scalar
    coef = min(1, max_norm / (‖g‖₂ + 1e-6));   g ← coef · g              (torch.nn.utils.clip_grad_norm_)

Each element of the full model's gradient must enter the sum exactly once. A rank therefore counts
a local tensor only if it holds that piece of the model and no lower-ranked copy does:
- sharded pieces (a TP slice, an FSDP shard, a pipeline stage's own blocks) are disjoint: all count;
- a tensor replicated across a dimension (an RMSNorm weight on every TP rank, any parameter on
  every DP rank when it is not sharded there) counts only on rank 0 of that dimension.
The classic bugs: clipping by the local norm (each rank a different coefficient), or counting the
replicas t times (the norm too large by up to sqrt(t)). Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def local_sq_norm(grads: Iterable[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Σ ‖g‖² over `grads`, accumulated in float64 when any grad is float64, else float32."""
    grads = [g for g in grads if g is not None]
    if dtype is None:
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=dtype, device=device)
    for g in grads:
        total += g.detach().to(dtype).pow(2).sum()
    return total


def global_grad_norm(counted: Iterable[torch.Tensor], group=None, device: torch.device | None = None,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """sqrt of the all-reduced (SUM over `group`, default the world) squared norms of the
    gradients this rank counts (see the module doc for which)."""
    sq = local_sq_norm(counted, dtype)
    if device is not None:
        sq = sq.to(device)
    if dist.is_initialized():
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq.sqrt()


def clip_grad_norm_(grads: Iterable[torch.Tensor], counted: Iterable[torch.Tensor], max_norm: float,
                    group=None, device: torch.device | None = None) -> torch.Tensor:
    """Scale every local gradient in `grads` by min(1, max_norm / (‖g‖ + 1e-6)), where ‖g‖ is the
    global norm of `counted` (a subset of `grads`: the pieces this rank owns). Collective over
    `group` (every rank of the model must call it). Returns the global norm (before clipping)."""
    grads = [g for g in grads if g is not None]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    total = global_grad_norm(counted, group, device, dtype)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total
