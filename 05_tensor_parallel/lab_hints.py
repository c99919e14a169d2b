"""What a wrong tensor of lab 05 usually means (its checks call these; lab_check.py says what runs).

For each piece the check recomputes on one device what a rank must hold and compute, and what
the typical bugs compute instead (this rank's own partial, f and g swapped, a sum where the tensor
was already whole, a split over the world instead of the group, the bias added before the
reduction): a wrong tensor equal to one of those suspects gets that suspect's hint.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from common.labs.diagnosis import close, first_difference, near, suspect
from common.labs.tools import rand

WORLD, TPS = 4, (2, 4)  # one job of 4 ranks: TP groups {0, 1} and {2, 3}, then one group of 4
B, T, IN, OUT = 2, 3, 8, 12
COLUMN_NAMES = ("wq", "wk", "wv", "w1", "w3")  # split along dim 0 (rows); wo, w2 along dim 1
SWAPPED = " (f and g swapped?)"
AVERAGED = "averaged: TP sums partial results (ReduceOp.SUM, no 1/t)"
EVERYWHERE = "summed over all {world} ranks, not over the {tp} of its TP group: pass group= to the collective"
F_FORWARD = "f's forward summed over the ranks: f is the identity forward, its all-reduce is in backward"
F_OWN = ("the input's gradient is this rank's own only, missing the other ranks' contributions: "
         "f's backward must all-reduce (SUM) it")
G_OWN = "g's forward returned this rank's partial: the partial outputs must be summed (all-reduce)"
G_BACKWARD = ("summed over the ranks in backward: g's output and its gradient are already whole on "
              "every rank, so g's backward is the identity")
SWAPPED_BOTH = ("f and g are swapped: f = identity forward, all-reduce backward; g = all-reduce forward, "
                "identity backward")
X_REDUCED = "X was summed over the ranks in forward: f is the identity forward, its all-reduce is in backward"
F_MISSING = ("the input's gradient is this rank's partial only: every rank used all of X, so dL/dX "
             "is the sum over the ranks (f's all-reduce in backward is missing)")
F_SUBLAYER = F_MISSING.replace(")", ": f on the sub-layer's input)")
G_MISSING = "the output is this rank's partial sum: the partial outputs are never added (g, forward)"
GATHER_SUMMED = ("summed over the ranks: every rank computed the same loss from the gathered Y, so the "
                 "gather's backward keeps this rank's slice of the gradient (no sum)")
GROUP_SIZE = ("split over all {world} ranks, not over the {tp} of the TP group: use "
              "dist.get_world_size(group) and dist.get_rank(group)")


def where(tp: int, q: int) -> str:
    """Global rank q in words: its rank in its TP group of `tp`."""
    first = q // tp * tp
    ranks = "" if tp == WORLD else f" (ranks {first}–{first + tp - 1} of {WORLD})"
    return f"TP {tp}{ranks}, rank {q % tp}"


def diagnose(got, want, suspects: list[tuple[torch.Tensor, str]], t: int, what: str, finding=None) -> str:
    """The hint of the first suspect `got` equals, else what the measured difference suggests."""
    if (hint := suspect(got, suspects)) is not None:
        return hint
    finding = finding or first_difference({what: got}, {what: want})
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


# --- the parallel linears ----------------------------------------------------------------------

def full_linear(out: int = OUT) -> nn.Linear:
    linear = nn.Linear(IN, out, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(rand("A", out, IN))
        linear.bias.copy_(rand("b", out))
    return linear


def fg_case(t: int, q: int) -> tuple[dict, dict]:
    """One device: what f and g must give rank q in TP groups of t (each op's output and input
    gradient, for (x · w).sum()), and the suspects: what typical bugs compute instead."""
    xs, ws = ([rand(name, 3, 4, rank=p) for p in range(WORLD)] for name in ("x", "w"))
    members = range(q // t * t, q // t * t + t)
    sx, sw = sum(xs[m] for m in members), sum(ws[m] for m in members)
    want = {"f": {"output": xs[q], "input grad": sw}, "g": {"output": sx, "input grad": ws[q]}}
    suspects = {("f", "output"): [(sx, F_FORWARD + SWAPPED)], ("f", "input grad"): [(ws[q], F_OWN)],
                ("g", "output"): [(xs[q], G_OWN + SWAPPED)],
                ("g", "input grad"): [(sw, G_BACKWARD + SWAPPED)]}
    for op, key in (("f", "input grad"), ("g", "output")):  # the two sums
        suspects[op, key].append((want[op][key] / t, AVERAGED))
        if t < WORLD:
            everything = sum(xs) if key == "output" else sum(ws)
            suspects[op, key].append((everything, EVERYWHERE.format(world=WORLD, tp=t)))
    return want, suspects


def linear_case(t: int, r: int, kind: str, gather: bool | None) -> tuple[dict, dict]:
    """One device: what rank r of t must hold and compute (the full linear's output and
    gradients, sliced), and the suspects: what typical bugs compute instead, with their hints."""
    linear = full_linear()
    X, G = rand("X", B, T, IN).requires_grad_(), rand("G", B, T, OUT)
    Y = linear(X)
    (Y * G).sum().backward()
    A, b, X, Y = linear.weight.detach(), linear.bias.detach(), X.detach(), Y.detach()
    twice = GATHER_SUMMED if gather else G_BACKWARD + SWAPPED
    if kind == "column":
        cut = slice(r * OUT // t, (r + 1) * OUT // t)
        want = {"weight": A[cut], "bias": b[cut], "output": Y if gather else Y[..., cut], "input grad": G @ A,
                "weight grad": linear.weight.grad[cut], "bias grad": linear.bias.grad[cut]}
        suspects = {"output": [((t * X) @ A[cut].T + b[cut], X_REDUCED + SWAPPED)],
                    "input grad": [(G[..., cut] @ A[cut], F_MISSING)]}
    else:
        cut = slice(r * IN // t, (r + 1) * IN // t)
        want = {"weight": A[:, cut], "bias": b, "output": Y, "input grad": (G @ A)[..., cut],
                "weight grad": linear.weight.grad[:, cut], "bias grad": linear.bias.grad}
        suspects = {"output": [(X[..., cut] @ A[:, cut].T + b, G_MISSING + SWAPPED),
                               (X[..., cut] @ A[:, cut].T, G_MISSING + SWAPPED),
                               (Y + (t - 1) * b, f"the bias is counted {t}× (once per rank): it was added "
                                                 "before the reduction; add it once, after g")],
                    "input grad": []}
    suspects["input grad"].append((t * want["input grad"], twice))
    suspects |= {key: [(t * want[key], twice)] for key in ("weight grad", "bias grad")}
    return want, suspects


def weight_error(got: dict, want: dict, t: int, r: int, kind: str) -> tuple[str, str] | None:
    """(detail, hint) when rank r's weight or bias is not its slice of the full linear's."""
    w, full, dim = got["weight"], (OUT, IN), 0 if kind == "column" else 1
    if w.shape != want["weight"].shape:
        owns = "output features (rows" if kind == "column" else "input features (columns"
        hint = f"rank r owns 1/t of the {owns} of torch's [out, in] weight): {list(want['weight'].shape)}"
        whole = 1 - dim  # the dim every rank keeps whole
        if w.dim() == 2 and w.shape[dim] * WORLD == full[dim] and w.shape[whole] == full[whole]:
            hint = GROUP_SIZE.format(world=WORLD, tp=t)
        elif w.dim() == 2 and (w.shape[whole] < full[whole] or w.shape[dim] == full[dim]):
            hint = "sliced along the wrong dimension: " + hint
        return f"weight shape {list(w.shape)} (the full weight is [{OUT}, {IN}], [out, in])", hint
    if not close(w, want["weight"]):
        pieces = full_linear().weight.detach().chunk(t, dim)
        other = next((k for k, p in enumerate(pieces) if close(w, p)), None)
        hint = (f"rank {r} holds rank {other}'s slice: rank r's starts at r·n/t" if other is not None
                else "the weight is not this rank's slice of the full weight")
        return str(first_difference({"weight": w}, {"weight": want["weight"]})), hint
    if (storage := got.get("storage", 0)) > w.numel() * w.element_size():
        return (f"the weight slice lives in a storage of {storage:,} bytes, its {w.numel():,} elements take "
                f"{w.numel() * w.element_size():,}", "a view of the full weight (right values, no memory "
                "saved): clone the slice, so each rank's weight has a storage of its own, 1/t of the full")
    if close(got["bias"], want["bias"]):
        return None
    if kind == "row":
        return "the bias is not the full bias", "the row layer's output is whole after g, and so is its bias"
    return f"the bias is not rank {r}'s slice", "the bias belongs to the output features: cut it as A"


# --- the sub-layers ----------------------------------------------------------------------------

def local(module: nn.Module, t: int, r: int) -> nn.Module:
    """Rank r's slices as plain linears, no communication: what a rank computes between f and g."""
    for name, linear in list(module.named_children()):
        piece = linear.weight.detach().chunk(t, 0 if name in COLUMN_NAMES else 1)[r]
        setattr(module, name, nn.Linear(piece.shape[1], piece.shape[0], bias=False, dtype=torch.float64))
        getattr(module, name).weight.data.copy_(piece)
    return module


