"""Chapter 03's exercise solutions (lesson.ipynb never imports this file; tests/test_exercises.py does)."""

from __future__ import annotations


def zero_bytes(stage: int, psi: int, n: int, b_p: int, b_g: int, k: float) -> float:
    """Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters."""
    return (b_p * psi / (n if stage >= 3 else 1) + b_g * psi / (n if stage >= 2 else 1)
            + k * psi / (n if stage >= 1 else 1))


def owned_slice(numels: list[int], n: int, r: int) -> tuple[int, int]:
    """The flat buffer is padded to n·s, s = ⌈Σ numels / n⌉; rank r owns [r·s, (r+1)·s)."""
    s = -(-sum(numels) // n)
    return r * s, (r + 1) * s
