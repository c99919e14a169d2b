"""Chapter 04's exercise: the check that lesson.ipynb calls on the student's function.

The check prints ✓ or ✗ with the figure that decided and returns a bool; it never raises (a
stub's NotImplementedError prints "✗ not solved yet"). It runs in one process, against the code
every FSDP unit runs to cut its flat parameter (`FlatParamHandle.pieces`, behind `shard_layout()`).

    shard_pieces(numels, n, r)   the pieces of a unit's parameters (sizes `numels`, laid end to end,
                                 padded to n·S, S = ⌈Σ numels / n⌉) that rank r holds:
                                 [(i, offset in parameter i, numel, offset in the shard), …] for each
                                 parameter i that overlaps [r·S, (r+1)·S), in flat order
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

from common.exercise import attempt
from fsdp.flat_param import FlatParamHandle


def handle_pieces(numels: list[int], n: int, r: int) -> list[tuple[int, int, int, int]]:
    """What FlatParamHandle holds on rank r of n (its `pieces()`, without the empty ones)."""
    handle = SimpleNamespace(numels=numels, shard_rank=r, shard_numel=-(-sum(numels) // n))
    return [(i, offset, numel, at) for i, (offset, numel, at) in enumerate(FlatParamHandle.pieces(handle))
            if numel]


def _what_differs(got: list[tuple], want: list[tuple], numels: list[int], n: int, r: int) -> str:
    """Where your pieces go wrong, without the answer: which parameter, which field."""
    s = -(-sum(numels) // n)
    place = f"sizes {numels}, N={n}, rank {r} (it holds flat[{r * s}:{(r + 1) * s}])"
    mine, theirs = {p[0]: p for p in got}, {p[0]: p for p in want}
    if missing := sorted(theirs.keys() - mine.keys()):
        return f"{place}: parameter(s) {missing} overlap this rank's shard, and you give no piece of them"
    if extra := sorted(mine.keys() - theirs.keys()):
        return f"{place}: parameter(s) {extra} do not overlap this rank's shard, and you give a piece of them"
    if [p[0] for p in got] != [p[0] for p in want]:
        return f"{place}: give the pieces in flat order (by parameter index)"
    fields = ("offset in the parameter", "numel", "offset in the shard")
    i, field = next((i, f) for i in theirs for f in range(3) if mine[i][1 + f] != theirs[i][1 + f])
    return f"{place}: parameter {i}: your {fields[field]} ({mine[i][1 + field]}) is not what the rank holds"


def check_shard_pieces(shard_pieces: Callable) -> bool:
    """Every rank of five units (a LLaMA block of `tiny` among them; N = 1…4, 7) against
    FlatParamHandle.pieces; a wrong answer is told where it differs, not the right pieces."""
    def body() -> tuple[bool, str]:
        tiny_block = [32, 1024, 1024, 1024, 1024, 32, 3072, 3072, 3072]  # `tiny`'s block, registration order
        units = [tiny_block, [10, 3, 1], [5], [1, 1, 1, 1, 1], [7, 9]]
        for numels in units:
            for n in (1, 2, 3, 4, 7):
                for r in range(n):
                    want = handle_pieces(numels, n, r)
                    got = [tuple(piece) for piece in shard_pieces(numels, n, r)]
                    if got != want:
                        return False, _what_differs(got, want, numels, n, r)
        return True, "5 units × N = 1, 2, 3, 4, 7, every rank: your pieces are FlatParamHandle's"
    return attempt(body)


EXERCISES: dict[str, Callable[[Callable], bool]] = {"shard_pieces": check_shard_pieces}


def _pieces_with_offsets_in_the_flat(numels: list[int], n: int, r: int) -> list[tuple[int, int, int, int]]:
    """Gives where each piece sits in the whole flat parameter, not in this rank's shard."""
    s = -(-sum(numels) // n)
    out, start = [], 0
    for i, k in enumerate(numels):
        lo, hi = max(r * s, start), min((r + 1) * s, start + k)
        if lo < hi:
            out.append((i, lo - start, hi - lo, lo))
        start += k
    return out


WRONG: dict[str, Callable] = {"shard_pieces": _pieces_with_offsets_in_the_flat}
