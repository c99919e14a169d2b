"""Context parallelism's layouts and plan, as arithmetic: which tokens each of `cp` ranks holds,
which attention blocks it computes, and the ring's P2P groups (context_parallel.py runs them).

Layouts. The sequence is cut into chunks; a rank holds, in order,

    zigzag (2·cp chunks):   rank r holds chunks r and 2·cp-1-r      cp = 2:  [0 3] [1 2]
    contiguous (cp chunks): rank r holds chunk r                    cp = 2:  [0 1] [2 3] (halves)

Under a causal mask a query chunk sees key chunk a fully if a < its own index, masked if equal
(the diagonal), not at all if greater: that block is skipped, never computed. Contiguous ranks
do unequal work (the last rank attends to everything, the first to its own diagonal only);
zig-zag pairs an early chunk with a late one, so every rank does the same work (`load_balance`).
RoPE must use the global positions (`sequence_positions`), not 0 … s/cp - 1.

The ring's P2P groups are data (`ring_exchanges`, `ring_plan`): the code posts exactly those, and
the suite replays them under NCCL's rules (common/kernel/p2p_plan.find_deadlock). Every rank posts the
same sequence of groups, each pairing its sends right with its receives from the left.

Pure functions of sizes, plus the two that cut and join token tensors: nothing here touches a
process group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LAYOUTS = ("zigzag", "contiguous")


# --- layouts ------------------------------------------------------------------------------------


def check_cp_sizes(seq_len: int, cp: int, layout: str = "zigzag") -> None:
    """Raise ValueError naming the values and the fix when `seq_len` tokens do not split into the
    layout's equal chunks over `cp` ranks (before any collective)."""
    if layout not in LAYOUTS:
        raise ValueError(f"context-parallel layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    if cp < 1:
        raise ValueError(f"context-parallel size {cp} must be >= 1")
    n = _chunks(cp, layout)
    if seq_len % n:
        raise ValueError(f"context parallelism ({layout}) cuts the {seq_len} tokens of a sequence "
                         f"into {n} equal chunks (cp = {cp}): use a sequence length divisible by {n}")


def _chunks(cp: int, layout: str) -> int:
    """Chunks the sequence is cut into: 2·cp (zig-zag) or cp (contiguous)."""
    return 2 * cp if layout == "zigzag" else cp


def rank_chunks(cp: int, rank: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The chunks rank `rank` holds, in its local order: (r, 2·cp-1-r) or (r,)."""
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)


def sequence_positions(seq_len: int, cp: int, rank: int, layout: str = "zigzag",
                       device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of the tokens rank `rank` holds, in its local order (int64)."""
    check_cp_sizes(seq_len, cp, layout)
    size = seq_len // _chunks(cp, layout)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                      for c in rank_chunks(cp, rank, layout)])


def zigzag_positions(seq_len: int, cp: int, rank: int,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Chunks r and 2·cp-1-r of the 2·cp equal chunks of 0 … seq_len-1."""
    return sequence_positions(seq_len, cp, rank, "zigzag", device)


def contiguous_positions(seq_len: int, cp: int, rank: int,
                         device: torch.device | str | None = None) -> torch.Tensor:
    """Chunk r of the cp equal chunks of 0 … seq_len-1 (the naive layout)."""
    return sequence_positions(seq_len, cp, rank, "contiguous", device)


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1,
                   layout: str = "zigzag") -> torch.Tensor:
    """The tokens of `x` (the whole sequence along `dim`) that rank `rank` holds."""
    return x.index_select(dim, sequence_positions(x.shape[dim], cp, rank, layout, x.device))


def unshard_sequence(pieces: Sequence[torch.Tensor], dim: int = 1,
                     layout: str = "zigzag") -> torch.Tensor:
    """The whole sequence from every rank's piece (`pieces[r]` from rank r): shard_sequence⁻¹."""
    cp, local = len(pieces), pieces[0].shape[dim]
    order = torch.cat([sequence_positions(cp * local, cp, r, layout) for r in range(cp)])
    return torch.cat(list(pieces), dim).index_select(dim, order.argsort().to(pieces[0].device))


# --- which blocks a rank computes ---------------------------------------------------------------


def block_pairs(cp: int, rank: int, source: int, layout: str = "zigzag",
                causal: bool = True) -> list[tuple[int, int, str]]:
    """(query chunk, key chunk, "full" | "causal") that rank `rank` computes against the K/V of
    rank `source` (local chunk indices); a causal pair whose keys all follow its queries is
    absent (skipped)."""
    pairs = []
    for i, q_chunk in enumerate(rank_chunks(cp, rank, layout)):
        for j, k_chunk in enumerate(rank_chunks(cp, source, layout)):
            if not causal or k_chunk < q_chunk:
                pairs.append((i, j, "full"))
            elif k_chunk == q_chunk:
                pairs.append((i, j, "causal"))
    return pairs


def attention_work(seq_len: int, cp: int, rank: int, layout: str = "zigzag",
                   causal: bool = True) -> int:
    """Query-key pairs rank `rank` scores, unmasked ones only (c²; c(c+1)/2 on the diagonal)."""
    c = seq_len // _chunks(cp, layout)
    per_mode = {"full": c * c, "causal": c * (c + 1) // 2}
    return sum(per_mode[mode] for source in range(cp)
               for _, _, mode in block_pairs(cp, rank, source, layout, causal))


def load_balance(seq_len: int, cp: int, layout: str = "zigzag", causal: bool = True) -> float:
    """max / min attention work over the cp ranks: 1.0 is perfect balance."""
    work = [attention_work(seq_len, cp, r, layout, causal) for r in range(cp)]
    return max(work) / min(work)


# --- the ring's P2P plan ------------------------------------------------------------------------


def ring_exchanges(phase: str, cp: int) -> list[tuple[int, tuple[str, ...]]]:
    """Every group one rank posts in `phase` ("forward" / "backward"), in order, as (step, what):
    posted before computing step `step` (cp: after the last), sending each of `what` ("kv", "dkv")
    to the right and receiving its next one from the left.

    forward:  steps 0 … cp-2: the K/V of step + 1.
    backward: the K/V again; the dK/dV accumulator of a block starts at the rank after its home
              (the home rank keeps its own share) and hops on from step 2, home after the loop."""
    if phase == "forward":
        return [(step, ("kv",)) for step in range(cp - 1)]
    groups = [(step, ("kv",) * (step < cp - 1) + ("dkv",) * (step >= 2)) for step in range(cp)]
    return [(s, what) for s, what in groups if what] + ([(cp, ("dkv",))] if cp > 1 else [])


def ring_plan(phase: str, cp: int, kv_bytes: int, dkv_bytes: int | None = None,
              ranks: Sequence[int] | None = None) -> dict[int, list[list[tuple[str, int, int, str]]]]:
    """Every rank's ordered P2P groups for `phase` with K/V messages of `kv_bytes` (dK/dV of
    `dkv_bytes`, default the same), as common.kernel.p2p_plan.find_deadlock takes them; `ranks[i]` is
    group rank i's global rank."""
    ranks = list(range(cp)) if ranks is None else list(ranks)
    nbytes = {"kv": kv_bytes, "dkv": kv_bytes if dkv_bytes is None else dkv_bytes}
    plan = {}
    for r in range(cp):
        right, left = ranks[(r + 1) % cp], ranks[(r - 1) % cp]
        plan[ranks[r]] = [[op for name in what for op in
                           (("send", right, nbytes[name], f"{phase} step {step} {name}"),
                            ("recv", left, nbytes[name], f"{phase} step {step} {name}"))]
                          for step, what in ring_exchanges(phase, cp)]
    return plan
