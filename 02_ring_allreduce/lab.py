"""Lab 02: write the ring all-reduce from point-to-point messages.

You write the mechanism of README "The idea: a ring". The n ranks stand in a ring: rank r sends
only to its right neighbour r+1 and receives only from its left neighbour r-1 (mod n). Each cuts
its length-L tensor into n chunks, chunk i of L//n elements plus one for the first L % n chunks
(torch.tensor_split's cut: L = 10, n = 4 gives 3, 3, 2, 2).

    reduce-scatter   n-1 steps; in each, every rank sends one partial chunk to the right and adds
                     the partial arriving from the left to its own copy of that chunk; at the end
                     rank r holds chunk r summed over every rank. You choose which chunk rank r
                     sends and receives at step s: what r sends at step s is what r+1 receives at
                     step s, at step 0 a rank sends its own data, later the partial it added last,
                     and chunk r's last hop must end at rank r (exercise (c) of the notebook).
    all-gather       n-1 steps; rank r starts with the complete chunk r, and in each step every
                     rank passes to the right the complete chunk it got last and stores the one
                     arriving from the left.
    all-reduce       = reduce-scatter, then all-gather: each rank sends 2(n-1) chunks,

                         bytes_r = 2(n-1)/n · S      (S = L · element size)

                     and AVG is the SUM divided by n (divide the chunk you own, once).

The rule of the GPU path (NCCL): a send completes only when the peer's matching receive runs, and
each rank's groups run in the order it posted them. Post each step's send and receive together,
in ONE `dist.batch_isend_irecv` group; a rank that posts its send and its receive as separate
groups (or two separate isend/irecv) waits in its send while its right neighbour waits in its own
send: a deadlock on GPUs that gloo on CPU never shows. The grader replays your sends and receives
under NCCL's rules before it moves any data.

Tools (all in torch):
- `dist.P2POp(dist.isend, tensor, peer, group)`, `dist.P2POp(dist.irecv, tensor, peer, group)`:
  one send or receive; `peer` is a global rank (`ring_of` below gives your neighbours).
- `dist.batch_isend_irecv([op, op, ...])` posts them as one group → a list of works; `w.wait()`.
- A receive writes into the tensor you give it: receive into a fresh buffer
  (`torch.empty_like`), then add, or the arriving data overwrites your own contribution.
- `tensor[start:stop]` is a view (writing into it writes the tensor); `.clone()` copies.

Check your work: `make lab-check N=2` (from the repo root), or `grade(2)` in the notebook. It runs
your functions on 2, 3 and 4 ranks and on a world of 4 cut into groups of 1 and 3 (so use the
`group` you are given), with lengths that the world size divides and lengths it does not, against
torch's own sum, and counts the bytes you send. Only this file is yours to edit; keep the names
and signatures (write helpers of your own as you like).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


def ring_of(group=None) -> tuple[int, int, int, int]:
    """(my rank in the group, the group's size n, the global rank of my right neighbour r+1, the
    global rank of my left neighbour r-1). Given: point-to-point ops address peers by global rank."""
    group = group if group is not None else dist.group.WORLD
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    return rank, n, dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """(start, stop) of chunk i = 0 … n-1 of a length-`length` tensor: length // n elements, one
    more for each of the first length % n chunks. chunk_bounds(10, 4) = [(0, 3), (3, 6), (6, 8), (8, 10)]."""
    raise NotImplementedError("chunk_bounds: (start, stop) of each of the n chunks, the first length % n "
                              "one longer")


def exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group=None) -> None:
    """Send `send` to the right neighbour and receive into `recv` from the left one, as ONE
    batch_isend_irecv group; return when both have completed."""
    raise NotImplementedError("exchange: one batch_isend_irecv group of a send to the right and a receive "
                              "from the left, then wait for both")


def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """A new tensor: chunk r (this rank's) of the sum over every rank's 1-D `tensor`, which stays
    unchanged. n-1 steps of `exchange`; this rank sends (L - chunk r's size) elements in all."""
    raise NotImplementedError("ring_reduce_scatter: n-1 exchanges; each adds the arriving partial chunk "
                              "to your copy; return chunk r")


def ring_all_gather(chunk: torch.Tensor, length: int, group=None) -> torch.Tensor:
    """A new 1-D tensor of `length` elements: chunk i is rank i's `chunk` (chunk_bounds' layout),
    on every rank. n-1 steps of `exchange`."""
    raise NotImplementedError("ring_all_gather: start from your own chunk in its place, n-1 exchanges "
                              "that pass complete chunks on")


def ring_all_reduce(tensor: torch.Tensor, op=SUM, group=None) -> None:
    """In place, like dist.all_reduce(tensor, op, group): op is SUM or AVG; every rank's 1-D
    `tensor` ends as the sum (or the mean) over the ranks. Compose the two functions above."""
    raise NotImplementedError("ring_all_reduce: ring_reduce_scatter, divide for AVG, ring_all_gather, "
                              "copy the result into tensor")
