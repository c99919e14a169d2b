"""Chapter 03's exercises: the checks that lesson.ipynb calls on the student's functions.

Each check prints ✓ or ✗ with the figure that decided and returns a bool; it never raises (a
stub's NotImplementedError prints "✗ not solved yet"). Both run in one process, against the code
the engine runs: `accounting.memory_formula` (what the report prints beside the ledger) and
`flat.make_groups` (the flat layout the optimizer steps).

    zero_bytes(stage, psi, n, b_p, b_g, K)   per-rank bytes of params + grads + optimizer state:
                                             stage ≥ 1 shards the K·Ψ, ≥ 2 the b_g·Ψ, 3 the b_p·Ψ
    owned_slice(numels, n, r)                (start, end) of the flat slice rank r owns:
                                             [r·s, (r+1)·s), s = ⌈Σ numels / n⌉
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from common.exercise import attempt
from zero.accounting import memory_formula
from zero.flat import make_groups

# (Ψ, N, b_p, b_g, K): the paper's 7B, this engine's bf16 recipe (fp32 grads), float32 AdamW, SGD
CASES = [(7_000_000_000, 8, 2, 2, 12), (7_000_000_000, 64, 2, 2, 12), (6_033_664, 4, 2, 4, 12),
         (123_424, 4, 4, 4, 8), (123_427, 3, 8, 8, 0)]


def check_zero_bytes(zero_bytes: Callable) -> bool:
    """Stages 0-3 on five (Ψ, N, b_p, b_g, K) against accounting.memory_formula, to 1 byte."""
    def body() -> tuple[bool, str]:
        for psi, n, b_p, b_g, k in CASES:
            for stage in range(4):
                want = sum(memory_formula(stage, psi, n, b_p, b_g, k).values())
                got = zero_bytes(stage, psi, n, b_p, b_g, k)
                if not abs(got - want) <= 1:
                    return False, (f"stage {stage}, Ψ={psi:,}, N={n}, b_p={b_p}, b_g={b_g}, K={k}: "
                                   f"yours {got:,.0f} B, memory_formula {want:,.0f} B")
        return True, "stages 0-3 × 5 cases: every total equals memory_formula (7B on 8: 112 → 14 GB)"
    return attempt(body)


def check_owned_slice(owned_slice: Callable) -> bool:
    """Every rank of five layouts (N = 1…4, 7; sums divisible by N or not) against the FlatGroup
    that flat.make_groups builds from those parameter sizes."""
    def body() -> tuple[bool, str]:
        layouts = [[12, 4, 8], [10, 3, 1], [4096, 32, 32, 128, 7], [5], [1, 1]]
        for numels in layouts:
            params = [(f"p{i}", nn.Parameter(torch.empty(k, device="meta"))) for i, k in enumerate(numels)]
            for n in (1, 2, 3, 4, 7):
                for r in range(n):
                    (group,) = make_groups([params], world=n, rank=r)
                    want = (group.start, group.start + group.shard_size)
                    got = tuple(owned_slice(numels, n, r))
                    if got != want:
                        return False, (f"sizes {numels} (Σ = {sum(numels)}), N={n}, rank {r}: yours {got}, "
                                       f"the engine's [{want[0]}, {want[1]}) (padded to {group.padded})")
        return True, "5 layouts × N = 1, 2, 3, 4, 7, every rank: your slices are the engine's"
    return attempt(body)


EXERCISES: dict[str, Callable[[Callable], bool]] = {"zero_bytes": check_zero_bytes,
                                                    "owned_slice": check_owned_slice}


def _zero_bytes_in_the_wrong_order(stage: int, psi: int, n: int, b_p: int, b_g: int, k: float) -> float:
    """Shards the parameters first (stage 1), then the gradients, then the optimizer state."""
    return (b_p * psi / (n if stage >= 1 else 1) + b_g * psi / (n if stage >= 2 else 1)
            + k * psi / (n if stage >= 3 else 1))


def _owned_slice_without_padding(numels: list[int], n: int, r: int) -> tuple[int, int]:
    """s = Σ // n: the last elements belong to no one when n does not divide the sum."""
    s = sum(numels) // n
    return r * s, (r + 1) * s


WRONG: dict[str, Callable] = {"zero_bytes": _zero_bytes_in_the_wrong_order,
                              "owned_slice": _owned_slice_without_padding}
