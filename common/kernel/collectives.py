"""The two collectives whose names changed across torch versions, looked up at call time.

    all_gather_single:      out[r·s:(r+1)·s] = in_r                  (n-1)/n · |out| bytes per rank
    reduce_scatter_single:  out_r = Σ_ranks in[r·s:(r+1)·s]           (n-1)/n · |in| bytes per rank

torch 2.13 renames `all_gather_into_tensor` / `reduce_scatter_tensor` to `*_single` and warns on
the old names; torch 2.6 has only the old ones. Looking the function up at each call (not at
import) lets a meter that swaps `torch.distributed`'s functions see every call. The reduction is
SUM by default (divide afterwards): `ReduceOp.AVG` is refused, which gloo on torch 2.5-2.8 rejects
for all_reduce and silently turns into SUM for reduce_scatter. Both keep torch's signatures (its
parameter names, reduce_scatter_single's `op` third), so a call written for torch means the same.

Part of the torch-only kernel that chapters' core files may import (copy it with them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                      async_op: bool = False):
    """`dist.all_gather_single` (torch >= 2.13, this signature), else `dist.all_gather_into_tensor`."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """`dist.reduce_scatter_single` (torch >= 2.13, this signature), else `dist.reduce_scatter_tensor`;
    `ReduceOp.AVG` refused (sum, then divide)."""
    if isinstance(op, dist.ProcessGroup):
        raise TypeError("reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False) "
                        "is torch's signature: pass the group as group=")
    if op == dist.ReduceOp.AVG:
        raise ValueError("reduce_scatter_single(op=ReduceOp.AVG): gloo on torch 2.5-2.8 silently sums; "
                         "pass ReduceOp.SUM and divide")
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)
