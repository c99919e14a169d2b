"""Lab 04, the reference: one FSDP unit, sharded at rest, gathered only while it computes.

`make lab-check N=4 SOLUTION=1` grades this file with the same properties as your lab.py. Read it
after you have passed them, or when you are stuck for good.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """output[r·S:(r+1)·S] = rank r's input, on every rank (S = input.numel())."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp, group=None) -> None:
    """output on rank r = op over ranks of input[r·S:(r+1)·S] (S = output.numel())."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=op, group=group)


class ShardedUnit(nn.Module):
    """`module`'s parameters held as this rank's 1/N of their flat, padded concatenation."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.slots = [(m, name) for m in module.modules()
                      for name, p in m._parameters.items() if p is not None]
        params = [m._parameters[name] for m, name in self.slots]
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        dtype, device = params[0].dtype, params[0].device

        self.shard_numel = -(-self.numel // self.world)  # S = ⌈P/N⌉
        self.padded_numel = self.shard_numel * self.world
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        flat[: self.numel] = torch.cat([p.detach().reshape(-1) for p in params])
        start = self.rank * self.shard_numel
        self.shard = nn.Parameter(flat[start : start + self.shard_numel].clone())
        for m, name in self.slots:
            del m._parameters[name]  # the module's weights become views of `full` in forward
        self.full = torch.empty(self.padded_numel, dtype=dtype, device=device, requires_grad=True)
        self.free()
        self.full.register_post_accumulate_grad_hook(self._post_backward)

    def gather(self) -> None:
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        all_gather(self.full.data, self.shard.detach(), self.group)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        self.gather()
        views = self.full[: self.numel].split(self.numels)
        for (m, name), view, shape in zip(self.slots, views, self.shapes, strict=True):
            setattr(m, name, view.view(shape))
        output = self.module(*args, **kwargs)
        self.free()
        if output.requires_grad:
            output.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad: torch.Tensor) -> None:
        self.gather()

    def _post_backward(self, full: torch.Tensor) -> None:
        grad, full.grad = full.grad, None
        out = torch.empty(self.shard_numel, dtype=grad.dtype, device=grad.device)
        reduce_scatter(out, grad, dist.ReduceOp.SUM, self.group)
        out.div_(self.world)
        self.shard.grad = out if self.shard.grad is None else self.shard.grad + out
        self.free()
