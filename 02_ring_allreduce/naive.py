"""The naive all-reduce, for contrast: gather everything to one root, reduce there, send it back.

    every other rank sends its whole tensor to the root      the root receives (n-1) · S
    the root reduces, then sends the result to each of them  the root sends    (n-1) · S

The other ranks each send and receive only S, but they all wait on the root, whose link carries
(n-1)·S each way: the time grows linearly with n, where the ring's stays near 2S/bandwidth. Its
messages do not wait for each other: the n-1 senders send at once, and the root's n-1 replies
leave back to back, so it pays about two latencies where the ring pays 2(n-1) dependent steps;
for tiny tensors (latency-bound) it is the faster of the two (cost_model.py's `crossover_bytes`).
Built on blocking `dist.send`/`dist.recv`, the root receiving into one scratch buffer, one peer
after the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .agreement import (
    AVG,
    FAILED,
    SUM,
    CompletedWork,
    call_signature,
    check_message,
    raise_unless_all_agree,
    validate,
    wire_device,
)
from .ring import _FOLD


def naive_bytes_sent(size_bytes: int, rank: int, n: int, root: int = 0) -> int:
    """(n-1)·S for the root, S for everyone else (0 when n = 1)."""
    if n == 1:
        return 0
    return (n - 1) * size_bytes if rank == root else size_bytes


def _check_same_call(signature: int, root: int, device: torch.device, group, rank: int,
                     peers: list[int], root_global: int) -> None:
    """Everyone sends the root its 32-byte check message (agreement.py; the setting slot carries
    the root); the root sends back the elementwise MAX over all of them, so that every rank raises
    together if any rank's call is bad or differs."""
    mine = check_message(signature, root, device)
    extremes = mine.clone()
    if peers:  # this is the root
        heard = torch.empty_like(mine)
        for peer in peers:
            dist.recv(heard, peer, group=group)
            extremes = torch.maximum(extremes, heard)
        for peer in peers:
            dist.send(extremes, peer, group=group)
    else:
        dist.send(mine, root_global, group=group)
        dist.recv(extremes, root_global, group=group)
    high, low = tuple(extremes[:2].tolist()), tuple((-extremes[2:]).tolist())
    raise_unless_all_agree((signature, root), high, low, f"group rank {rank}", "naive_all_reduce", "root")


@torch.no_grad()
def naive_all_reduce(tensor: torch.Tensor, op=SUM, group=None, async_op: bool = False,
                     check: bool = True, root: int = 0) -> CompletedWork | None:
    """In place, like `dist.all_reduce`, by way of group rank `root`, which folds the others'
    tensors into its own in rank order: x_root ∘ x_0 ∘ x_1 ∘ … (AVG: SUM, then divide by n)."""
    group = group if group is not None else dist.group.WORLD
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the group it passed: "
                         "only the group's own ranks may call a collective on it")
    if not 0 <= root < n:
        raise ValueError(f"root={root} is not a rank of this {n}-rank group: use 0 … {n - 1}")
    root_global = dist.get_global_rank(group, root)
    # The root talks to every other rank (global ranks, as send/recv address them); the others
    # talk only to the root.
    peers = [dist.get_global_rank(group, p) for p in range(n) if p != root] if rank == root else []
    try:
        op = validate(tensor, op)
        signature, error = call_signature(tensor, op), None
    except (TypeError, ValueError) as local_error:
        signature, error = FAILED, local_error
    if check and n > 1:
        _check_same_call(signature, root if error is None else 0, wire_device(group, tensor), group,
                         rank, peers, root_global)
    if error is not None:
        raise error
    flat = tensor.view(-1)
    if n > 1 and rank == root:
        fold, received = _FOLD[SUM if op == AVG else op], torch.empty_like(flat)
        for peer in peers:  # (n-1)·S in, one peer after the other
            dist.recv(received, peer, group=group)
            fold(flat, received, out=flat)
        if op == AVG:
            flat.div_(n)
        for peer in peers:  # (n-1)·S out
            dist.send(flat, peer, group=group)
    elif n > 1:
        dist.send(flat, root_global, group=group)
        dist.recv(flat, root_global, group=group)  # our send has completed: flat is free again
    return CompletedWork() if async_op else None
