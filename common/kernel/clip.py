"""Gradient clipping by the true global norm of a model split any way: DP, ZeRO, FSDP, TP, PP, 3D.

    ‖g‖₂ = sqrt( Σ_ranks Σ_{tensors this rank counts} ‖g_i‖² )     all-reduce (SUM) of one scalar
    ‖g‖_∞ = max_ranks max_{counted} |g_i|                            all-reduce (MAX) of one scalar
    coef = min(1, max_norm / (‖g‖ + 1e-6));   g ← coef · g            (torch.nn.utils.clip_grad_norm_'s)

Each element of the full model's gradient must enter the sum exactly once, so a rank *counts* a
local tensor only if it holds that piece and no lower-ranked copy does:
- sharded pieces (a ZeRO or FSDP shard, a TP slice, a pipeline stage's own blocks) are disjoint:
  all count, and the squared norms are summed over the groups they are sharded over;
- a tensor replicated across a group (an RMSNorm weight on every TP rank, any gradient on every
  DP rank after the all-reduce) counts only on rank 0 of that group, or is not summed over it.
`groups` are the process groups to sum over, in order: () for a model every rank holds whole
(plain DP), (dp,) for ZeRO/FSDP, (tp,) for TP, (world,) for the 3D mesh. The classic bugs:
clipping by the local norm (each rank a different coefficient), or counting replicas t times (the
norm too large by up to sqrt(t)).

This is the course's one clipping function: each chapter's step chooses `counted` and `groups`
and calls it. It imports only torch, so a chapter's core file that uses it stays copyable as
"the file + common/kernel/clip.py".

It takes *gradients*, not parameters, so it does not carry torch's name: torch's
`clip_grad_norm_(model.parameters(), max_norm)` reads each `p.grad`, and a function of that name
that scaled what it was given would scale the weights. Handed parameters (tensors that require
grad), `clip_grads_by_global_norm_` raises, naming the call to write instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist


def _present(tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
    return [t for t in tensors if t is not None]


def accumulate_dtype(grads: Sequence[torch.Tensor]) -> torch.dtype:
    """float64 when any gradient is float64, else float32 (bf16 squares summed in fp32)."""
    return torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32


def global_grad_norm(counted: Iterable[torch.Tensor | None], groups: Sequence = (),
                     norm_type: float = 2.0, device: torch.device | None = None,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """‖counted‖ over every rank of `groups` (collective over each group; () is local).
    A rank that counts nothing still joins every all-reduce, with 0."""
    counted = _present(counted)
    dtype = dtype or accumulate_dtype(counted)
    device = device or (counted[0].device if counted else torch.device("cpu"))
    total = torch.zeros((), dtype=dtype, device=device)
    if norm_type == 2.0:
        for g in counted:
            total += g.detach().to(dtype).pow(2).sum()
        op = dist.ReduceOp.SUM
    elif norm_type == float("inf"):
        for g in counted:
            total = torch.maximum(total, g.detach().to(dtype).abs().max() if g.numel() else total)
        op = dist.ReduceOp.MAX
    else:
        raise ValueError(f"norm_type={norm_type}: only 2.0 and inf are implemented")
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=op, group=group)
    return total.sqrt() if norm_type == 2.0 else total


def _only_gradients(tensors: list[torch.Tensor], argument: str) -> list[torch.Tensor]:
    """Refuse parameters where gradients are expected: scaling them would scale the weights."""
    if any(t.requires_grad for t in tensors):
        raise TypeError(
            f"clip_grads_by_global_norm_: `{argument}` holds tensors that require grad (parameters?); "
            "it takes gradients and scales them in place, so it would scale the weights. Pass "
            "[p.grad for p in params], or for torch's contract on parameters call "
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)")
    return tensors


def clip_grads_by_global_norm_(grads: Iterable[torch.Tensor | None], max_norm: float,
                               counted: Iterable[torch.Tensor | None] | None = None,
                               groups: Sequence = (), norm_type: float = 2.0,
                               device: torch.device | None = None,
                               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Scale every local gradient in `grads` by min(1, max_norm / (‖g‖ + 1e-6)), where ‖g‖ is the
    global norm of `counted` (default: all of `grads`; the pieces this rank owns) summed over
    `groups`. Every rank of those groups must call it. Returns the norm before clipping (a 0-dim
    tensor on the device: reading it is the caller's host sync, not this function's). The sum
    runs in `dtype` (default `accumulate_dtype(grads)`): a rank that may hold no gradient must
    pass the dtype its peers use, or the all-reduce mixes dtypes."""
    grads = _only_gradients(_present(grads), "grads")
    counted = grads if counted is None else _only_gradients(_present(counted), "counted")
    device = device or (grads[0].device if grads else None)  # NCCL takes no CPU scalar
    total = global_grad_norm(counted, groups, norm_type, device, dtype or accumulate_dtype(grads))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total
