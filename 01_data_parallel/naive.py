"""Naive data parallelism: every rank holds the whole model and trains on its own slice of the
batch; after backward, each gradient is averaged over the n ranks with one all-reduce:

    g = (1/n) Σ_r g_r          wire bytes per rank per step: 2(n-1)/n · P · bytes_per_param

With equal micro-batches the mean of the ranks' mean losses is the global-batch mean loss, so g
is exactly the single-device gradient. Nothing overlaps: the all-reduces start after backward
ends, one per parameter tensor. Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


def broadcast_module(module: nn.Module, group=None) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src=src, group=group)


class NaiveDataParallel(nn.Module):
    """`loss.backward()` then `model.finish()` leaves the averaged gradient on every rank."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        self._sync = True
        broadcast_module(module, group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate local gradients without communicating (gradient accumulation)."""
        self._sync, previous = False, self._sync
        try:
            yield
        finally:
            self._sync = previous

    def finish(self) -> None:
        """All-reduce (SUM, then divide: never ReduceOp.AVG) every gradient, one at a time."""
        if not self._sync:
            return
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                raise RuntimeError(f"parameter {name!r} received no gradient this step")
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group)
            p.grad.div_(self.world_size)
