"""Lab 05's optional properties (sequence parallelism's pair, ring attention's merge) and the
helpers that lab_check.py shares with them: seeded tensors, gathering the ranks' results,
counting the collectives a piece posts, and naming what a wrong tensor usually means.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.diagnosis import Finding, first_difference, near
from common.grader import Property
from common.patch import patch_dist

__all__ = ["EXTRA", "TPS", "WORLD", "B", "T", "agree", "close", "counting", "diagnose", "everyone",
           "first_difference", "rand", "to_rank0", "tp_group", "where"]
WORLD, TPS = 4, (2, 4)  # one job of 4 ranks: TP groups {0, 1} and {2, 3}, then one group of 4
B, T = 2, 3
TOLERANCE = 1e-10
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather",
               "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "broadcast",
               "all_to_all_single", "reduce")


# --- helpers --------------------------------------------------------------------------------------

def rand(tag: str, *shape: int, rank: int = 0) -> torch.Tensor:
    """Standard normal float64 values, a pure function of (tag, rank): the ranks and the
    grader's one-device reference draw the same numbers."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{rank}".encode()))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def everyone(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def to_rank0(obj) -> list | None:
    """Every rank's `obj`, as a list on rank 0 (what the grader gets back)."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def agree(ok: bool) -> bool:
    """True on every rank when `ok` is true on every rank: all go on, or none does."""
    return all(everyone(bool(ok)))


def where(tp: int, q: int) -> str:
    """Global rank q in words: its rank in its TP group of `tp`."""
    first = q // tp * tp
    ranks = "" if tp == WORLD else f" (ranks {first}–{first + tp - 1} of {WORLD})"
    return f"TP {tp}{ranks}, rank {q % tp}"


def tp_group(tp: int):
    """This rank's TP group of `tp` consecutive ranks (None: the whole world). Every rank makes
    every group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp == world:
        return None
    groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    return groups[rank // tp]


def close(got: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    """Within 1e-10 of `want` (max |got − want| / max |want|); nan never is."""
    if got is None or want is None:
        return got is None and want is None
    if got.shape != want.shape:
        return False
    got, want = got.detach().double(), want.detach().double()
    return bool((got - want).abs().max() <= TOLERANCE * max(float(want.abs().max()), 1e-30))


@contextmanager
def counting(lab) -> Iterator[list[str]]:
    """The names of the collectives posted inside (the outermost call only: an all-gather that
    calls another counts once), wrapped on torch.distributed and on your module."""
    calls: list[str] = []
    depth = [0]

    def wrap(name, fn):
        def call(*args, **kwargs):
            if depth[0] == 0:
                calls.append(name)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    with patch_dist({name: partial(wrap, name) for name in COLLECTIVES}, also=(c10d, lab)):
        yield calls


def diagnose(got, want, suspects: list[tuple[torch.Tensor, str]], t: int, what: str,
             finding: Finding | None = None) -> str:
    """The hint of the first suspect (what a typical bug computes) that `got` equals, else what
    the measured difference suggests."""
    for tensor, hint in suspects:
        if close(got, tensor):
            return hint
    finding = finding or first_difference({what: got}, {what: want}, TOLERANCE)
    if finding.missing:
        return f"no {what}: did it reach the tensor (a None gradient: backward returned None for it)?"
    if "shape" in finding.name:
        return "wrong shape: which features does this rank own, and is the result whole or split here?"
    if finding.zero:
        return f"{what} all zeros: nothing reached this tensor"
    if not math.isfinite(finding.rel):
        return f"{what} holds nan or inf"
    if near(finding.scale, t):
        return (f"{what} {t}× too large at world {t}: summed over the ranks where it was already whole "
                "(an all-reduce too many, or a replicated term added on every rank before a sum)")
    if near(finding.scale, 1 / t):
        return f"{what} {t}× too small at world {t}: averaged? TP sums partial results (SUM, no 1/t)"
    return (f"wrong values in {what}: a slice from the wrong offset or dimension, pieces joined in the "
            "wrong order, or a partial result never summed")


# --- 4 · optional: sequence parallelism's pair ----------------------------------------------------

def run_sp(lab, world: int) -> list:
    rank, s, seen = dist.get_rank(), 2, {}  # each rank holds s = 2 of the 2·tp tokens
    for tp in TPS:
        group, seen[tp] = tp_group(tp), {}
        x = rand("sp x", B, s, 4, rank=rank).requires_grad_()
        y = lab.gather_from_sequence_parallel_region(x, group, 1)
        seen[tp]["gather output"] = y.detach().clone()
        if agree(y.shape == (B, s * tp, 4)):
            (y * rand("sp gy", B, s * tp, 4, rank=rank)).sum().backward()
            seen[tp]["gather input grad"] = x.grad
        p = rand("sp p", B, s * tp, 4, rank=rank).requires_grad_()
        z = lab.reduce_scatter_to_sequence_parallel_region(p, group, 1)
        seen[tp]["reduce-scatter output"] = z.detach().clone()
        if agree(z.shape == (B, s, 4)):
            (z * rand("sp gz", B, s, 4, rank=rank)).sum().backward()
            seen[tp]["reduce-scatter input grad"] = p.grad
    return to_rank0(seen)


GATHER_SPLIT = ("this rank's slice of its own gradient only: every rank used all s tokens, so the "
                "slice's gradient is the sum over the ranks (reduce-scatter in backward)")
SCATTER_SPLIT = "this rank's own partial slice: the partial results are never summed (reduce-scatter)"
SCATTER_BACKWARD = ("only this rank's slice got a gradient: each rank's partial x fed every rank's slice "
                    "of the sum (all-gather in backward)")


def check_sp(runs) -> tuple[bool, str, str]:
    ranks, s = runs[0][1], 2
    for t in TPS:
        for q, results in enumerate(ranks):
            got, r, first = results[t], q % t, q // t * t
            xs = [rand("sp x", B, s, 4, rank=first + m) for m in range(t)]
            gys = [rand("sp gy", B, s * t, 4, rank=first + m) for m in range(t)]
            ps = [rand("sp p", B, s * t, 4, rank=first + m) for m in range(t)]
            gzs = [rand("sp gz", B, s, 4, rank=first + m) for m in range(t)]
            mine = slice(r * s, (r + 1) * s)
            own = torch.zeros(B, s * t, 4, dtype=torch.float64)
            own[:, mine] = gzs[r]
            want = {"gather output": torch.cat(xs, 1), "gather input grad": sum(gys)[:, mine],
                    "reduce-scatter output": sum(ps)[:, mine], "reduce-scatter input grad": torch.cat(gzs, 1)}
            suspects = {"gather output": [], "gather input grad": [(gys[r][:, mine], GATHER_SPLIT)],
                        "reduce-scatter output": [(ps[r][:, mine], SCATTER_SPLIT)],
                        "reduce-scatter input grad": [(own, SCATTER_BACKWARD)]}
            for key, value in want.items():
                if not close(got.get(key), value):
                    hint = diagnose(got.get(key), value, suspects[key], t, key)
                    finding = first_difference({key: got.get(key)}, {key: value})
                    return False, f"{where(t, q)}: {finding}", hint
    return True, "all-gather ⇄ reduce-scatter forward and backward exact at TP 2 and 4", ""


# --- 5 · optional: ring attention's merge ---------------------------------------------------------

def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None = None):
    """softmax(q kᵀ/√d) v over the keys `seen` [T, S] allows, and its log-sum-exp; a query that
    sees no key gets lse = −inf and a zero row (no nan, in forward or backward)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if seen is not None:
        scores = scores.masked_fill(~seen, float("-inf"))
    lse = scores.logsumexp(-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - safe[..., None]) @ v, lse


CASES = {"ordinary scores": 1.0, "scores in the thousands": 400.0, "a query that sees no key of set 2": 1.0}


def _merge_case(merge, name: str) -> dict:
    q = (CASES[name] * rand("q " + name, 1, 2, 4, 8)).requires_grad_()
    k, v = (rand(tag + name, 1, 2, 6, 8).requires_grad_() for tag in ("k ", "v "))
    seen = torch.ones(4, 6, dtype=torch.bool)
    if name.startswith("a query"):
        seen[0, 2:] = False
    out, lse = merge(*attend(q, k[..., :2, :], v[..., :2, :], seen[:, :2]),
                     *attend(q, k[..., 2:, :], v[..., 2:, :], seen[:, 2:]))
    result = {"out": out.detach().clone(), "lse": lse.detach().clone()}
    finite = bool(torch.isfinite(out).all() and torch.isfinite(lse).all())
    if finite and out.requires_grad:
        ((out * rand("go", *out.shape)).sum() + (lse * rand("gl", *lse.shape)).sum()).backward()
        grads = zip("qkv", (q, k, v), strict=True)
        result.update({f"d{n}": None if x.grad is None else x.grad.clone() for n, x in grads})
    return result


def run_merge(lab, world: int) -> dict:
    return {name: _merge_case(lab.merge_attention, name) for name in CASES}


def _reference_merge(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse)[..., None] * out1 + torch.exp(lse2 - lse)[..., None] * out2, lse


UNWEIGHTED = ("each part weighed 1: out_i is normalized over its own keys only; weigh it by its share "
              "of the whole sum, e^(lse_i − lse)")
OVERFLOW = ("nan/inf: e^lse overflows float64 past lse ≈ 709; work with differences of log-sum-exps "
            "(torch.logaddexp, e^(lse_i − lse))")
EMPTY = ("nan where a query saw no key of one set (lse_i = −inf): −inf − (−inf); torch.logaddexp and "
         "e^(lse_i − lse) stay finite there")


def check_merge(runs) -> tuple[bool, str, str]:
    got_all = runs[0][1]
    for name, got in got_all.items():
        want = _merge_case(_reference_merge, name)
        q = CASES[name] * rand("q " + name, 1, 2, 4, 8)
        k, v = (rand(tag + name, 1, 2, 6, 8) for tag in ("k ", "v "))
        halves = (*attend(q, k[..., :2, :], v[..., :2, :]), *attend(q, k[..., 2:, :], v[..., 2:, :]))
        suspects = {"out": [(halves[0] + halves[2], UNWEIGHTED)],
                    "lse": [(torch.maximum(halves[1], halves[3]), "lse is the log of both sets' sums of exp, "
                             "not the larger of the two"),
                            (halves[1] + halves[3], "log-sum-exps add in exp space: log(e^lse₁ + e^lse₂)")]}
        if not all(torch.isfinite(got[key]).all() for key in ("out", "lse")):
            bad = ", ".join(key for key in ("out", "lse") if not torch.isfinite(got[key]).all())
            return False, f"{name}: {bad} holds nan or inf", OVERFLOW if "thousands" in name else EMPTY
        for key in ("out", "lse", "dq", "dk", "dv"):
            if close(got.get(key), want[key]):
                continue
            value = got.get(key)
            if value is not None and not torch.isfinite(value).all():
                hint = f"nan or inf in {key}: " + (OVERFLOW if "thousands" in name else EMPTY)
            elif key not in got:
                hint = "no gradient: keep the merge in differentiable torch ops (no .detach(), no in-place)"
            else:
                hint = diagnose(value, want[key], suspects.get(key, []) if name == "ordinary scores" else [],
                                1, key)
            return False, f"{name}: {first_difference({key: value}, {key: want[key]})}", hint
    return True, f"{len(CASES)} cases (ordinary, scores in the thousands, an empty set): exact", ""


EXTRA = [
    Property("sequence parallelism: all-gather ⇄ reduce-scatter (TP 2 and 4)", [{"world": WORLD}],
             run_sp, check_sp, optional=True),
    Property("merge_attention: two partial attentions give the whole", [{"world": 1}], run_merge, check_merge,
             optional=True),
]
