"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): the sequence split over P
ranks everywhere except inside attention, where one all-to-all trades the split for the heads.

Each rank holds t = s/P tokens of all H heads. One all-to-all (q, k, v packed) gives it all s tokens
of H/P heads; it attends exactly as one device would (a head needs only its own q, k, v), and a
second all-to-all sends each head block's output back to the ranks holding those tokens:

    q, k, v [B, H, s/P, d] ─all-to-all→ [B, H/P, s, d] ─attention→ [B, H/P, s, d] ─all-to-all→ [B, H, s/P, d]

Backward is the same pair in reverse (an even all-to-all's adjoint is itself). Bytes per rank per
layer, e bytes per element, H_kv' = max(H_kv, P) K/V heads sent (below):

    forward  (P-1)/P · b·(s/P)·d·(2H + 2H_kv')·e     (q, k, v out; the output back)
    backward the same (dout out; dq, dk, dv back)

so they fall as 1/P where the ring's (P-1) K/V blocks stay ≈ constant; but P can not exceed the
heads (P·tp ≤ H), and both all-to-alls sit on the critical path (nothing to overlap them with).

GQA: rank r gets query heads [r·H/P, (r+1)·H/P). If P divides H_kv it gets K/V heads
[r·H_kv/P, (r+1)·H_kv/P), the ones those queries use; if H_kv divides P, each K/V head is repeated
P/H_kv times before the all-to-all, so each rank receives the one its query heads share (autograd
sums the copies' gradients). Other head counts are refused.

Hybrid (USP, Fang & Zhao 2024): cp = u × r ranks, Ulysses inside groups of u, the ring across:
`hybrid_attention` gathers a ring block's tokens for H/u heads with the all-to-all, runs
context_parallel.ring_attention over the ring group on them, and all-to-alls back.

Imports torch, context_layout.py and context_parallel.py (for the hybrid's ring) only.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .context_layout import check_cp_sizes, sequence_positions, shard_sequence, unshard_sequence
from .context_parallel import ring_attention

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def check_ulysses_sizes(seq_len: int, heads: int, kv_heads: int, cp: int, tp: int = 1,
                        layout: str = "zigzag") -> None:
    """Raise ValueError naming the values and the fix when Ulysses over `cp` ranks (inside TP of
    `tp`) cannot split these heads or this sequence (call it on every rank, before any collective)."""
    check_cp_sizes(seq_len, cp, layout)
    local, kv = heads // tp, kv_heads // tp if kv_heads >= tp else 1  # one TP rank's heads
    if cp * tp > heads:
        raise ValueError(f"Ulysses splits heads: cp {cp} × tp {tp} = {cp * tp} ranks > {heads} query "
                         f"heads (its ceiling); use cp·tp ≤ {heads}, or ring attention for more ranks")
    if local % cp:
        raise ValueError(f"Ulysses over cp = {cp} ranks splits the {local} query heads of a TP rank "
                         f"(H {heads} / tp {tp}) into equal blocks: use a cp that divides {local}")
    if kv % cp and cp % kv:
        raise ValueError(f"Ulysses over cp = {cp} ranks cannot give each rank the K/V heads its query "
                         f"heads use: {kv} K/V heads per TP rank neither divide nor are a multiple of "
                         f"cp; use a cp that divides {kv} or is a multiple of it")


def kv_heads_sent(kv_heads: int, cp: int) -> int:
    """H_kv' = max(H_kv, cp): the K/V heads going into the all-to-all (repeated when fewer than cp)."""
    return max(kv_heads, cp)


class _AllToAll(torch.autograd.Function):
    """x [P, …] → [P, …]: block j goes to rank j, block i of the result came from rank i.
    Backward: the same exchange of the gradient (the permutation's transpose is itself)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def exchange(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable even all-to-all over dim 0 of x [P, …] (`dist.all_to_all_single`)."""
    return _AllToAll.apply(x, group)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """One device's attention on [B, H, s, d] (k, v: [B, H_kv, s, d], each repeated for its group)."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, layout: str) -> None:
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "q [B, H, t, d] and k, v [B, H_kv, t, d]")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
    check_ulysses_sizes(q.shape[2] * cp, q.shape[1], k.shape[1], cp, layout=layout)


def to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> torch.Tensor:
    """What a rank sends in the first all-to-all: [P: the destination, B, H/P + 2·H_kv'/P, t, d],
    block j holding head block j of q, k and v (K/V repeated to cp heads when fewer)."""
    if kv_heads_sent(k.shape[1], cp) > k.shape[1]:
        k, v = (x.repeat_interleave(cp // k.shape[1], dim=1) for x in (k, v))
    return torch.cat([x.unflatten(1, (cp, -1)) for x in (q, k, v)], dim=2).movedim(1, 0)


def from_tokens(received: torch.Tensor, layout: str) -> torch.Tensor:
    """What arrived from every rank [P: the source, B, h, t, d] → [B, h, s, d] in sequence order."""
    return unshard_sequence(received.unbind(0), dim=2, layout=layout)


def to_tokens(out: torch.Tensor, cp: int, layout: str) -> torch.Tensor:
    """The second all-to-all's send: [B, h, s, d] → [P: the destination, B, h, t, d], its tokens."""
    return torch.stack([shard_sequence(out, cp, r, 2, layout) for r in range(cp)])


def from_heads(received: torch.Tensor) -> torch.Tensor:
    """Every head block of this rank's tokens [P: the source, B, h, t, d] → [B, P·h, t, d]."""
    return received.movedim(0, 1).flatten(1, 2)


def _ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, layout: str,
             attend: Attend) -> torch.Tensor:
    """All-to-all to [B, H/P, s, d] (tokens in sequence order for `layout`), attend, all-to-all back."""
    cp = dist.get_world_size(group)
    send = to_heads(q, k, v, cp)
    hq, hk = q.shape[1] // cp, (send.shape[2] - q.shape[1] // cp) // 2
    whole = from_tokens(exchange(send, group), layout)  # [B, hq + 2hk, s, d]
    out = attend(*whole.split([hq, hk, hk], dim=1))  # [B, hq, s, d]
    return from_heads(exchange(to_tokens(out, cp, layout), group))  # [B, H, t, d]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                      causal: bool = True, layout: str = "zigzag") -> torch.Tensor:
    """softmax(Q Kᵀ/√d [+ causal mask]) V of this rank's t = s/cp tokens q [B, H, t, d] (k, v
    [B, H_kv, t, d], in `layout`'s order) over the whole sequence, by two all-to-alls.
    Returns [B, H, t, d]. Differentiable (backward: the all-to-alls in reverse)."""
    _check(q, k, v, dist.get_world_size(group), layout)
    return _ulysses(q, k, v, group, layout, partial(local_attention, causal=causal))


# --- hybrid: Ulysses inside, the ring across ------------------------------------------------------


def check_hybrid_sizes(seq_len: int, heads: int, kv_heads: int, ulysses: int, ring: int, tp: int = 1,
                       layout: str = "zigzag") -> None:
    """`check_ulysses_sizes` for the u = `ulysses` ranks of a group, each of whose ring ranks holds
    s/r tokens of `layout` over r = `ring` ranks (ValueError naming the values and the fix)."""
    check_cp_sizes(seq_len, ring, layout)
    check_ulysses_sizes(seq_len // ring, heads, kv_heads, ulysses, tp, "contiguous")


def hybrid_positions(seq_len: int, ulysses: int, ring: int, ulysses_rank: int, ring_rank: int,
                     layout: str = "zigzag", device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions a hybrid rank holds: its ring rank's `layout` tokens (of `ring` ranks),
    cut into `ulysses` contiguous pieces, piece `ulysses_rank`."""
    return sequence_positions(seq_len, ring, ring_rank, layout, device).chunk(ulysses)[ulysses_rank]


def hybrid_shard(x: torch.Tensor, ulysses: int, ring: int, ulysses_rank: int, ring_rank: int,
                 dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """The tokens of `x` (the whole sequence along `dim`) that hybrid rank (ulysses_rank, ring_rank) holds."""
    index = hybrid_positions(x.shape[dim], ulysses, ring, ulysses_rank, ring_rank, layout, x.device)
    return x.index_select(dim, index)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses_group, ring_group,
                     causal: bool = True, layout: str = "zigzag") -> torch.Tensor:
    """`ulysses_attention` over `ulysses_group` (u ranks) whose attention is `ring_attention` over
    `ring_group` (r ranks): cp = u·r ranks, each holding `hybrid_shard` tokens q [B, H, s/cp, d]."""
    u, r = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    _check(q, k, v, u, "contiguous")
    check_hybrid_sizes(q.shape[2] * u * r, q.shape[1], k.shape[1], u, r, layout=layout)
    ring = partial(ring_attention, group=ring_group, causal=causal, layout=layout)
    return _ulysses(q, k, v, ulysses_group, "contiguous", ring)


def apply_ulysses(module: nn.Module, group, ring_group=None, layout: str = "zigzag") -> None:
    """Every attention of `module` (each submodule with common.kernel.model's `attend` hook) attends
    causally by Ulysses over `group` (hybrid: with the ring over `ring_group`); the caller feeds each
    rank its `shard_sequence` tokens (hybrid: `hybrid_shard`) and their global positions. In place."""
    attend = (partial(ulysses_attention, group=group, causal=True, layout=layout) if ring_group is None
              else partial(hybrid_attention, ulysses_group=group, ring_group=ring_group, causal=True,
                           layout=layout))
    hooked = [sub for sub in module.modules() if hasattr(sub, "attend")]
    if not hooked:
        raise ValueError("apply_ulysses: no attention with an `attend` hook in the module")
    for sub in hooked:
        sub.attend = attend
