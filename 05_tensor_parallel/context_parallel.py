"""Context parallelism (CP): the sequence split over `cp` ranks for attention too, exactly.

TP splits a layer's heads, SP the norms' tokens; attention still needs every key for each query.
CP gives each rank s/cp tokens of every sequence (queries, keys and values alike) and moves the K/V
blocks instead: in the ring variant each rank's K/V travel around the ring, one block per step,
the next block's transfer posted before the current block's attention; each query block's partial
results merge exactly by the log-sum-exp (online softmax) rule

    lse = log(e^lse₁ + e^lse₂),    out = e^(lse₁ - lse) · out₁ + e^(lse₂ - lse) · out₂

and backward runs the ring again, the dK/dV accumulators travelling with the blocks until they
are home. The all-gather variant (Llama 3's) gathers every K/V block at once and reduce-scatters
dK/dV: fewer bytes, no overlap, and the whole sequence's K/V held per rank.

The layouts (zig-zag, contiguous), the work each rank does and the ring's P2P plan as data are
pure arithmetic, in context_layout.py: this file posts exactly that plan.

A drop-in piece: this file imports only torch, context_layout.py and common/kernel/collectives.py (copy
all three). Use it by
`apply_context_parallel(model, cp_group)` on a model whose attention modules call a swappable
`attend(q, k, v)` (common/kernel/model.py's Attention), or call `ring_attention(q, k, v, group)` from
your own attention; feed each rank its `shard_sequence` tokens and RoPE at their
`sequence_positions`.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.collectives import all_gather_single, reduce_scatter_single

from .context_layout import (
    block_pairs,
    check_cp_sizes,
    rank_chunks,
    ring_exchanges,
)

VARIANTS = ("ring", "all_gather")


# --- block attention ----------------------------------------------------------------------------


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q kᵀ·scale) v, log-sum-exp of each row) for one block."""
    scores = _scores(q, k, mode, scale)
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def _scores(q: torch.Tensor, k: torch.Tensor, mode: str, scale: float) -> torch.Tensor:
    """q kᵀ·scale; "causal" (a diagonal block: the same positions) masks keys after each query."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if mode == "causal":
        lower = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~lower, float("-inf"))
    return scores


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place: (out, lse) ← the exact softmax over both key sets (the log-sum-exp rule)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new)[..., None]).add_(block_out * torch.exp(block_lse - new)[..., None])
    lse.copy_(new)


def _repeat(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, H_kv, t, d] → [B, H_kv·group, t, d]: each K/V head for its group of query heads."""
    return x.repeat_interleave(group, dim=1)


def _unrepeat(x: torch.Tensor, group: int) -> torch.Tensor:
    """The gradient of `_repeat`: sum each head's group."""
    return x.unflatten(1, (-1, group)).sum(2)


