"""Lab 05 · context: write ring attention's forward, on zig-zag blocks, merged online.

You write the mechanism of the lesson's "Context parallelism" (context_parallel.py is the
chapter's own, with its backward). The sequence of S tokens is cut into 2·cp chunks of c = S/(2·cp);
rank r of the CP group holds chunks r and 2·cp−1−r of every row, queries, keys and values alike
(zig-zag: an early chunk with a late one). Causal attention: a query chunk sees a key chunk fully
when the key chunk comes before it, causally when it is the same chunk (the diagonal), and not at
all when it comes after: that block is never computed. Then every rank computes the same work.

The keys and values travel around the ring: at each of cp steps a rank attends its queries to
the K/V it holds (first its own), while the next K/V is already on its way: post one
`batch_isend_irecv` group (send what you hold to the right neighbour, receive into a fresh buffer
from the left) before computing, wait for it after. cp − 1 transfers; after step s a rank holds
the K/V of rank r − s − 1. Each block's result merges exactly into the running one by the
log-sum-exp rule (the online softmax):

    lse = log(e^lse₁ + e^lse₂),    out = e^(lse₁ − lse) · out₁ + e^(lse₂ − lse) · out₂

starting from out = 0, lse = −inf (no key seen yet: keep it finite, no nan).

Tools: `attend_block` and `ring_neighbours` below (given); `x.chunk(n, dim)`, `torch.cat`;
`torch.logaddexp`; `dist.P2POp(dist.isend, t, peer, group)`, `dist.batch_isend_irecv([...])`
→ works, `w.wait()`; `torch.empty_like`. The grader replays your sends and receives under
NCCL's rules before any real run.

Check your work: `make lab-check N=5 LAB=context` (from the repo root), or
`grade(5, lab="context")` in the notebook: your layout and masks, the merge (scores in the
thousands, a query that sees no key), the ring on 2, 3 and 4 ranks and on groups of 2 of 4 ranks
against causal attention on one device (float64), and what the ring is for: the same work on
every rank, cp − 1 K/V blocks sent each. Only this file is yours to edit; keep the names and
signatures.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def ring_neighbours(group=None) -> tuple[int, int, int, int]:
    """(my rank in the group, its size n, the global rank of my right neighbour, of my left) (given)."""
    group = group if group is not None else dist.group.WORLD
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    return rank, n, dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q kᵀ/√d) v, the log-sum-exp of each query's scores) for one block of c queries
    and c keys; "causal": the same positions, keys after a query masked (given)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mode == "causal":
        lower = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~lower, float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def shard_sequence(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """x [..., S, d] → this rank's chunks r and 2·cp−1−r of the 2·cp along dim -2, side by side."""
    raise NotImplementedError("shard_sequence: the zig-zag pair of chunks")


def block_mode(q_chunk: int, k_chunk: int) -> str | None:
    """How query chunk `q_chunk` attends to key chunk `k_chunk`: "full", "causal" or None (skip)."""
    raise NotImplementedError("block_mode: full before, causal on the diagonal, nothing after")


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) so far and one more block's → over both key sets, exactly (−inf stays finite)."""
    raise NotImplementedError("merge: the log-sum-exp rule")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v [B, H, 2c, d]: this rank's zig-zag shards. Returns (out [B, H, 2c, d], lse [B, H, 2c])
    of causal attention of these queries over the whole sequence's keys."""
    raise NotImplementedError("ring_attention: cp steps, the next K/V posted before each block, merged")
