"""Solutions to chapter 05's exercises (lesson.ipynb never imports this file; the suite checks
them with exercises.py)."""

from __future__ import annotations

import torch


def shard(weight: torch.Tensor, kind: str, t: int, r: int) -> torch.Tensor:
    """torch stores a linear's weight as [out, in] (Y = X Wᵀ). Column-parallel splits the outputs:
    rank r keeps rows [r·out/t, (r+1)·out/t). Row-parallel splits the inputs: columns
    [r·in/t, (r+1)·in/t), which are exactly the features the column-parallel layer left on rank r."""
    return weight.chunk(t, dim=0 if kind == "column" else 1)[r]


def block_bytes(b: int, s: int, h: int, t: int, e: int) -> float:
    """Two sub-layers (attention, MLP), each with one g (forward all-reduce) and one f (backward
    all-reduce) of b·s·h elements; a ring all-reduce puts 2(t−1)/t of its input on the wire."""
    return 4 * 2 * (t - 1) / t * b * s * h * e


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Cut 0 … s-1 into 2·cp chunks of c = s/(2·cp); rank r takes chunk r (early, little causal
    work) and its mirror 2·cp-1-r (late, much work): every rank's sum of (p + 1) is the same."""
    c = seq_len // (2 * cp)
    mirror = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(mirror * c, (mirror + 1) * c)])
