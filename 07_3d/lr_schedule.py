"""Learning-rate warm-up then cosine decay (LLaMA's and GPT-3's schedule).

    lr(s) = lr_max · (s + 1) / W                                               s < W
    lr(s) = lr_min + ½ (lr_max − lr_min) (1 + cos(π · (s − W) / (S − W)))     W ≤ s < S

for optimizer step s of S, W warm-up steps, lr_min = min_ratio · lr_max (LLaMA: 0.1). The first
step already moves (lr_max / W): a zero learning rate would waste a step. Depends only on torch.
"""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float = 0.1) -> float:
    """The multiplier of lr_max at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int,
                            min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """`scheduler.step()` after each `optimizer.step()` moves to the next step's rate."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, total_steps, warmup_steps, min_ratio))
