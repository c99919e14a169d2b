"""The ring's share of a tensor: the one copy of the byte convention every formula and the comm
meter use (nccl-tests' accounting of a ring collective over n ranks, S the full tensor's bytes).

    all-gather, reduce-scatter, all-to-all   (n-1)/n · S      each rank passes on all but its own share
    all-reduce                             2·(n-1)/n · S      a reduce-scatter, then an all-gather
    one rank alone                                0

Part of the torch-only kernel that chapters' core files may import (common/copy_sets.py).
"""

from __future__ import annotations


def ring_fraction(n: int, factor: float = 1.0) -> float:
    """factor · (n-1)/n: the share of a tensor one rank sends in a ring collective over n ranks
    (factor 2 for an all-reduce); 0 for a group of one."""
    return factor * (n - 1) / n if n > 1 else 0.0
