"""What a wrong chunk of lab 02 usually means (its checks call these; lab_check.py says what runs).

Rank r's data is x_r[i] = (i + 1) · 10^r, so a sum spells its members in decimal digits: each
diagnosis decodes which ranks' data a wrong chunk holds, and how many times, and names the rule
the ring broke (which chunk a rank sends at step s, adding or replacing, receiving in place).
"""

from __future__ import annotations

import torch

from common.labs.diagnosis import TOLERANCE, close, explain, first_difference

RS_RULE = ("the chunk index rule: what rank r sends at step s, rank r+1 must receive at step s, and "
           "chunk r's last hop (step s = n-2) must end at rank r; draw the n = 3 ring on paper and "
           "follow chunk 0 from the rank that sends it first")
AG_RULE = ("the all-gather's chunk rule: rank r starts with the complete chunk r, sends it at step 0, "
           "then at step s passes on the chunk it received at step s-1, and stores each arriving "
           "chunk at that chunk's place in the output")


def data(rank: int, length: int) -> torch.Tensor:
    return (torch.arange(length, dtype=torch.float64) + 1) * 10.0**rank


def bounds(length: int, n: int) -> list[tuple[int, int]]:
    sizes = [len(t) for t in torch.arange(length).tensor_split(n)]
    return [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(n)]


def total(length: int, n: int) -> torch.Tensor:
    return torch.stack([data(r, length) for r in range(n)]).sum(0)


