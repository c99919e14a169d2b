"""Chapter 01's exercises: each check takes the student's function, prints ✓ or ✗ with what
decided, and returns a bool (it never raises). The notebook calls them; `solutions.py` holds
one answer per name, `WRONG` a plausible mistake that each check must reject. A wrong answer is
told how it misses (too large, too small, the wrong quantity), never the measured figure.

    grad_error_without_1_over_n(n)   the gradient error `--check` reports on n ranks when
                                     finish() sums the ranks' gradients and forgets the 1/n
                                     (measured here on a one-process simulation of n ranks)

Chapter 01's mechanism itself (buckets, hooks, the overlapped all-reduce) is the lab: lab.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from common.exercise import attempt


def measured_error_without_1_over_n(n: int, seed: int = 0) -> float:
    """One process plays n ranks: each takes B/n rows of a batch, computes its mean-loss gradient,
    and the ranks' gradients are summed without the 1/n. Returns the max over tensors of
    max|g_broken − g| / max|g|, the figure `--check` prints, against the whole batch's gradient."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    x = torch.randn(4 * n, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (4 * n,), generator=gen)

    def grads(rows: slice) -> list[torch.Tensor]:
        model.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        return [p.grad.clone() for p in model.parameters()]

    whole = grads(slice(None))
    shards = [grads(slice(4 * r, 4 * r + 4)) for r in range(n)]
    summed = [sum(g[i] for g in shards) for i in range(len(whole))]  # all-reduce SUM, no division
    return max(((s - w).abs().max() / w.abs().max()).item() for s, w in zip(summed, whole, strict=True))


def _how_it_misses(yours: dict[int, float], measured: dict[int, float]) -> str:
    """What is wrong with a prediction, in words: never the measured figures."""
    def same(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-6 * max(abs(b), 1.0)

    if not all(math.isfinite(y) for y in yours.values()):
        return "your figure is not a finite number"
    if len(set(yours.values())) == 1:
        return "your figure is the same for every n; the error grows with the number of ranks"
    if all(same(yours[n], measured[n] + 1) for n in yours):
        return ("that is how many times too large the broken gradient is (broken / right); --check "
                "prints the relative difference, max|broken − right| / max|right|")
    ratios = {yours[n] / measured[n] for n in yours}
    if all(same(r, next(iter(ratios))) for r in ratios):
        return f"off by a constant factor at every n (too {'large' if ratios.pop() > 1 else 'small'})"
    n = next(n for n in yours if not same(yours[n], measured[n]))
    return f"n={n}: too {'large' if yours[n] > measured[n] else 'small'}"


def check_grad_error_without_1_over_n(fn: Callable[[int], float]) -> bool:
    def check() -> tuple[bool, str]:
        measured = {n: measured_error_without_1_over_n(n) for n in (2, 3, 4, 8)}
        yours = {n: float(fn(n)) for n in measured}
        if all(abs(yours[n] - measured[n]) <= 1e-6 * measured[n] for n in measured):
            return True, f"n=4: measured {measured[4]:.4f}, as you predicted"
        return False, _how_it_misses(yours, measured)

    return attempt(check, "grad_error_without_1_over_n")


EXERCISES: dict[str, Callable[[Callable], bool]] = {
    "grad_error_without_1_over_n": check_grad_error_without_1_over_n,
}

WRONG: dict[str, Callable] = {
    "grad_error_without_1_over_n": lambda n: float(n),  # "n× too large" is an error of n − 1
}
