"""Lab 03, the reference: the ZeRO-1 step on one flat buffer (the full gradient lives until the
reduce-scatter after backward: ZeRO-1's memory; ZeRO-2 reduce-scatters during backward).

`make lab-check N=3 SOLUTION=1` grades this file with the same properties as your lab.py. Read it
after you have passed them, or when you are stuck for good.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.collectives import all_gather_single, reduce_scatter_single


def owner_slice(numel: int, world: int, rank: int) -> tuple[int, int]:
    """Pad to a multiple of N; each rank owns one N-th of the padded buffer, in rank order."""
    s = -(-numel // world)
    return rank * s, (rank + 1) * s


class Zero1:
    def __init__(self, params: Iterable[nn.Parameter], optimizer_class: Callable[..., torch.optim.Optimizer],
                 group=None, **defaults):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.end = owner_slice(self.numel, self.world, self.rank)
        self.padded = (self.end - self.start) * self.world
        self.master_dtype = torch.promote_types(self.params[0].dtype, torch.float32)
        flat = self._flatten([p.detach() for p in self.params])
        self.master = flat[self.start : self.end].clone()  # its own storage: s elements, not the whole
        self.optim = optimizer_class([self.master], **defaults)

    def _flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors end to end in the master dtype, zero-padded to N·s elements."""
        flat = torch.zeros(self.padded, dtype=self.master_dtype, device=self.params[0].device)
        offset = 0
        for t in tensors:
            flat[offset : offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        return flat

    def reduce_scatter_gradients(self) -> None:
        flat = self._flatten([p.grad for p in self.params])
        self.master.grad = torch.empty_like(self.master)
        reduce_scatter_single(self.master.grad, flat, group=self.group)  # SUM
        self.master.grad.div_(self.world)
        for p in self.params:
            p.grad = None  # only the shard of the gradient lives on

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        total = self.master.grad.pow(2).sum()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        norm = total.sqrt()
        self.master.grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def step(self) -> None:
        self.optim.step()
        dtype = self.params[0].dtype
        flat = torch.empty(self.padded, dtype=dtype, device=self.master.device)
        all_gather_single(flat, self.master.detach().to(dtype), group=self.group)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.master.grad = None