def members(got: torch.Tensor, start: int, n: int) -> list[int] | None:
    """How many times each rank's data is in `got` (elements start … of a sum of x_r), or None
    when `got` is not such a sum (garbage, a scaled sum, the wrong positions)."""
    if got.numel() == 0:
        return None
    m = got / (torch.arange(start, start + got.numel(), dtype=torch.float64) + 1)
    code = float(m[0])
    if not (torch.isfinite(m).all() and torch.allclose(m, torch.full_like(m, code), rtol=0, atol=1e-9)
            and abs(code - round(code)) < 1e-9 and 0 <= round(code) < 10**n):  # sums of integers: exact
        return None
    return [round(code) // 10**k % 10 for k in range(n)]


def who(counts: list[int]) -> str:
    ranks = [k for k, c in enumerate(counts) if c]
    twice = [k for k, c in enumerate(counts) if c > 1]
    return f"the data of ranks {ranks}" + (f", rank {twice[0]}'s {counts[twice[0]]} times" if twice else "")


def as_tensor(got) -> torch.Tensor | None:
    return got.detach().double().cpu().reshape(-1) if isinstance(got, torch.Tensor) else None


def _whole_world(got: torch.Tensor, n: int, world: int, length: int) -> str | None:
    """The hint when the result has the size of a chunk of the whole world, not of the group."""
    if n < world and any(got.numel() == b - a for a, b in bounds(length, world)) and \
            all(got.numel() != b - a for a, b in bounds(length, n)):
        return (f"your ring ran over all {world} ranks, not over the group of {n} you were given: pass "
                "group= on to ring_of and to every P2POp")
    return None


def diagnose_chunk(row: dict, n: int, length: int, rank: int, world: int) -> tuple[str, str] | None:
    """(what is wrong, hint) when rank `rank`'s reduce-scatter output is not chunk `rank` of the sum."""
    start, stop = bounds(length, n)[rank]
    want, got, where = total(length, n)[start:stop], as_tensor(row["got"]), f"chunk {rank} [{start}:{stop}]"
    if got is None:
        return f"returned {type(row['got']).__name__}, not a tensor", "return this rank's chunk of the sum"
    if got.numel() != want.numel():
        return f"returned {got.numel()} elements, {where} has {want.numel()}", \
            _whole_world(got, n, world, length) or "return chunk r, cut by chunk_bounds"
    if close(got, want):
        return ("your input tensor changed", "ring_reduce_scatter leaves its input as it was: work on "
                "clones of its chunks") if row["changed"] else None
    for j, (a, b) in enumerate(bounds(length, n)):
        if j != rank and b - a == got.numel() and torch.equal(got, total(length, n)[a:b]):
            return f"returned chunk {j} of the sum, expected {where}", \
                f"the complete chunk lands at the wrong rank (rank {rank} has chunk {j}): {RS_RULE}"
    counts = members(got, start, n)
    if counts is None:
        finding = first_difference({where: got}, {where: want})
        return f"{where}: {finding}", explain(finding, n, "results")
    detail = f"{where} holds {who(counts)}, expected every rank's once"
    if max(counts) > 1:
        return detail, ("a partial was added twice: add each arriving chunk once, into a copy no receive "
                        "writes")
    if counts == [int(k == rank) for k in range(n)]:
        return detail, f"chunk {rank} never arrived at rank {rank} (or you returned your input's): {RS_RULE}"
    if counts == [int(k == (rank + 1) % n) for k in range(n)]:
        return detail, ("each arriving partial replaced your copy instead of being added to it: receive "
                        "into a fresh buffer (torch.empty_like), then add it to your chunk")
    if n > 2 and counts == [int(k in (rank, (rank - 1) % n)) for k in range(n)]:
        return detail, ("every step sent your own data: from step 1 on, send the partial you added at "
                        "the step before (the chunk that just arrived, plus yours)")
    return detail, f"a chunk must visit every rank once, n-1 hops, adding at each: {RS_RULE}"


def diagnose_gather(row: dict, n: int, length: int, rank: int, world: int) -> tuple[str, str] | None:
    """(what is wrong, hint) when rank `rank`'s all-gather output is not every rank's chunk in place."""
    want = torch.cat([data(j, length)[a:b] for j, (a, b) in enumerate(bounds(length, n))])
    got = as_tensor(row["got"])
    if got is None:
        return f"returned {type(row['got']).__name__}, not a tensor", "return the gathered tensor"
    if got.numel() != length:
        return f"returned {got.numel()} elements, expected {length}", "the output has `length` elements"
    for j, (a, b) in enumerate(bounds(length, n)):
        if torch.equal(got[a:b], want[a:b]):
            continue
        where, counts = f"chunk {j} [{a}:{b}]", members(got[a:b], a, n)
        if j == rank:
            return f"{where}, this rank's own, does not hold its chunk", \
                f"put your own chunk in its place first, and never receive into it: {AG_RULE}"
        if counts is not None and sum(counts) == 0:
            return f"{where} is all zeros, never received", f"n-1 receives, each into its place: {AG_RULE}"
        if counts is not None and sum(counts) == 1:
            return f"{where} holds rank {counts.index(1)}'s chunk {j}, expected rank {j}'s", \
                f"another rank's data at chunk {j}'s place: {AG_RULE}"
        if counts is not None:
            return f"{where} holds {who(counts)} added up", \
                "the all-gather stores each arriving chunk (its receive lands in place); it adds nothing"
        detail = (f"{where} holds no rank's chunk ({float(got[a]):.3g} where rank {j}'s has "
                  f"{float(want[a]):g})")
        return detail, f"never received, or passed on by a rank that did not have it yet: {AG_RULE}"
    return None


def diagnose_all_reduce(row: dict, n: int, length: int, rank: int, world: int) -> tuple[str, str] | None:
    """(what is wrong, hint) when rank `rank`'s tensor is not what dist.all_reduce gives."""
    got, want = as_tensor(row["got"]), total(length, n) / (n if row["op"] == "AVG" else 1)
    if close(got, want):
        return None
    if got is not None and torch.equal(got, data(rank, length)) and n > 1:
        return "the tensor is unchanged", \
            "ring_all_reduce works in place, like dist.all_reduce: copy the result into `tensor`"
    i = int(((got - want).abs() > TOLERANCE * want.abs()).nonzero()[0])
    chunk = next(j for j, (a, b) in enumerate(bounds(length, n)) if a <= i < b)
    counts = members(got[i:i + 1], i, n) if row["op"] == "SUM" else None
    finding = first_difference({"tensor": got}, {"tensor": want})
    return f"element {i} (chunk {chunk}) is {float(got[i]):g}{f' ({who(counts)})' if counts else ''}, " \
           f"dist.all_reduce gives {float(want[i]):g}; {finding}", explain(finding, n, "results")
