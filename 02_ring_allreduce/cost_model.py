"""The alpha-beta (latency-bandwidth) cost model of an all-reduce, and its fit to measurements.

A message of m bytes costs alpha + m·beta: alpha is the fixed latency of one message (software,
wake-ups, the network's round trip), beta the seconds per byte (1 / link bandwidth). The model
charges what lies on the critical path of an all-reduce of S bytes on n ranks: the latencies a
rank waits for one after another, and the bytes the busiest link carries.

    ring   2(n-1) steps, each sending what the   T = 2(n-1)·k·alpha + 2(n-1)/n · S·beta
           step before brought (k = ⌈(S/n) / segment⌉ messages per step)
    naive  the n-1 senders send to the root at   T = 2·alpha          + 2(n-1)   · S·beta
           once (one latency), the root sends
           the n-1 results back to back (one more)

The ring's steps depend on each other: a rank sends at step s+1 the chunk it received (and, in the
reduce-scatter, folded in) at step s, so its 2(n-1) latencies add up. The naive root's messages do
not: the senders' n-1 messages are in flight together, and so are the root's n-1 replies, so it
waits two latencies whatever n is; but every byte crosses the root's link, (n-1)·S in and (n-1)·S
out. Small tensors are latency-bound, and there the naive root wins for n > 2: the two are equal at

    S* = n(n-2)/(n-1)² · alpha/beta      (`crossover_bytes`, for S/n within one segment)

and above it the ring wins by a factor that tends to n (n = 2: the ring is never slower). The root
still handles its 2(n-1) messages one after another, a per-message cost (LogP's overhead o) that
two terms cannot hold apart from alpha: where it is large (processes sharing a few CPU cores),
bench.py's fit per n folds it into alpha, which then grows with n for the naive root. ring.py
pipelines its segments, so part of its 2(n-1)·k latencies overlap (the critical path holds about
2(n-1) + k - 1 of them); the model charges every message, an upper bound for large S. The ring's
two terms are equal at S½ = n·alpha/beta (`half_bandwidth_bytes`, one segment per step), where
its bus bandwidth is half of 1/beta. The measured algorithm bandwidth is S/T and the bus bandwidth
(nccl-tests) busbw = S/T · 2(n-1)/n, which for the ring tends to 1/beta: the link's own speed.
`fit` finds alpha and beta from measured times by least squares on relative error (times span five
orders of magnitude, so absolute error would let the largest sizes decide alone). Depends only on
torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def ring_terms(size_bytes: float, n: int, segment_bytes: float | None = None) -> tuple[float, float]:
    """(latencies, bytes) of the ring: one per message, 2(n-1)·⌈(S/n)/segment⌉, and 2(n-1)/n · S
    (one message per step when `segment_bytes` is None, e.g. for a ring whose segmentation is
    unknown)."""
    per_step = 1 if segment_bytes is None else max(1, math.ceil(size_bytes / n / segment_bytes))
    return 2.0 * (n - 1) * per_step, 2.0 * (n - 1) / n * size_bytes


def naive_terms(size_bytes: float, n: int) -> tuple[float, float]:
    """(latencies, bytes) through the naive root: 2 (the n-1 senders at once, then the root's n-1
    replies back to back) and 2(n-1) · S on the root's link; nothing at all when n = 1."""
    return (2.0 if n > 1 else 0.0), 2.0 * (n - 1) * size_bytes


def crossover_bytes(alpha: float, beta: float, n: int) -> float:
    """S* = n(n-2)/(n-1)² · alpha/beta: below it the naive root is faster than the ring (its two
    latencies against the ring's 2(n-1)), above it the ring is (its 2(n-1)/n · S against the
    root's 2(n-1) · S). Exact while S*/n fits one segment; 0 for n <= 2 (the ring never loses)."""
    if n <= 2:
        return 0.0
    return n * (n - 2) / (n - 1) ** 2 * alpha / beta


def half_bandwidth_bytes(alpha: float, beta: float, n: int) -> float:
    """S½ = n · alpha/beta: the ring's 2(n-1) latencies equal its 2(n-1)/n · S·beta, so its bus
    bandwidth is half of 1/beta (one segment per step)."""
    return n * alpha / beta


def bus_bandwidth(size_bytes: float, n: int, seconds: float) -> float:
    """nccl-tests' busbw of an all-reduce: algbw · 2(n-1)/n, with algbw = S / t (bytes/s)."""
    return size_bytes / seconds * (2.0 * (n - 1) / n)


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # seconds per message
    beta: float  # seconds per byte

    def time(self, algorithm: str, size_bytes: float, n: int, segment_bytes: float | None = None) -> float:
        if algorithm not in ("ring", "naive"):
            raise ValueError(f"algorithm {algorithm!r}: the model knows 'ring' and 'naive'")
        latencies, nbytes = (ring_terms(size_bytes, n, segment_bytes) if algorithm == "ring"
                             else naive_terms(size_bytes, n))
        return latencies * self.alpha + nbytes * self.beta

    @property
    def bandwidth(self) -> float:
        """1/beta in bytes/s: the bus bandwidth the ring approaches for large tensors."""
        return 1.0 / self.beta if self.beta > 0 else float("inf")


def fit(latencies: Sequence[float], nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """alpha, beta >= 0 minimising Σ ((latencies·alpha + bytes·beta - t) / t)², each row's terms
    as `ring_terms` or `naive_terms` charge them."""
    m, b, t = (torch.tensor(x, dtype=torch.float64) for x in (latencies, nbytes, seconds))
    if len(t) < 2 or bool((t <= 0).any()):
        raise ValueError("fit needs at least two measurements, all with positive times")
    design = torch.stack([m / t, b / t], dim=1)  # each row divided by its t: relative residuals
    target = torch.ones_like(t)
    alpha, beta = torch.linalg.lstsq(design, target[:, None], driver="gelsd").solution[:, 0].tolist()
    if alpha >= 0 and beta >= 0:
        return AlphaBeta(alpha, beta)
    # A negative coefficient: the best fit with the other one alone (the constrained optimum).
    candidates = []
    for column in (0, 1):
        x = design[:, column]
        xx = float(x @ x)
        coef = max(float(x @ target) / xx, 0.0) if xx > 0 else 0.0
        candidates.append((float(((x * coef - target) ** 2).sum()), column, coef))
    _, column, coef = min(candidates)
    return AlphaBeta(coef, 0.0) if column == 0 else AlphaBeta(0.0, coef)
