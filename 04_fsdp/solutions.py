"""Chapter 04's exercise solution (lesson.ipynb never imports this file; tests/test_exercises.py does)."""

from __future__ import annotations


def shard_pieces(numels: list[int], n: int, r: int) -> list[tuple[int, int, int, int]]:
    """Rank r holds flat elements [r·S, (r+1)·S), S = ⌈Σ numels / n⌉; parameter i spans
    [o_i, o_i + numels[i]): their overlap [lo, hi) is its piece, at lo − r·S in the shard."""
    s = -(-sum(numels) // n)
    start, end = r * s, (r + 1) * s
    pieces, offset = [], 0
    for i, numel in enumerate(numels):
        lo, hi = max(start, offset), min(end, offset + numel)
        if lo < hi:
            pieces.append((i, lo - offset, hi - lo, lo - start))
        offset += numel
    return pieces