def joined(pieces_of: list[dict]) -> dict[str, torch.Tensor | None]:
    """One TP group's slices of each parameter ({name: tensor} per rank, in group order), joined
    along the dimension each layer splits; a replicated one is taken from the group's first rank."""
    out = {}
    for name in pieces_of[0]:
        pieces, layer = [got.get(name) for got in pieces_of], name.rsplit(".", 2)[-2]
        if any(p is None for p in pieces) or layer not in (*COLUMN_NAMES, "wo", "w2"):
            out[name] = pieces[0]
            continue
        try:
            out[name] = torch.cat(pieces, 0 if layer in COLUMN_NAMES else 1)
        except RuntimeError:  # slices of unequal shapes: reported as a wrong shape
            out[name] = torch.empty(0, dtype=torch.float64)
    return out


def counts_hint(forward: list[str], backward: list[str], columns: int) -> tuple[str, str] | None:
    """(what was posted, hint) unless a sub-layer posts one all-reduce each way."""
    seen = f"forward posted {forward or 'nothing'}, backward {backward or 'nothing'}"
    if forward == ["all_reduce"] and backward == ["all_reduce"]:
        return None
    if backward == ["all_reduce"] * columns:
        return seen, (f"f in each of the {columns} column layers: one all-reduce per layer in backward where "
                      "one per sub-layer does; apply f once to the sub-layer's input (input_is_mapped=True, "
                      "f in a forward pre-hook)")
    if forward.count("all_reduce") > 1:
        return seen, ("only the row layer's partial output is summed (g); the column layers' outputs stay "
                      "split, the activation is element-wise")
    return seen, "one all-reduce each way per sub-layer: g after the row layer, f (backward) on the input"


# --- optional: ring attention's merge ------------------------------------------------------------

UNWEIGHTED = ("each part weighed 1: out_i is normalized over its own keys only; weigh it by its share "
              "of the whole sum, e^(lse_i − lse)")
OVERFLOW = ("nan/inf: e^lse overflows float64 past lse ≈ 709; work with differences of log-sum-exps "
            "(torch.logaddexp, e^(lse_i − lse))")
EMPTY = ("nan where a query saw no key of one set (lse_i = −inf): −inf − (−inf); torch.logaddexp and "
         "e^(lse_i − lse) stay finite there")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None = None):
    """softmax(q kᵀ/√d) v over the keys `seen` [T, S] allows, and its log-sum-exp; a query that
    sees no key gets lse = −inf and a zero row (no nan, in forward or backward)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if seen is not None:
        scores = scores.masked_fill(~seen, float("-inf"))
    lse = scores.logsumexp(-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - safe[..., None]) @ v, lse


def reference_merge(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)
    return torch.exp(lse1 - lse)[..., None] * out1 + torch.exp(lse2 - lse)[..., None] * out2, lse
