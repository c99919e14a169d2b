"""Chapter 05's exercise: the check that lesson.ipynb calls on the student's function.

The check prints ✓ or ✗ with the figure that decided and returns a bool; it never raises (a
stub's NotImplementedError prints "✗ not solved yet"). Everything runs in one process.

    zigzag_positions(s, cp, r)  the global positions of the tokens context-parallel rank r holds,
                                in the layout that gives every rank the same causal attention work

The parallel layers themselves are the chapter's lab (lab.py, graded by `grade(5)`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.exercise import attempt
from tensor_parallel import context_layout


def _work(positions: list[list[int]]) -> list[int]:
    """Causal attention work per rank: a query at position p scores the p + 1 keys it sees."""
    return [sum(p + 1 for p in mine) for mine in positions]


def check_zigzag_positions(zigzag_positions: Callable) -> bool:
    """Five shapes (s ≤ 48, cp = 1…4), every rank: the ranks' positions cover 0 … s−1 once, each
    rank holds two chunks of s/(2·cp), the causal work is the same on every rank, and the layout
    is the library's (rank r's early chunk first). A wrong layout prints its own figures (its
    work per rank), never the answer."""
    def body() -> tuple[bool, str]:
        for s, cp in [(8, 2), (16, 4), (12, 3), (4, 1), (48, 4)]:
            got = [[int(p) for p in zigzag_positions(s, cp, r)] for r in range(cp)]
            where = f"s={s} cp={cp}"
            if sorted(p for mine in got for p in mine) != list(range(s)):
                return False, f"{where}: the ranks' positions are not 0…{s - 1} once each: {got}"
            c = s // (2 * cp)
            chunks = [[mine[i:i + c] for i in (0, c)] for mine in got]
            runs = all(len(mine) == 2 * c and all(ch == list(range(ch[0], ch[0] + c)) for ch in pieces)
                       for mine, pieces in zip(got, chunks, strict=True))
            if not runs:
                return False, f"{where}: a rank's positions are not two runs of {c} consecutive ones: {got}"
            work = _work(got)
            if max(work) != min(work):
                return False, (f"{where}: causal work per rank {work} (max/min {max(work) / min(work):.2f}): "
                               "which two chunks add up to the same work on every rank?")
            want = [context_layout.zigzag_positions(s, cp, r).tolist() for r in range(cp)]
            if got != want:
                return False, (f"{where}: balanced, but rank r's first chunk must be chunk r (the library's "
                               f"order, which ring attention and RoPE rely on): your rank 0 holds {got[0]}")
        return True, "s ≤ 48, cp = 1…4: every rank's positions right; causal work equal on every rank"
    return attempt(body)


EXERCISES: dict[str, Callable[[Callable], bool]] = {"zigzag_positions": check_zigzag_positions}


def _zigzag_without_the_mirror(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Chunks r and r + cp: two chunks per rank, but the late ranks still hold the late tokens."""
    c = seq_len // (2 * cp)
    late = rank + cp
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


WRONG: dict[str, Callable] = {"zigzag_positions": _zigzag_without_the_mirror}