class _Local:
    """One rank's queries and what it needs to attend with any K/V block: its chunks, the scale,
    the GQA group, the compute dtype (float32 or better)."""

    def __init__(self, q: torch.Tensor, kv_heads: int, cp: int, rank: int, layout: str, causal: bool):
        self.cp, self.rank, self.layout, self.causal = cp, rank, layout, causal
        self.n = len(rank_chunks(cp, rank, layout))
        self.dtype = torch.promote_types(q.dtype, torch.float32)
        self.scale, self.group = 1 / math.sqrt(q.shape[-1]), q.shape[1] // kv_heads

    def kv(self, kv: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """A stacked K/V block [2, B, H_kv, t, d] → (K chunks, V chunks), repeated to H heads."""
        k, v = (_repeat(x.to(self.dtype), self.group) for x in kv.unbind(0))
        return k.chunk(self.n, 2), v.chunk(self.n, 2)

    def attend(self, q, out, lse, kv: torch.Tensor, source: int) -> None:
        """Merge the attention of the queries to the K/V block of rank `source` into (out, lse)."""
        (ks, vs), qs = self.kv(kv), q.chunk(self.n, 2)
        outs, lses = out.chunk(self.n, 2), lse.chunk(self.n, 2)
        for i, j, mode in block_pairs(self.cp, self.rank, source, self.layout, self.causal):
            _merge(outs[i], lses[i], *_block_forward(qs[i], ks[j], vs[j], mode, self.scale))

    def grad(self, q, dout, lse, delta, dq, kv: torch.Tensor, source: int) -> torch.Tensor:
        """Add the block's share to dq (in place); return its dK/dV [2, B, H_kv, t, d].
        P = exp(S - lse), dV = Pᵀ dO, dS = P ⊙ (dO Vᵀ - rowsum(dO ⊙ O)), dQ = dS K·c, dK = dSᵀ Q·c."""
        (ks, vs), n = self.kv(kv), self.n
        qs, dos, lses, deltas, dqs = (x.chunk(n, 2) for x in (q, dout, lse, delta, dq))
        dk, dv = (q.new_zeros(ks[0].shape[:2] + kv.shape[-2:]) for _ in range(2))
        dks, dvs = dk.chunk(n, 2), dv.chunk(n, 2)
        for i, j, mode in block_pairs(self.cp, self.rank, source, self.layout, self.causal):
            p = torch.exp(_scores(qs[i], ks[j], mode, self.scale) - lses[i][..., None])
            dvs[j].add_(p.transpose(-1, -2) @ dos[i])
            ds = p * (dos[i] @ vs[j].transpose(-1, -2) - deltas[i][..., None])
            dqs[i].add_(ds @ ks[j] * self.scale)
            dks[j].add_(ds.transpose(-1, -2) @ qs[i] * self.scale)
        return torch.stack((_unrepeat(dk, self.group), _unrepeat(dv, self.group)))


def ring_step(q, out, lse, kv, cp: int, rank: int, source: int, layout: str = "zigzag"):
    """One ring step of rank `rank`, no communication: (out, lse) merged with its queries' causal
    attention to rank `source`'s K/V block [2, B, H_kv, t, d], as new tensors (start: 0, -inf)."""
    out, lse = out.clone(), lse.clone()
    _Local(q, kv.shape[2], cp, rank, layout, True).attend(q, out, lse, kv, source)
    return out, lse


# --- the two variants ---------------------------------------------------------------------------


class _Ring:
    """This rank's neighbours on the CP group (global ranks, as P2POp takes them)."""

    def __init__(self, group) -> None:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.group, self.cp, self.rank = group, len(ranks), dist.get_rank(group)
        self.right, self.left = ranks[(self.rank + 1) % self.cp], ranks[(self.rank - 1) % self.cp]

    def post(self, sends: dict[str, torch.Tensor], recvs: dict[str, torch.Tensor],
             what: tuple[str, ...]) -> list:
        """One group: each of `what` sent right, its next one received from the left."""
        ops = [op for name in what for op in (dist.P2POp(dist.isend, sends[name], self.right, self.group),
                                              dist.P2POp(dist.irecv, recvs[name], self.left, self.group))]
        return dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _gather_blocks(kv: torch.Tensor, ring: _Ring) -> torch.Tensor:
    """Every rank's K/V block [2, B, H_kv, t, d] → [cp, 2, B, H_kv, t, d] (one all-gather)."""
    if ring.cp == 1:
        return kv[None]
    out = kv.new_empty((ring.cp, *kv.shape))
    all_gather_single(out, kv[None].contiguous(), group=ring.group)
    return out


def _scatter_sums(shares: torch.Tensor, ring: _Ring) -> torch.Tensor:
    """Σ over ranks of shares [cp, …], this rank keeping row `rank` (one reduce-scatter, SUM)."""
    if ring.cp == 1:
        return shares[0]
    out = shares.new_empty((1, *shares.shape[1:]))
    reduce_scatter_single(out, shares.contiguous(), group=ring.group)
    return out[0]


def _arrived_home(own: torch.Tensor, travelled: torch.Tensor) -> torch.Tensor:
    """A block's dK/dV: its home rank's share plus the accumulator that went round the ring."""
    return own + travelled


def _ring_forward(local: _Local, q, kv, ring: _Ring):
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    posted = dict(ring_exchanges("forward", ring.cp))
    for step in range(ring.cp):
        works, arriving = [], None
        if step in posted:  # the next block flies while this one is computed
            arriving = torch.empty_like(kv)
            works = ring.post({"kv": kv}, {"kv": arriving}, posted[step])
        local.attend(q, out, lse, kv, (ring.rank - step) % ring.cp)
        _wait(works)
        kv = arriving
    return out, lse


def _ring_backward(local: _Local, q, kv, dout, lse, delta, ring: _Ring):
    dq = torch.zeros_like(q)
    posted = dict(ring_exchanges("backward", ring.cp))
    own = travelling = None
    for step in range(ring.cp):
        works, sends, recvs = [], {"kv": kv, "dkv": travelling}, {}
        if step in posted:
            recvs = {name: torch.empty_like(sends[name]) for name in posted[step]}
            works = ring.post(sends, recvs, posted[step])
        share = local.grad(q, dout, lse, delta, dq, kv, (ring.rank - step) % ring.cp)
        _wait(works)
        if step == 0:
            own = share
        else:  # step 1 starts the accumulator of the block from rank - 1; later steps add to it
            travelling = share + recvs["dkv"] if "dkv" in recvs else share
        kv = recvs.get("kv")
    if ring.cp > 1:
        home = torch.empty_like(travelling)
        _wait(ring.post({"dkv": travelling}, {"dkv": home}, posted[ring.cp]))
        own = _arrived_home(own, home)
    return dq, own


class _ContextParallelAttention(torch.autograd.Function):
    """Exact attention of this rank's queries to the whole sequence's keys, in either variant."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal: bool, layout: str, variant: str):
        ring = _Ring(group)
        local = _Local(q, k.shape[1], ring.cp, ring.rank, layout, causal)
        kv = torch.stack((k, v))
        qc = q.to(local.dtype)
        if variant == "ring":
            out, lse = _ring_forward(local, qc, kv, ring)
        else:  # every rank's K/V block [cp, 2, B, H_kv, t, d], kept for backward
            kv = _gather_blocks(kv, ring)
            out = torch.zeros_like(qc)
            lse = torch.full(qc.shape[:-1], float("-inf"), dtype=qc.dtype, device=qc.device)
            for source in range(ring.cp):
                local.attend(qc, out, lse, kv[source], source)
        out = out.to(q.dtype)
        ctx.save_for_backward(qc, kv, out, lse)  # the output as returned, in the input dtype
        ctx.ring, ctx.local, ctx.variant, ctx.dtypes = ring, local, variant, (q.dtype, k.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        local, ring = ctx.local, ctx.ring
        dout = dout.to(local.dtype)
        delta = (dout * out.to(local.dtype)).sum(-1)
        if ctx.variant == "ring":
            dq, dkv = _ring_backward(local, q, kv, dout, lse, delta, ring)
        else:
            dq = torch.zeros_like(q)
            shares = torch.stack([local.grad(q, dout, lse, delta, dq, kv[s], s) for s in range(ring.cp)])
            dkv = _scatter_sums(shares, ring)
        q_dtype, kv_dtype = ctx.dtypes
        return dq.to(q_dtype), dkv[0].to(kv_dtype), dkv[1].to(kv_dtype), None, None, None, None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, layout: str) -> None:
    cp = dist.get_world_size(group)
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "q [B, H, t, d] and k, v [B, H_kv, t, d]")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
    check_cp_sizes(q.shape[2] * cp, cp, layout)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                   causal: bool = True, layout: str = "zigzag") -> torch.Tensor:
    """softmax(Q Kᵀ/√d [+ causal mask]) V of this rank's t = s/cp queries q [B, H, t, d] over the
    whole sequence, whose K/V (k, v [B, H_kv, t, d] here, in `layout`'s order) go round the ring.
    Returns [B, H, t, d]. Differentiable: backward runs the ring again and sends dK/dV home."""
    _check(q, k, v, group, layout)
    return _ContextParallelAttention.apply(q, k, v, group, causal, layout, "ring")


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                         causal: bool = True, layout: str = "zigzag") -> torch.Tensor:
    """`ring_attention` by one all-gather of K/V (kept for backward), dK/dV reduce-scattered."""
    _check(q, k, v, group, layout)
    return _ContextParallelAttention.apply(q, k, v, group, causal, layout, "all_gather")


def apply_context_parallel(module: nn.Module, group, variant: str = "ring",
                           layout: str = "zigzag") -> None:
    """Every attention of `module` (each submodule with common.kernel.model's `attend` hook) attends
    causally through CP over `group`; the caller feeds each rank its `shard_sequence` tokens and
    their `sequence_positions` for RoPE. In place."""
    if variant not in VARIANTS:
        raise ValueError(f"context-parallel variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    attend = partial(ring_attention if variant == "ring" else all_gather_attention,
                     group=group, causal=True, layout=layout)
    hooked = [sub for sub in module.modules() if hasattr(sub, "attend")]
    if not hooked:
        raise ValueError("apply_context_parallel: no attention with an `attend` hook in the module")
    for sub in hooked:
        sub.attend = attend
