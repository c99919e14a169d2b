"""The alpha-beta (latency-bandwidth) cost model of an all-reduce, and its fit to measurements.

A message of m bytes costs alpha + m·beta: alpha is the fixed latency of one message (software,
wake-ups, the network's round trip), beta the seconds per byte (1 / link bandwidth). Counting the
messages each rank sends and the bytes on the critical path of an all-reduce of S bytes, n ranks:

    ring   2(n-1) steps of one S/n chunk, each  T = 2(n-1)·k·alpha + 2(n-1)/n · S·beta
           as k = ⌈(S/n) / segment⌉ messages
    naive  the root receives n-1 whole tensors  T = 2(n-1)·alpha   + 2(n-1)   · S·beta
           and then sends n-1 back

ring.py pipelines its segments, so part of those 2(n-1)·k latencies overlap (the critical path
holds about 2(n-1) + k - 1 of them); the model charges every message, an upper bound. Both pay
2(n-1) latencies for a tensor that fits one segment, so for tiny S they cost the same; for large S
the ring's time tends to 2·S·beta whatever n is, while the naive one grows as (n-1)·2·S·beta.
The measured algorithm bandwidth is S/T and the bus bandwidth (nccl-tests) busbw = S/T · 2(n-1)/n,
which for the ring tends to 1/beta: the link's own speed. `fit` finds alpha and beta from measured
times by least squares on relative error (times span five orders of magnitude, so absolute error would let the
largest sizes decide alone). Depends only on torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def ring_terms(size_bytes: float, n: int, segment_bytes: float | None = None) -> tuple[float, float]:
    """(messages, bytes) of the ring: 2(n-1)·⌈(S/n)/segment⌉ and 2(n-1)/n · S (one message per
    step when `segment_bytes` is None, e.g. for a ring whose segmentation is unknown)."""
    per_step = 1 if segment_bytes is None else max(1, math.ceil(size_bytes / n / segment_bytes))
    return 2.0 * (n - 1) * per_step, 2.0 * (n - 1) / n * size_bytes


def naive_terms(size_bytes: float, n: int) -> tuple[float, float]:
    """(messages, bytes) through the naive root: 2(n-1) and 2(n-1) · S."""
    return 2.0 * (n - 1), 2.0 * (n - 1) * size_bytes


TERMS = {"ring": ring_terms, "naive": naive_terms}


def bus_bandwidth(size_bytes: float, n: int, seconds: float) -> float:
    """nccl-tests' busbw of an all-reduce: algbw · 2(n-1)/n, with algbw = S / t (bytes/s)."""
    return size_bytes / seconds * (2.0 * (n - 1) / n)


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # seconds per message
    beta: float  # seconds per byte

    def time(self, algorithm: str, size_bytes: float, n: int, segment_bytes: float | None = None) -> float:
        messages, nbytes = (ring_terms(size_bytes, n, segment_bytes) if algorithm == "ring"
                            else TERMS[algorithm](size_bytes, n))
        return messages * self.alpha + nbytes * self.beta

    @property
    def bandwidth(self) -> float:
        """1/beta in bytes/s: the bus bandwidth the ring approaches for large tensors."""
        return 1.0 / self.beta if self.beta > 0 else float("inf")


def fit(messages: Sequence[float], nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """alpha, beta >= 0 minimising Σ ((messages·alpha + bytes·beta - t) / t)²."""
    m, b, t = (torch.tensor(x, dtype=torch.float64) for x in (messages, nbytes, seconds))
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
