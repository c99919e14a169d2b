"""Lab 03: write the ZeRO-1 step, the optimizer that every rank holds only 1/N of.

You write the mechanism of README "The idea", stage 1, on one flat buffer. Every rank holds the
whole model and computes the gradient of its own slice of the batch. Lay the Ψ parameters (in the
order given) end to end in one flat buffer padded to N·s elements; rank r *owns*

    [r·s, (r+1)·s)        s = ⌈Ψ / N⌉

and keeps, for that slice only, a master copy of the parameters (float32, or float64 for a float64
model) and the inner optimizer's state. One step:

    g_r = (1/N) Σ_ranks flat(grad)[r·s : (r+1)·s]      reduce-scatter with SUM, then ÷ N; drop p.grad
    ‖g‖ = sqrt(all-reduce(Σ g_r²))                     clipping: coef = min(1, max_norm / (‖g‖ + 1e-6))
    master_r ← inner optimizer step on master_r         AdamW / SGD over the s elements only
    params  ← all-gather(master_r)                      every rank gets every updated slice

Padding belongs to no parameter: its gradient is 0, so it adds nothing to the norm, and its master
elements stay 0. AdamW is element-wise, so a tensor cut by a slice boundary is stepped exactly as
on one device.

Which stage this is: ZeRO-1. The optimizer state and the master copy are 1/N per rank, and after
`reduce_scatter_gradients` so is the gradient; but backward has produced the full gradient before
the reduce-scatter runs, so at its peak a rank holds all Ψ gradient elements, as under DDP.
ZeRO-2 removes that peak by reduce-scattering bucket by bucket during backward (the engine does,
engine.py; lab 04's post-backward hook does it per unit).

Tools (torch, and the course's two renamed collectives):
- `reduce_scatter_single(out, inp, group=...)` from common.kernel.collectives: out (s elements) = Σ over
  ranks of inp[r·s : (r+1)·s] (always SUM; inp has N·s elements).
- `all_gather_single(out, inp, group=...)` from common.kernel.collectives: out[r·s : (r+1)·s] = rank r's inp.
- `dist.all_reduce(t, op=dist.ReduceOp.SUM, group=...)`.
- `torch.clamp(x, max=1.0)`; `t.reshape(-1)`; `p.copy_(...)` under `torch.no_grad()`.

How it is used (what the grader runs, on 2 and 3 ranks and on groups of 1 and 2 of 3 ranks, with
torch.optim.AdamW or SGD, max_norm below and above the norm):

    zero = Zero1(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    loss.backward()
    zero.reduce_scatter_gradients()       # p.grad → this rank's averaged shard in zero.master.grad
    zero.clip_grad_norm_(max_norm)        # optional
    zero.step()                           # inner step on zero.master, all-gather into every p
    zero.zero_grad()

Check your work: `make lab-check N=3` (from the repo root), or `grade(3)` in the notebook. It
reads `zero.master` (this rank's slice of the master copy, s elements of its own), its `.grad`
after `reduce_scatter_gradients`, and `zero.optim` (the inner optimizer). Only this file is yours
to edit; keep the names and signatures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.collectives import all_gather_single, reduce_scatter_single  # noqa: F401 (your tools)


def owner_slice(numel: int, world: int, rank: int) -> tuple[int, int]:
    """(start, end) of the elements `rank` owns in a flat buffer of `numel` elements padded to a
    multiple of `world`."""
    raise NotImplementedError("owner_slice: the [start, end) rank r owns of the padded flat buffer")


class Zero1:
    """ZeRO stage 1 over `params` on `group`: `optimizer_class([self.master], **defaults)` steps
    this rank's slice of a master copy; gradients and optimizer state exist only for that slice."""

    def __init__(self, params: Iterable[nn.Parameter], optimizer_class: Callable[..., torch.optim.Optimizer],
                 group=None, **defaults):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.end = owner_slice(self.numel, self.world, self.rank)
        self.master_dtype = torch.promote_types(self.params[0].dtype, torch.float32)
        # Your part: self.master, this rank's slice of the flattened parameters in master_dtype
        # (a tensor of its own: s elements, not a view of a whole-model copy), and self.optim,
        # the inner optimizer over [self.master] with **defaults.
        raise NotImplementedError("Zero1.__init__: the master slice and the inner optimizer over it")

    def reduce_scatter_gradients(self) -> None:
        """After backward: every p.grad laid out in one padded flat buffer, reduce-scattered so
        that self.master.grad holds the average over the ranks of this rank's slice; then the full
        gradients are dropped (p.grad = None)."""
        raise NotImplementedError("Zero1.reduce_scatter_gradients: flatten, reduce-scatter, divide by N")

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale self.master.grad by min(1, max_norm / (‖g‖ + 1e-6)), ‖g‖ the norm of the *whole*
        model's gradient; return ‖g‖ (a 0-dim tensor, the same on every rank)."""
        raise NotImplementedError("Zero1.clip_grad_norm_: the global norm from every rank's shard")

    def step(self) -> None:
        """The inner optimizer steps self.master; then every rank's updated slice is all-gathered
        and copied into the parameters (in their own dtype)."""
        raise NotImplementedError("Zero1.step: step the master slice, all-gather it into the parameters")

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.master.grad = None
