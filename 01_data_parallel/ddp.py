"""DistributedDataParallel from scratch: bucketed gradient all-reduce that overlaps backward.

Gradients become ready in roughly reverse registration order (the last layer's first), so the
parameters are packed in that order into flat buckets of at most `bucket_cap_mb`. A hook fires
as each parameter's gradient is accumulated; it copies the gradient into its bucket slot (and
makes `param.grad` a view of that slot, so later steps accumulate in place), and when the last
gradient of a bucket lands, the bucket's all-reduce starts asynchronously while autograd goes on
computing the earlier layers. `finish()` waits for the buckets and divides by n:

    g = (1/n) Σ_r g_r          wire bytes per rank per step: 2(n-1)/n · P · bytes_per_param

the same bytes as the naive version in ⌈P·b / bucket_cap⌉ calls instead of one per tensor, and
mostly hidden behind backward. Buckets launch strictly in index order on every rank, so the
collectives match across ranks even if autograd's order differs. Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .naive import broadcast_module


@dataclass
class Bucket:
    buffer: torch.Tensor
    params: list[nn.Parameter]
    names: list[str]
    ready: set[int] = field(default_factory=set)
    work: dist.Work | None = None


def assign_buckets(named_params: list[tuple[str, nn.Parameter]],
                   bucket_cap_bytes: float) -> list[list[tuple[str, nn.Parameter]]]:
    """Reverse registration order, a new bucket when the cap would be exceeded or the dtype
    changes; a parameter larger than the cap gets a bucket of its own."""
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in reversed(named_params):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > bucket_cap_bytes or buckets[-1][-1][1].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += nbytes
    return buckets


class DistributedDataParallel(nn.Module):
    """`loss.backward()` then `model.finish()` leaves the averaged gradient on every rank."""

    def __init__(self, module: nn.Module, group=None, bucket_cap_mb: float = 25.0,
                 all_reduce: Callable | None = None):
        """`all_reduce`: a drop-in for `dist.all_reduce(tensor, op=, group=, async_op=True)`
        returning a handle with `.wait()`, e.g. chapter 02's `ring_all_reduce`."""
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be > 0 (e.g. 25, torch's default)")
        self.module, self.group, self._all_reduce = module, group, all_reduce
        self.world_size = dist.get_world_size(group)
        self._sync = True
        broadcast_module(module, group)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.buckets: list[Bucket] = []
        self._slot: dict[nn.Parameter, tuple[int, int, torch.Tensor]] = {}
        for b, members in enumerate(assign_buckets(named, bucket_cap_mb * 2**20)):
            params = [p for _, p in members]
            buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                 device=params[0].device)
            offset = 0
            for i, p in enumerate(params):
                self._slot[p] = (b, i, buffer[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            self.buckets.append(Bucket(buffer, params, [n for n, _ in members]))
        self._next_bucket = 0
        for p in self._slot:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

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

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        b, i, slot = self._slot[p]
        if p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
            p.grad = slot
        self.buckets[b].ready.add(i)
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if len(bucket.ready) < len(bucket.params):
                return
            all_reduce = self._all_reduce or dist.all_reduce  # looked up late: meters wrap it
            bucket.work = all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group,
                                     async_op=True)
            self._next_bucket += 1

    def finish(self) -> None:
        """Wait for every bucket's all-reduce and divide by n (SUM then divide: never AVG)."""
        if not self._sync:
            return
        missing = [name for bucket in self.buckets for i, name in enumerate(bucket.names)
                   if i not in bucket.ready]
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.buffer.div_(self.world_size)
            bucket.ready.clear()
            bucket.work = None
        self._next_bucket = 0
        if missing:
            raise RuntimeError(
                f"parameters received no gradient this step: {missing}. Every parameter must take "
                "part in the loss (or set requires_grad=False on the unused ones)"
            )
