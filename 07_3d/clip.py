"""Gradient clipping by the true global norm of a model split over TP × CP × PP × DP
(torch.nn.utils.clip_grad_norm_'s contract, on the whole model the mesh holds):

    ‖g‖ = sqrt( Σ_ranks Σ_{pieces this rank counts} ‖g_piece‖² )      one all-reduce of a scalar
    g  ← g · min(1, max_norm / (‖g‖ + 1e-6))                            every local gradient

Which pieces a rank counts is the ShardMap's `counted` (shards.py): FSDP shards all count, a
NO_SHARD unit counts on the dp × cp group's rank 0, a TP-replicated tensor (RMSNorm weights; K/V
heads when n_kv < t) on one rank of its copies; pipeline stages hold disjoint layers. Counting a
replica on every rank makes the norm too large (notebook section (g)); clipping by each rank's
own norm gives each rank a different coefficient. Depends only on torch and common/kernel/clip.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.kernel.clip import accumulate_dtype, clip_grads_by_global_norm_
from parallel3d.shards import ShardMap


def clip_grad_norm_3d(shards: ShardMap, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of this rank's flat shards so that the whole model's gradient norm
    is at most `max_norm`. Every rank of the world calls it (after backward, before the
    optimizer step). Returns the norm before clipping (a 0-dim tensor on the device)."""
    flats = [u.flat_param for u in shards.units]
    counted = [shards.piece_of(p, lambda u: u.flat_param.grad) for p in shards.pieces if p.counted]
    return clip_grads_by_global_norm_([p.grad for p in flats], max_norm, counted, groups=(dist.group.WORLD,),
                           norm_type=norm_type, device=flats[0].device, dtype=accumulate_dtype(flats))
