"""Chapter 02's exercise answers (the notebook never imports this file; the suite checks them)."""

from __future__ import annotations


def reduce_scatter_schedule(rank: int, step: int, n: int) -> tuple[int, int]:
    """Send the partial you folded last (your own chunk r-1 at step 0); it is complete n-1 hops
    after it left its first sender, so chunk r must start at rank r+1."""
    return (rank - 1 - step) % n, (rank - 2 - step) % n


def broken_ring_survivor(chunk: int, n: int) -> int:
    """Each hop replaces instead of adding, so a chunk carries only its first sender's data: chunk c
    leaves rank c+1 at step 0 and arrives, unchanged, at rank c."""
    return (chunk + 1) % n
