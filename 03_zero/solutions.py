"""Chapter 03's exercise solution (lesson.ipynb never imports this file; tests/test_exercises.py does)."""

from __future__ import annotations


def owned_elements(buckets: list[list[int]], n: int, r: int) -> int:
    """Each bucket is padded to n·s on its own (s = ⌈its numel / n⌉) and rank r owns [r·s, (r+1)·s)
    of it; the parameters fill [0, numel), so rank r steps the overlap of the two."""
    total = 0
    for bucket in buckets:
        numel = sum(bucket)
        s = -(-numel // n)
        total += max(0, min((r + 1) * s, numel) - r * s)
    return total
