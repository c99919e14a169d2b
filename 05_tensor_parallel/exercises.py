"""Chapter 05's exercises: the checks that lesson.ipynb calls on the student's functions.

Each check prints ✓ or ✗ with the figure that decided and returns a bool; it never raises (a
stub's NotImplementedError prints "✗ not solved yet"). Everything runs in one process: the t
"ranks" are list entries and the all-reduce is a Python sum.

    shard(weight, kind, t, r)   rank r's piece of a torch [out, in] weight, kind "column" or "row":
                                Megatron's MLP  Y = Σ_r GeLU(X A_rᵀ) B_rᵀ  must equal GeLU(X Aᵀ) Bᵀ
    block_bytes(b, s, h, t, e)  wire bytes per rank of one block's forward + backward without SP:
                                4 all-reduces (2 g forward, 2 f backward) · 2(t−1)/t · b·s·h·e
    zigzag_positions(s, cp, r)  the global positions context-parallel rank r holds: chunks r and
                                2·cp−1−r of 2·cp, so every rank does the same causal attention work
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.exercise import attempt
from tensor_parallel import context_parallel
from tensor_parallel.formulas import Shape, block_comm_bytes


def check_shard(shard: Callable) -> bool:
    """The MLP on t simulated ranks (t = 1, 2, 4; torch's [out, in] weights: A is [ffn, h], column-
    parallel; B is [h, ffn], row-parallel) against the dense one, float64, to 1e-12; and A's pieces
    in rank order (an all-gather of the column-parallel outputs gives X Aᵀ)."""
    def body() -> tuple[bool, str]:
        g = torch.Generator().manual_seed(0)
        h, ffn = 8, 24
        x = torch.randn(5, h, generator=g, dtype=torch.float64)
        a = torch.randn(ffn, h, generator=g, dtype=torch.float64)
        b = torch.randn(h, ffn, generator=g, dtype=torch.float64)
        dense = F.gelu(x @ a.T) @ b.T
        for t in (1, 2, 4):
            pieces = [(shard(a, "column", t, r), shard(b, "row", t, r)) for r in range(t)]
            for r, (a_r, b_r) in enumerate(pieces):
                if a_r.numel() * t != a.numel() or b_r.numel() * t != b.numel():
                    return False, (f"t={t} rank {r}: A piece {list(a_r.shape)}, B piece {list(b_r.shape)};"
                                   f" a rank holds 1/t of A {list(a.shape)} and of B {list(b.shape)}")
            gathered = torch.cat([x @ a_r.T for a_r, _ in pieces], dim=-1)  # an all-gather, rank order
            error = (gathered - x @ a.T).abs().max().item()
            if not error < 1e-12:
                return False, (f"t={t}: the column-parallel outputs all-gathered in rank order differ "
                               f"from X Aᵀ by {error:.3g} (the vocab head gathers them like this)")
            y = sum(F.gelu(x @ a_r.T) @ b_r.T for a_r, b_r in pieces)  # the sum is g's all-reduce
            error = (y - dense).abs().max().item()
            if not error < 1e-12:
                return False, f"t={t}: max |Σ_r Y_r − Y_dense| = {error:.3g} (want < 1e-12)"
        return True, f"t=1,2,4: Σ_r GeLU(X A_rᵀ) B_rᵀ equals the dense MLP (max error {error:.1e})"
    return attempt(body)


def check_block_bytes(block_bytes: Callable) -> bool:
    """Against formulas.block_comm_bytes (what the meter measures) on five shapes, t = 1…8."""
    def body() -> tuple[bool, str]:
        for b, s, h, t, e in [(8, 64, 256, 4, 2), (1, 4096, 8192, 8, 2), (2, 32, 64, 2, 4),
                              (4, 128, 512, 1, 2), (3, 48, 96, 3, 8)]:
            shape = Shape(b, s, h, 8, 8, 4 * h, 1, 256, h // 8, t, False, e)
            want = sum(block_comm_bytes(shape).values())
            got = block_bytes(b, s, h, t, e)
            if abs(got - want) > 1e-9 * max(want, 1):
                return False, (f"b={b} s={s} h={h} t={t} e={e}: yours {got:,.0f} B, "
                               f"formulas.block_comm_bytes {want:,.0f} B")
        return True, "5 shapes, t = 1…8: every figure equals formulas.block_comm_bytes"
    return attempt(body)


def check_zigzag_positions(zigzag_positions: Callable) -> bool:
    """Against tensor_parallel.zigzag_positions for s ≤ 48, cp = 1…4, every rank; then the
    figure that matters: max/min causal attention work over the ranks of the student's layout."""
    def body() -> tuple[bool, str]:
        for s, cp in [(8, 2), (16, 4), (12, 3), (4, 1), (48, 4)]:
            got = [[int(p) for p in zigzag_positions(s, cp, r)] for r in range(cp)]
            # causal work of a query at position p: the p + 1 keys it sees
            work = [sum(p + 1 for p in positions) for positions in got]
            balance = max(work) / max(min(work), 1)
            if sorted(p for positions in got for p in positions) != list(range(s)):
                return False, f"s={s} cp={cp}: the ranks' positions are not 0…{s - 1} once each: {got}"
            want = [context_parallel.zigzag_positions(s, cp, r).tolist() for r in range(cp)]
            if got != want:
                r = next(r for r in range(cp) if got[r] != want[r])
                return False, (f"s={s} cp={cp} rank {r}: yours {got[r]} (work max/min over the ranks "
                               f"{balance:.2f}); chunks {r} and {2 * cp - 1 - r} of {2 * cp} are {want[r]}")
        return True, f"s ≤ 48, cp = 1…4: every rank's positions right; causal work max/min {balance:.2f}"
    return attempt(body)


EXERCISES: dict[str, Callable[[Callable], bool]] = {"shard": check_shard, "block_bytes": check_block_bytes,
                                                    "zigzag_positions": check_zigzag_positions}


def _shard_like_the_paper(weight: torch.Tensor, kind: str, t: int, r: int) -> torch.Tensor:
    """The paper's A = [A_1 … A_t] read onto torch's [out, in] layout: columns and rows swapped."""
    return weight.chunk(t, dim=1 if kind == "column" else 0)[r]


def _block_bytes_forward_only(b: int, s: int, h: int, t: int, e: int) -> float:
    """Counts g's two forward all-reduces and forgets f's two in backward."""
    return 2 * 2 * (t - 1) / t * b * s * h * e


def _zigzag_without_the_mirror(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Chunks r and r + cp: two chunks per rank, but the late ranks still hold the late tokens."""
    c = seq_len // (2 * cp)
    late = rank + cp
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


WRONG: dict[str, Callable] = {"shard": _shard_like_the_paper, "block_bytes": _block_bytes_forward_only,
                               "zigzag_positions": _zigzag_without_the_mirror}
