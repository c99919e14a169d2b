"""Chapter 01's exercise answers (the notebook never imports this file; the suite checks them)."""

from __future__ import annotations


def bytes_per_step(P: int, n: int, b: int) -> float:
    """Reduce-scatter and all-gather each put (n-1)/n of the gradients on the wire."""
    return 2 * (n - 1) / n * P * b


def bucket_layout(sizes: list[int], cap: float) -> list[list[int]]:
    """Walk the parameters last to first; start a new bucket when the next one would overflow."""
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(sizes))):
        if not buckets or size + sizes[i] > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += sizes[i]
    return buckets


def grad_error_without_1_over_n(n: int) -> float:
    """Summing n equal-size shard means gives n·g: off by (n-1)·g, a relative error of n - 1."""
    return float(n - 1)
