"""Lab 04: write one FSDP unit's life: sharded at rest, whole only while it computes.

You write the mechanism of README "The idea: units, and the life cycle of one unit". A unit's P
parameters (module.parameters() order, each flattened) are laid end to end, padded with zeros
to N·S elements, and cut into N shards; rank r keeps only its own:

    S = ⌈P/N⌉        shard_r = flat[r·S : (r+1)·S]                       (an nn.Parameter)
    forward:         full = all_gather(shard_0 … shard_{N-1}) → compute → free full
    backward:        full = all_gather(…) again → full.grad → free full
                     shard_r.grad = (Σ_ranks full.grad[r·S : (r+1)·S]) / N    (reduce-scatter)

(reduce-scatter with SUM, then divide by N: never ReduceOp.AVG). The optimizer sees only the
shards: `torch.optim.AdamW(model.parameters())` steps 1/N of the model on each rank, and a step
trains exactly like one device.

`self.full` is one flat tensor of N·S elements, a leaf that requires grad. In forward the
module's weights become views of it (`full[:P].split(numels)`, each `.view(shape)`), so
autograd sums every use of every weight into `full.grad`. Freeing `full` releases its memory but
keeps the tensor, its views and whatever autograd saved from them; gathering into the same
storage again before backward makes them valid again.

Tools (all in torch):
- `t.untyped_storage().resize_(nbytes)`: allocate (nbytes = numel · t.element_size()) or free
  (0) a tensor's memory while the tensor object stays.
- `self.full.data`: the same storage without autograd's bookkeeping: gather into it.
- `output.register_hook(fn)`: fn(grad) runs in backward when the gradient of this forward's
  output arrives, before the unit's own backward (the pre-backward hook).
- `self.full.register_post_accumulate_grad_hook(fn)`: fn(full) runs when full.grad is complete
  for this backward (the post-backward hook); set full.grad = None there once you used it.
- `all_gather` and `reduce_scatter` below (already written).

Check your work: `make lab-check N=4` (from the repo root), or `grade(4)` in the notebook. It
checks your shards, when `full` holds memory, trains a small LLaMA whose embedding, blocks, norm
and head are each a ShardedUnit on 2 and 3 ranks and on a world of 3 cut into groups of 2 and 1
(so use the `group` you are given) against one device, and counts the collectives. Only this
file is yours to edit; keep the names and signatures.
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
        # (module, name) of each parameter, in module.parameters() order: m._parameters[name]
        self.slots = [(m, name) for m in module.modules()
                      for name, p in m._parameters.items() if p is not None]
        params = [m._parameters[name] for m, name in self.slots]
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)  # P
        # Your part: self.shard_numel (S), self.padded_numel (N·S), self.shard (an nn.Parameter:
        # this rank's slice of the flat, padded parameters), the module's own parameters deleted
        # (del m._parameters[name]), self.full (N·S elements, requires grad, freed), and the
        # post-backward hook on self.full.
        raise NotImplementedError("ShardedUnit.__init__: S = ⌈P/N⌉, self.shard = this rank's slice, "
                                  "self.full (freed), the post-backward hook")

    def gather(self) -> None:
        """Allocate self.full's memory and all-gather every rank's shard into it."""
        raise NotImplementedError("ShardedUnit.gather: allocate full's storage, all-gather into it")

    def free(self) -> None:
        """Release self.full's memory (the tensor and its views stay)."""
        raise NotImplementedError("ShardedUnit.free: resize full's storage to 0")

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """Gather, point the module's weights at views of full, run the module, free, and register
        the pre-backward hook on the output (when it requires grad)."""
        raise NotImplementedError("ShardedUnit.forward: gather, views, self.module(...), free, hook")

    def _pre_backward(self, grad: torch.Tensor) -> None:
        """The gradient of the unit's output has arrived: its backward runs next."""
        raise NotImplementedError("ShardedUnit._pre_backward: gather again for backward")

    def _post_backward(self, full: torch.Tensor) -> None:
        """full.grad is complete: reduce-scatter it into this rank's shard.grad (SUM, then ÷N;
        add to shard.grad when it already holds a gradient), reset full.grad, free."""
        raise NotImplementedError("ShardedUnit._post_backward: reduce-scatter full.grad, ÷N, free")
