"""Lab 02, the reference: the ring reduce-scatter and all-gather on batched isend/irecv, and the
ring all-reduce as their composition.

`make lab-check N=2 SOLUTION=1` grades this file with the same properties as your lab.py. Read it
after you have passed them, or when you are stuck for good.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


def ring_of(group=None) -> tuple[int, int, int, int]:
    """(my rank in the group, the group's size n, the global rank of my right neighbour r+1, the
    global rank of my left neighbour r-1). Point-to-point ops address peers by global rank."""
    group = group if group is not None else dist.group.WORLD
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    return rank, n, dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """(start, stop) of chunk i = 0 … n-1: length // n elements, one more for the first length % n."""
    bounds, start = [], 0
    for i in range(n):
        stop = start + length // n + (1 if i < length % n else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group=None) -> None:
    """Send `send` to the right and receive `recv` from the left as ONE group, then wait for both."""
    ops = [dist.P2POp(dist.isend, send, right, group), dist.P2POp(dist.irecv, recv, left, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


@torch.no_grad()
def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Chunk r of the sum over the ranks' tensors (`tensor` unchanged): at step s rank r sends its
    partial of chunk r-1-s and adds the arriving partial of chunk r-2-s (mod n) to its own."""
    rank, n, right, left = ring_of(group)
    chunks = [tensor[start:stop].clone() for start, stop in chunk_bounds(tensor.numel(), n)]
    for step in range(n - 1):
        send, recv = (rank - 1 - step) % n, (rank - 2 - step) % n
        arrived = torch.empty_like(chunks[recv])  # a fresh buffer: our own copy must survive
        exchange(chunks[send], arrived, right, left, group)
        chunks[recv] += arrived
    return chunks[rank]


@torch.no_grad()
def ring_all_gather(chunk: torch.Tensor, length: int, group=None) -> torch.Tensor:
    """Every rank's chunk, in rank order (`length` elements): at step s rank r passes chunk r-s on
    to the right and receives chunk r-1-s (mod n) from the left into its place."""
    rank, n, right, left = ring_of(group)
    out = torch.empty(length, dtype=chunk.dtype, device=chunk.device)
    chunks = [out[start:stop] for start, stop in chunk_bounds(length, n)]
    chunks[rank].copy_(chunk)
    for step in range(n - 1):
        exchange(chunks[(rank - step) % n], chunks[(rank - 1 - step) % n], right, left, group)
    return out


@torch.no_grad()
def ring_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> None:
    """In place, like dist.all_reduce: the reduce-scatter, the owner divides by n for AVG, then the
    all-gather. Each rank sends 2(n-1)/n · S bytes."""
    if op not in (SUM, AVG):
        raise ValueError(f"op={op}: this ring reduces with SUM or AVG only")
    mine = ring_reduce_scatter(tensor, group)
    if op == AVG:
        mine /= dist.get_world_size(group)
    tensor.copy_(ring_all_gather(mine, tensor.numel(), group))
