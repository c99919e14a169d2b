"""Lab 01: write bucketed DDP, the all-reduce that hides behind backward.

You write the mechanism of README "Bucketed DDP": every rank holds the whole model and computes
the gradient of its own slice of the batch; the ranks then average their gradients,

    g = (1/n) Σ_r g_r          (all-reduce with SUM, then divide by n: never ReduceOp.AVG)

and they do it while backward is still running. Backward produces gradients last layer first, so
parameters are packed in *reverse* order into buckets of about `bucket_cap_mb`; when the last
gradient of a bucket lands, that bucket's all-reduce starts asynchronously (`async_op=True`
returns a handle) and autograd carries on with the earlier layers. At the end of backward every
handle is waited for, the sums are divided by n, and `p.grad` holds the average, so that a plain
`loss.backward(); optimizer.step()` trains exactly like one device.

Tools (all in torch):
- `p.register_post_accumulate_grad_hook(fn)`: fn(p) runs when p.grad has been accumulated.
- `torch.autograd.Variable._execution_engine.queue_callback(fn)`: called from inside backward,
  runs fn once when this backward finishes (queue it once per backward).
- `dist.all_reduce(t, op=dist.ReduceOp.SUM, group=..., async_op=True)` → work; `work.wait()`.

Check your work: `make lab-check N=1` (from the repo root), or `grade(1)` in the notebook. It
trains a small LLaMA with your class on 2 and 3 ranks, and on a world of 3 cut into groups of 2
and 1 (so use the `group` you are given), compares every rank's gradients with one device, and
checks that the all-reduces start during backward. Only this file is yours to edit; keep the
names and signatures.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch import nn


def assign_buckets(params: list[nn.Parameter], cap_bytes: float) -> list[list[nn.Parameter]]:
    """The parameters in reverse order, cut into buckets: start a new bucket when adding the next
    parameter would take the current one past `cap_bytes` (a parameter larger than the cap gets
    a bucket of its own). Bytes of a parameter: p.numel() * p.element_size()."""
    raise NotImplementedError("assign_buckets: the parameters in reverse order, cut at cap_bytes")


class BucketedDDP(nn.Module):
    """`loss.backward()` leaves the average gradient over the group in every `p.grad`."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group=None):
        super().__init__()
        self.module, self.group = module, group
        self.world = dist.get_world_size(group)
        self.sync = True  # False inside no_sync()
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = assign_buckets(params, bucket_cap_mb * 2**20)
        # Your part: a flat buffer per bucket (the bucket's gradients side by side), where each
        # parameter sits in it, what has arrived per bucket, the pending handles, and a
        # post-accumulate-grad hook on every parameter that calls self._on_grad_ready.
        raise NotImplementedError("BucketedDDP.__init__: buffers, slots and a hook per parameter")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: backward only accumulates local gradients in p.grad (no communication). The
        first backward outside reduces the accumulated sum (gradient accumulation)."""
        raise NotImplementedError("BucketedDDP.no_sync: communicate nothing inside")

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """p.grad is complete for this backward: put it into its bucket's buffer; when the bucket
        is full, start its all-reduce (asynchronously). The first call of a backward also queues
        self.finish to run when backward ends."""
        raise NotImplementedError("BucketedDDP._on_grad_ready: fill the bucket, launch it when full")

    def finish(self) -> None:
        """End of backward: wait for every bucket, divide by the world size, copy the averages back
        into each p.grad, and reset what the next backward counts on."""
        raise NotImplementedError("BucketedDDP.finish: wait, divide by n, write p.grad, reset")
