"""Activation recomputation ("activation checkpointing" in torch and on the command line) as a
wrapper the trainer applies to the model's blocks. Per block and micro-batch of b sequences of s
tokens (width h, a heads):

    none       every block saves what autograd needs:  ≈ (10h + 4F)·e bytes per token (chapter 05)
    selective  Korthikanti et al.'s: only the core attention softmax(QKᵀ/√d)·V (`Attention.attend`,
               between the projections) is rerun in backward: +4·b·s²·h FLOPs forward per layer
               (QKᵀ and ·V, 2·b·s²·h each); it drops what the core saves beyond its inputs
    full       a block keeps only its input; backward reruns its forward first: L·h·e per token
               (+ one block's activations while it is recomputed), for one more forward (+1/3)

What selective saves depends on the kernel. Eager attention stores s×s tensors (Korthikanti's
5·a·s²·b bytes per layer: softmax output, dropout mask and output): selective drops them. A
flash kernel (SDPA here) never stores them, it already recomputes the scores tile by tile in its
own backward; the core then saves only q, k, v (which the checkpoint keeps as its inputs), its
output (kept for wo) and a log-sum-exp, so selective drops the log-sum-exp and the GQA-repeated
copies of k and v.

Non-reentrant `torch.utils.checkpoint` reruns the same ops on the same inputs, so the gradients
are bitwise those of the model without it (no dropout in LLaMA, no RNG to replay). The model's
code is untouched: full replaces each block in its parent, selective wraps each attention's
`attend` (whatever it is: causal SDPA, or context parallelism's ring). Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")


class Recomputed(nn.Module):
    """`module`'s forward under `torch.utils.checkpoint` (use_reentrant=False). Parameter names
    gain a `_checkpoint_wrapped_module.` segment, in named_parameters and state dicts alike (torch's
    CheckpointWrapper strips it from both: hence another name); `unwrapped_name` removes it."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._checkpoint_wrapped_module = module

    def forward(self, *args, **kwargs):
        return checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False, **kwargs)


PREFIX = "_checkpoint_wrapped_module."


def unwrapped_name(name: str) -> str:
    """The parameter's name in the unwrapped model."""
    return name.replace(PREFIX, "")


def recomputed(attend: Callable) -> Callable:
    """`attend(q, k, v)` under non-reentrant checkpoint: its inputs are kept, its insides rerun."""
    return partial(checkpoint, attend, use_reentrant=False)


def apply_recompute(blocks: nn.ModuleList | nn.ModuleDict, mode: str) -> None:
    """In place: 'full' wraps each block of `blocks` (a ModuleList, or a pipeline stage's
    ModuleDict), 'selective' each block's core attention `attention.attend`, 'none' nothing."""
    if mode not in MODES:
        raise ValueError(f"recompute {mode!r}: use one of {', '.join(MODES)}")
    if mode == "none":
        return
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else range(len(blocks))
    for key in keys:
        if mode == "full":
            blocks[key] = Recomputed(blocks[key])
        else:
            blocks[key].attention.attend = recomputed(blocks[key].attention.attend)
