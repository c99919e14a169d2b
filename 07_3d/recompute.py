"""Activation recomputation ("activation checkpointing" in torch and on the command line) as a
wrapper the trainer applies to the model's blocks.

    none       every block saves what autograd needs:      L · (10h + 4F) · e bytes per token
    full       a block keeps only its input; backward reruns its forward first:  L · h · e
               (+ one block's activations while it is recomputed), for one more forward (+33%)
    selective  only the attention sub-layer (projections, RoPE, SDPA) is rerun: saves its
               q, k, v and output (4h per token per layer) for a fraction of the extra compute

Korthikanti et al. (2022) call recomputing just the attention core "selective"; with SDPA (flash
kernels) the s × s scores are never stored, so here the whole attention sub-layer is the unit.
Non-reentrant `torch.utils.checkpoint` reruns the same ops on the same inputs, so the gradients
are bitwise those of the model without it (no dropout in LLaMA, no RNG to replay). The model's
code is untouched: the wrapper replaces the module in its parent. Depends only on torch.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")


class CheckpointWrapper(nn.Module):
    """`module`'s forward under `torch.utils.checkpoint` (use_reentrant=False). Parameter names
    gain a `_checkpoint_wrapped_module.` segment (as with torch's own wrapper);
    `unwrapped_name` removes it."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._checkpoint_wrapped_module = module

    def forward(self, *args, **kwargs):
        return checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False, **kwargs)


PREFIX = "_checkpoint_wrapped_module."


def unwrapped_name(name: str) -> str:
    """The parameter's name in the unwrapped model."""
    return name.replace(PREFIX, "")


def apply_recompute(blocks: nn.ModuleList | nn.ModuleDict, mode: str) -> None:
    """In place: 'full' wraps each block of `blocks` (a ModuleList, or a pipeline stage's
    ModuleDict), 'selective' wraps each block's `attention`, 'none' does nothing."""
    if mode not in MODES:
        raise ValueError(f"recompute {mode!r}: use one of {', '.join(MODES)}")
    if mode == "none":
        return
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else range(len(blocks))
    for key in keys:
        if mode == "full":
            blocks[key] = CheckpointWrapper(blocks[key])
        else:
            blocks[key].attention = CheckpointWrapper(blocks[key].attention)
