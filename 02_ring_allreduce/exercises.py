"""Chapter 02's exercises: each check takes the student's function, prints ✓ or ✗ with the figure
that decided, and returns a bool (it never raises). The notebook calls them; `solutions.py` holds
one answer per name, `WRONG` a plausible mistake that each check must reject. A wrong answer is told
where it fails, never what the answer is.

    reduce_scatter_schedule(r, s, n)    (chunk rank r sends, chunk it receives) at reduce-scatter
                                        step s, played out in one process for n = 2 … 8
    broken_ring_survivor(c, n)          whose data chunk c ends with, on its owner, when each
                                        receive overwrites the local copy instead of adding to it

The ring itself (reduce-scatter, all-gather, all-reduce, and the bytes they send) is the lab:
lab.py, graded by `make lab-check N=2`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.exercise import attempt

from .plan import all_gather_chunks, chunk_sizes, reduce_scatter_chunks


def play_reduce_scatter(schedule: Callable[[int, int, int], tuple[int, int]], n: int,
                        fold: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.add,
                        ) -> list[list[torch.Tensor]]:
    """n ranks in one process, rank r holding 10**r everywhere. At step s every rank sends chunk
    schedule(r, s, n)[0] to r+1, which folds it into its copy of chunk schedule(r+1, s, n)[1]
    (all messages are read before anyone folds). Returns chunks[rank][i] after n-1 steps."""
    length = 2 * n + 1  # uneven chunks, none empty
    chunks = [list(torch.full((length,), 10.0**r, dtype=torch.float64).split(chunk_sizes(length, n)))
              for r in range(n)]
    for step in range(n - 1):
        sends = [int(schedule(r, step, n)[0]) % n for r in range(n)]
        messages = [chunks[r][sends[r]].clone() for r in range(n)]
        for r in range(n):
            right, expected = (r + 1) % n, int(schedule((r + 1) % n, step, n)[1]) % n
            if expected != sends[r]:
                raise ValueError(f"step {step}: rank {r} sends chunk {sends[r]}, but rank {right} "
                                 f"expects chunk {expected}")
            chunks[right][expected] = fold(messages[r], chunks[right][expected])
    return chunks


def check_reduce_scatter_schedule(fn: Callable[[int, int, int], tuple[int, int]]) -> bool:
    def check() -> tuple[bool, str]:
        for n in range(2, 9):
            total = sum(10.0**r for r in range(n))
            try:
                chunks = play_reduce_scatter(fn, n)
            except ValueError as mismatch:
                return False, f"n={n}: {mismatch}"
            for rank in range(n):
                held = chunks[rank][rank][0].item()
                if held != total:
                    complete = [c for c in range(n) if chunks[rank][c][0].item() == total]
                    return False, (f"n={n}: after n-1 steps rank {rank} holds {held:g} in chunk {rank}, "
                                   f"not the sum {total:g} (complete chunks on rank {rank}: {complete}); "
                                   "the all-gather starts from rank r owning chunk r")
        return True, "n = 2 … 8: after n-1 steps rank r holds chunk r summed over every rank"

    return attempt(check, "reduce_scatter_schedule")


def _overwrite(received: torch.Tensor, _own: torch.Tensor) -> torch.Tensor:
    """The aliasing bug's fold: the arriving partial replaces our copy instead of adding to it."""
    return received.clone()


def check_broken_ring_survivor(fn: Callable[[int, int], int]) -> bool:
    def check() -> tuple[bool, str]:
        for n in range(2, 7):
            chunks = play_reduce_scatter(reduce_scatter_chunks, n, fold=_overwrite)
            for c in range(n):
                survivor = round(torch.log10(chunks[c][c][0]).item())  # rank r held 10**r
                yours = int(fn(c, n))
                if yours != survivor:
                    return False, (f"n={n}: chunk {c} on its owner, rank {c}, does not hold rank {yours}'s "
                                   "data. Follow the chunk from the first rank that sends it: what is "
                                   "left of a copy when the next receive overwrites it?")
        return True, "n = 2 … 6: every chunk holds one rank's data, and the all-gather copies it everywhere"

    return attempt(check, "broken_ring_survivor")


EXERCISES: dict[str, Callable[[Callable], bool]] = {
    "reduce_scatter_schedule": check_reduce_scatter_schedule,
    "broken_ring_survivor": check_broken_ring_survivor,
}

WRONG: dict[str, Callable] = {
    "reduce_scatter_schedule": all_gather_chunks,  # a valid ring, but rank r ends owning chunk r+1
    "broken_ring_survivor": lambda c, n: c,  # the owner's own data: it is overwritten too
}
