"""Chapter 01's exercises: each check takes the student's function, prints ✓ or ✗ with the figure
that decided, and returns a bool (it never raises). The notebook calls them; `solutions.py` holds
one answer per name, `WRONG` a plausible mistake that each check must reject.

    bytes_per_step(P, n, b)          = 2(n-1)/n · P · b        (ring all-reduce of every gradient)
    bucket_layout(sizes, cap)        = DDP's buckets: reverse registration order, ≤ cap bytes each
    grad_error_without_1_over_n(n)   = the relative gradient error `--check` reports when the 1/n
                                       is dropped (measured here on a one-process simulation)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from common.exercise import attempt
from common.model import build_model, get_config

from .ddp import assign_buckets


def check_bytes_per_step(fn: Callable[[int, int, int], float]) -> bool:
    cases = [(6_033_664, 4, 4), (123_424, 4, 8), (6_738_415_616, 8, 2), (1000, 2, 4), (10, 64, 4)]

    def check() -> tuple[bool, str]:
        for P, n, b in cases:
            truth, yours = 2 * (n - 1) / n * P * b, float(fn(P, n, b))
            if abs(yours - truth) > 1e-9 * truth:
                return False, f"P={P:,}, n={n}, b={b}: yours {yours:,.0f} B, the ring sends {truth:,.0f} B"
        P, n, b = cases[0]
        return True, f"P={P:,}, n={n}, float32: {2 * (n - 1) / n * P * b / 2**20:.2f} MiB per rank per step"

    return attempt(check, "bytes_per_step")


def _named_params(sizes_bytes: list[int]) -> list[tuple[str, nn.Parameter]]:
    """float32 parameters of the given byte sizes, on the meta device (no memory)."""
    return [(str(i), nn.Parameter(torch.empty(size // 4, device="meta")))
            for i, size in enumerate(sizes_bytes)]


def check_bucket_layout(fn: Callable[[list[int], float], list[list[int]]]) -> bool:
    small = [p.numel() * 4 for p in build_model(get_config("small"), device="meta").parameters()]
    cases = [([400, 400, 400, 400], 800), ([100, 2000, 100, 100], 1000), ([400] * 5, 1e9), ([40, 80], 0),
             (small, 4 * 2**20), (small, 25 * 2**20), (small, 0.5 * 2**20)]

    def check() -> tuple[bool, str]:
        for sizes, cap in cases:
            ddp = assign_buckets(_named_params(sizes), cap)
            truth = [[int(name) for name, _ in bucket] for bucket in ddp]
            yours = [list(map(int, bucket)) for bucket in fn(list(sizes), cap)]
            if yours != truth:
                shown = sizes if len(sizes) < 10 else f"the {len(sizes)} tensors of `small`"
                return False, (f"sizes {shown}, cap {cap:g} B: yours {_short(yours)}, DDP's {_short(truth)}")
        return True, f"`small` at a 4 MiB cap: {len(assign_buckets(_named_params(small), 4 * 2**20))} buckets"

    return attempt(check, "bucket_layout")


def _short(buckets: list[list[int]]) -> str:
    return str(buckets) if len(buckets) <= 6 else f"{len(buckets)} buckets starting {buckets[:2]}…"


def measured_error_without_1_over_n(n: int, seed: int = 0) -> float:
    """One process plays n ranks: each takes B/n rows of a batch, computes its mean-loss gradient,
    and the ranks' gradients are summed without the 1/n. Returns the max over tensors of
    max|g_broken − g| / max|g|, the figure `--check` prints, against the whole batch's gradient."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    x = torch.randn(4 * n, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (4 * n,), generator=gen)

    def grads(rows: slice) -> list[torch.Tensor]:
        model.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        return [p.grad.clone() for p in model.parameters()]

    whole = grads(slice(None))
    shards = [grads(slice(4 * r, 4 * r + 4)) for r in range(n)]
    summed = [sum(g[i] for g in shards) for i in range(len(whole))]  # all-reduce SUM, no division
    return max(((s - w).abs().max() / w.abs().max()).item() for s, w in zip(summed, whole, strict=True))


def check_grad_error_without_1_over_n(fn: Callable[[int], float]) -> bool:
    def check() -> tuple[bool, str]:
        for n in (2, 3, 4, 8):
            measured, yours = measured_error_without_1_over_n(n), float(fn(n))
            if abs(yours - measured) > 1e-6 * measured:
                return False, f"n={n}: you predict {yours:.4g}, the simulation measures {measured:.4g}"
        return True, f"n=4: measured {measured_error_without_1_over_n(4):.4f}, as you predicted"

    return attempt(check, "grad_error_without_1_over_n")


EXERCISES: dict[str, Callable[[Callable], bool]] = {
    "bytes_per_step": check_bytes_per_step,
    "bucket_layout": check_bucket_layout,
    "grad_error_without_1_over_n": check_grad_error_without_1_over_n,
}


def _forward_order_buckets(sizes: list[int], cap: float) -> list[list[int]]:
    """Greedy packing in registration order: the embedding's bucket would be ready last of all."""
    buckets: list[list[int]] = []
    size = 0
    for i, nbytes in enumerate(sizes):
        if not buckets or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


WRONG: dict[str, Callable] = {
    "bytes_per_step": lambda P, n, b: 2 * P * b / n,  # the article's "2 × data_size / N"
    "bucket_layout": _forward_order_buckets,
    "grad_error_without_1_over_n": lambda n: float(n),  # "n× too large" is an error of n − 1
}
