"""ZeroOptimizer reduces its parameters' gradients itself, so nothing else may: torch's
ZeroRedundancyOptimizer leaves the reduction to DistributedDataParallel, and a torch user brings
that habit. Two reducers are refused, never silently combined:

    at construction   a parameter with another post-accumulate-grad hook (chapter 01's DDP)
    after backward    stage 0's reduced p.grad written by a later end-of-backward callback
                      (torch's DDP copies its own average into p.grad there)

Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

WRAPPED = ("if a DistributedDataParallel wraps the model, drop it: ZeroOptimizer reduces gradients "
           "itself (torch's ZeroRedundancyOptimizer leaves that to DDP)")


def refuse_other_hooks(named: Iterable[tuple[str, nn.Parameter]]) -> None:
    """Raise if a parameter has a post-accumulate-grad hook other than a ZeroOptimizer's own
    (`_zero_hooks`: one this optimizer replaces)."""
    for name, p in named:
        if len(getattr(p, "_post_accumulate_grad_hooks", None) or ()) > hasattr(p, "_zero_hooks"):
            raise RuntimeError(f"{name} has another post-accumulate-grad hook: {WRAPPED}")


def watch(buffers: list[torch.Tensor]) -> None:
    """Queue, behind every end-of-backward callback queued so far, a check that none of them wrote
    into `buffers` (stage 0's reduced gradients, which p.grad views)."""
    versions = [b._version for b in buffers]

    def check() -> None:
        if [b._version for b in buffers] != versions:
            raise RuntimeError(f"p.grad was written after ZeroOptimizer reduced it, by another "
                               f"end-of-backward hook: {WRAPPED}")

    torch.autograd.Variable._execution_engine.queue_callback(check)
