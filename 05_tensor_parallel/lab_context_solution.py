"""Lab 05 · context, the reference: ring attention's forward on zig-zag blocks, merged online.

`make lab-check N=5 LAB=context SOLUTION=1` grades this file with the same properties as your
lab_context.py. Read it after you have passed them, or when you are stuck for good.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def ring_neighbours(group=None) -> tuple[int, int, int, int]:
    """(my rank in the group, its size n, the global rank of my right neighbour, of my left)."""
    group = group if group is not None else dist.group.WORLD
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    return rank, n, dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q kᵀ/√d) v, the log-sum-exp of each query's scores) for one block of c queries
    and c keys; "causal": the same positions, keys after a query masked."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mode == "causal":
        lower = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~lower, float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def shard_sequence(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Chunks rank and 2·cp−1−rank of the 2·cp along the sequence (dim -2), side by side."""
    chunks = x.chunk(2 * cp, dim=-2)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=-2)


def block_mode(q_chunk: int, k_chunk: int) -> str | None:
    """Earlier keys are all seen, the diagonal is causal, later keys are never computed."""
    return "full" if k_chunk < q_chunk else "causal" if k_chunk == q_chunk else None


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-sum-exp rule; a query that has seen no key yet has lse = −inf and out = 0."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    return torch.exp(lse - safe)[..., None] * out + torch.exp(block_lse - safe)[..., None] * block_out, new


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each step posts the K/V transfer of the next step (one group: send right, receive left),
    then attends to the K/V it holds, merging; n steps, n − 1 transfers."""
    rank, n, right, left = ring_neighbours(group)
    c = q.shape[-2] // 2
    mine = (rank, 2 * n - 1 - rank)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    kv, source = torch.stack([k, v]).contiguous(), rank
    for step in range(n):
        if step < n - 1:
            arriving = torch.empty_like(kv)  # a fresh buffer: the one we attend to stays intact
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, right, group),
                                            dist.P2POp(dist.irecv, arriving, left, group)])
        theirs = (source, 2 * n - 1 - source)
        for i, qc in enumerate(mine):
            rows = slice(i * c, (i + 1) * c)
            for j, kc in enumerate(theirs):
                if (mode := block_mode(qc, kc)) is None:
                    continue
                keys = slice(j * c, (j + 1) * c)
                block = attend_block(q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :], mode)
                out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], *block)
        if step < n - 1:
            for work in works:
                work.wait()
            kv, source = arriving, (source - 1) % n
    return out, lse
