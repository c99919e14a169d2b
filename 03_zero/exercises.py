"""Chapter 03's exercise: the check that lesson.ipynb calls on the student's function.

The check prints ✓ or ✗ with the figure that decided and returns a bool; it never raises (a
stub's NotImplementedError prints "✗ not solved yet"). It runs in one process, against the layout
the optimizer steps (`flat.make_groups`: one padded flat buffer per bucket, each cut in N slices).
On a wrong answer it says which case and what is inconsistent about yours, never the answer.

    owned_elements(buckets, n, r)   how many parameter elements (padding excluded) rank r of n
                                    owns over every bucket; `buckets` lists each bucket's tensor sizes
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from common.exercise import attempt
from common.kernel.model import build_model, get_config
from zero.flat import assign_buckets, make_groups

# `tiny` in reduce buckets of 20,000 elements (7 buckets), as lesson.ipynb's (b) lays it out
TINY_BUCKETS = [[p.numel() for _, p in bucket] for bucket in assign_buckets(
    list(build_model(get_config("tiny"), device="meta").named_parameters()), 20_000)]
CASES = [[[12, 4, 8]], [[10, 3, 1], [5]], [[1], [1], [1]], [[4096, 32, 32, 128, 7]], TINY_BUCKETS]


def engine_owned_elements(buckets: list[list[int]], n: int, r: int) -> int:
    """What make_groups lays out for rank r: per bucket, its slice's overlap with the parameters."""
    named = [[(f"p{i}", nn.Parameter(torch.empty(k, device="meta"))) for i, k in enumerate(bucket)]
             for bucket in buckets]
    return sum(max(0, min(g.start + g.shard_size, g.numel) - g.start) for g in make_groups(named, n, r))


def check_owned_elements(owned_elements: Callable) -> bool:
    """Every rank of five bucket layouts (`tiny`'s among them) on N = 1, 2, 3, 4, 7 ranks."""
    def body() -> tuple[bool, str]:
        for buckets in CASES:
            psi = sum(map(sum, buckets))
            for n in (1, 2, 3, 4, 7):
                yours = [int(owned_elements(buckets, n, r)) for r in range(n)]
                for r in range(n):
                    if yours[r] == engine_owned_elements(buckets, n, r):
                        continue
                    layout = buckets if buckets is not TINY_BUCKETS else "of tiny (20,000 elements)"
                    case = f"buckets {layout}, N={n}, rank {r}: yours {yours[r]:,}"
                    if sum(yours) != psi:
                        return False, (f"{case}; your N counts add up to {sum(yours):,}, but the buckets "
                                       f"hold {psi:,} parameters (is padding counted, or left unowned?)")
                    return False, (f"{case}; your counts add up to Ψ, but the optimizer does not cut "
                                   "these buckets that way (how many flat buffers are there?)")
        return True, "5 layouts × N = 1, 2, 3, 4, 7, every rank: your counts are the optimizer's layout"
    return attempt(body)


EXERCISES: dict[str, Callable[[Callable], bool]] = {"owned_elements": check_owned_elements}


def _owned_elements_of_one_buffer(buckets: list[list[int]], n: int, r: int) -> int:
    """Pads and cuts all buckets as one buffer: right for one bucket, wrong for several."""
    psi = sum(map(sum, buckets))
    s = -(-psi // n)
    return max(0, min((r + 1) * s, psi) - r * s)


WRONG: dict[str, Callable] = {"owned_elements": _owned_elements_of_one_buffer}
