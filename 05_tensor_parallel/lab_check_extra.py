"""Lab 05's optional properties: sequence parallelism's pair and ring attention's merge.

Reported, never needed to pass; but written and wrong, they fail the lab like any property.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.labs.diagnosis import close, first_difference
from common.labs.grader import Fail, Property
from common.labs.rank import at
from common.labs.tools import rand, split
from tensor_parallel.lab_hints import (
    EMPTY,
    OVERFLOW,
    TPS,
    UNWEIGHTED,
    WORLD,
    B,
    attend,
    diagnose,
    reference_merge,
    where,
)

# --- 4 · sequence parallelism's pair --------------------------------------------------------------

S = 2  # tokens per rank


def run_sp(lab, world: int) -> dict:
    rank, seen = dist.get_rank(), {}
    for tp in TPS:
        group, seen[tp] = split([tp] * (WORLD // tp)).group, {}
        x = rand("sp x", B, S, 4, rank=rank).requires_grad_()
        at(phase=f"gather_from_sequence_parallel_region at TP {tp}")
        y = lab.gather_from_sequence_parallel_region(x, group, 1)
        seen[tp]["gather output"] = y.detach().clone()
        if y.shape == (B, S * tp, 4):
            (y * rand("sp gy", B, S * tp, 4, rank=rank)).sum().backward()
            seen[tp]["gather input grad"] = x.grad
        p = rand("sp p", B, S * tp, 4, rank=rank).requires_grad_()
        at(phase=f"reduce_scatter_to_sequence_parallel_region at TP {tp}")
        z = lab.reduce_scatter_to_sequence_parallel_region(p, group, 1)
        seen[tp]["reduce-scatter output"] = z.detach().clone()
        if z.shape == (B, S, 4):
            (z * rand("sp gz", B, S, 4, rank=rank)).sum().backward()
            seen[tp]["reduce-scatter input grad"] = p.grad
    return seen


GATHER_SPLIT = ("this rank's slice of its own gradient only: every rank used all s tokens, so the "
                "slice's gradient is the sum over the ranks (reduce-scatter in backward)")
SCATTER_SPLIT = "this rank's own partial slice: the partial results are never summed (reduce-scatter)"
SCATTER_BACKWARD = ("only this rank's slice got a gradient: each rank's partial x fed every rank's slice "
                    "of the sum (all-gather in backward)")


def check_sp(runs) -> Fail | str:
    """The all-gather along the sequence, whose backward reduce-scatters, and the reduce-scatter,
    whose backward all-gathers: outputs and input gradients exact on every rank (TP 2 and 4)."""
    for t in TPS:
        for q, results in enumerate(runs[0].ranks):
            got, r, first = results[t], q % t, q // t * t
            xs = [rand("sp x", B, S, 4, rank=first + m) for m in range(t)]
            gys = [rand("sp gy", B, S * t, 4, rank=first + m) for m in range(t)]
            ps = [rand("sp p", B, S * t, 4, rank=first + m) for m in range(t)]
            gzs = [rand("sp gz", B, S, 4, rank=first + m) for m in range(t)]
            mine = slice(r * S, (r + 1) * S)
            own = torch.zeros(B, S * t, 4, dtype=torch.float64)
            own[:, mine] = gzs[r]
            want = {"gather output": torch.cat(xs, 1), "gather input grad": sum(gys)[:, mine],
                    "reduce-scatter output": sum(ps)[:, mine], "reduce-scatter input grad": torch.cat(gzs, 1)}
            suspects = {"gather output": [], "gather input grad": [(gys[r][:, mine], GATHER_SPLIT)],
                        "reduce-scatter output": [(ps[r][:, mine], SCATTER_SPLIT)],
                        "reduce-scatter input grad": [(own, SCATTER_BACKWARD)]}
            for key, value in want.items():
                if not close(got.get(key), value):
                    hint = diagnose(got.get(key), value, suspects[key], t, key)
                    return Fail(f"{where(t, q)}: {first_difference({key: got.get(key)}, {key: value})}", hint)
    return "all-gather ⇄ reduce-scatter forward and backward exact at TP 2 and 4"


# --- 5 · ring attention's merge -------------------------------------------------------------------

CASES = {"ordinary scores": 1.0, "scores in the thousands": 400.0, "a query that sees no key of set 2": 1.0}


def _merge_case(merge, name: str) -> dict:
    q = (CASES[name] * rand("q " + name, 1, 2, 4, 8)).requires_grad_()
    k, v = (rand(tag + name, 1, 2, 6, 8).requires_grad_() for tag in ("k ", "v "))
    seen = torch.ones(4, 6, dtype=torch.bool)
    if name.startswith("a query"):
        seen[0, 2:] = False
    at(phase=f"merge_attention, {name}")
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


def check_merge(runs) -> Fail | str:
    """merge_attention of two partial attentions (out, lse) equals attention over both key sets,
    and its gradients too: ordinary scores, scores in the thousands, a query that sees no key of one
    set."""
    for name, got in runs[0].ranks[0].items():
        want = _merge_case(reference_merge, name)
        q = CASES[name] * rand("q " + name, 1, 2, 4, 8)
        k, v = (rand(tag + name, 1, 2, 6, 8) for tag in ("k ", "v "))
        halves = (*attend(q, k[..., :2, :], v[..., :2, :]), *attend(q, k[..., 2:, :], v[..., 2:, :]))
        suspects = {"out": [(halves[0] + halves[2], UNWEIGHTED)],
                    "lse": [(torch.maximum(halves[1], halves[3]), "lse is the log of both sets' sums of exp, "
                             "not the larger of the two"),
                            (halves[1] + halves[3], "log-sum-exps add in exp space: log(e^lse₁ + e^lse₂)")]}
        if not all(torch.isfinite(got[key]).all() for key in ("out", "lse")):
            bad = ", ".join(key for key in ("out", "lse") if not torch.isfinite(got[key]).all())
            return Fail(f"{name}: {bad} holds nan or inf", OVERFLOW if "thousands" in name else EMPTY)
        for key in ("out", "lse", "dq", "dk", "dv"):
            if close(value := got.get(key), want[key]):
                continue
            if value is not None and not torch.isfinite(value).all():
                hint = f"nan or inf in {key}: " + (OVERFLOW if "thousands" in name else EMPTY)
            elif key not in got:
                hint = "no gradient: keep the merge in differentiable torch ops (no .detach(), no in-place)"
            else:
                hint = diagnose(value, want[key], suspects.get(key, []) if name == "ordinary scores" else [],
                                1, key)
            return Fail(f"{name}: {first_difference({key: value}, {key: want[key]})}", hint)
    return f"{len(CASES)} cases (ordinary, scores in the thousands, an empty set): exact"


EXTRA = [
    Property("sequence parallelism: all-gather ⇄ reduce-scatter (TP 2 and 4)", [{"world": WORLD}],
             run_sp, [check_sp], optional=True),
    Property("merge_attention: two partial attentions give the whole", [{"world": 1}], run_merge,
             [check_merge], optional=True),
]
