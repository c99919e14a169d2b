"""Solutions to chapter 06's exercises (lesson.ipynb never imports this file; the suite checks
them with exercises.py)."""

from __future__ import annotations

import math


def one_f_one_b_order(p: int, m: int, rank: int) -> list[str]:
    """Rank r is p − r − 1 stages from the last, so it can run that many forwards before the first
    gradient comes back; then each arriving gradient (B) frees room for one more forward (F)."""
    warmup = min(p - rank - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - warmup, m)]


def min_microbatches(p: int, target: float, v: int = 1) -> int:
    """(p−1)/(v·m+p−1) ≤ target  ⇔  m ≥ (p−1)(1−target)/(v·target)."""
    return max(1, math.ceil((p - 1) * (1 - target) / (v * target) - 1e-9))
