"""What a wrong result usually means: the labs' grader reads a symptom off the numbers.

A strategy bug moves whole tensors, and the way it moves them names the bug:

    got ≈ n · want            a missing 1/n: the gradients were summed, never averaged
    got ≈ want / n            divided twice
    got ≈ 2 · want, want / 2  counted twice; one of two contributions lost (overwritten, not summed)
    rel ≈ the dtype's eps     rounding, not logic (another order of a sum, a lower precision)
    got = 0, want ≠ 0         the tensor's hook never fired, or its bucket was never reduced
    right at step 1 only      state left over from the previous step (ready flags, buffers)
    right unless n ∤ length   uneven chunks: the last rank's piece is shorter (worlds_pattern,
                              uneven_pattern)
    got = a suspect           what a typical bug computes (this rank's own partial, the sum over
                              the world instead of the group, …), recomputed by the check: `suspect`

`first_difference` finds the first tensor (in the reference's order) beyond the tolerance, or
missing, or extra, and measures it; `explain` turns that into a sentence; `explain_error` does
the same for an exception a rank raised. The metric is common.reference's: per tensor,
max |a − b| / max(max |b|, SCALE_FLOOR · the largest |b| of any tensor). TOLERANCE is the
course's float64 contract (1e-10): every lab compares at it, and tests/test_lab_0N.py plants an
error of 1e-8 in each lab that must fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.reference import relative_diff

TOLERANCE = 1e-10
ROUNDING = 64  # a relative difference within 64 ulps of the result's dtype is rounding, not logic
TWICE = ("twice as much ({what}, 2× the expected): counted twice — reduced or sent twice, accumulated on "
         "top of the last step's (not zeroed), or a whole copy kept beside the shard")
HALF = ("half as much ({what}, ½ the expected): one of two contributions lost — a gradient overwritten "
        "instead of accumulated (p.grad = g, not +=), one of two micro-batches or directions dropped, or "
        "divided by 2 once too often")


@dataclass(frozen=True)
class Finding:
    """The first tensor that differs: its name, the max relative difference, and `scale`, the
    least-squares factor s of got ≈ s · want (None when want is all zeros)."""

    name: str
    rel: float
    scale: float | None
    zero: bool  # got is all zeros while want is not
    missing: bool = False  # got has no such tensor (or None)
    extra: bool = False  # got has a tensor the reference has not
    eps: float | None = None  # the machine epsilon of got's dtype (floating point only)

    def __str__(self) -> str:
        if self.missing:
            return f"{self.name}: missing"
        if self.extra:
            return f"{self.name}: not in the reference (an extra tensor)"
        if self.zero:
            return f"{self.name}: all zeros"
        scaled = self.scale is not None and abs(self.scale - 1) > 1e-3
        scale = f" ({self.scale:.3g}× the reference)" if scaled else ""
        return f"{self.name}: max rel diff {self.rel:.2g}{scale}"


def measure(name: str, got: torch.Tensor, want: torch.Tensor, tolerance: float = TOLERANCE) -> Finding | None:
    """`got` against `want` as one tensor: None when within `tolerance`."""
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    if g.shape != w.shape:
        return Finding(f"{name} (shape {list(g.shape)}, expected {list(w.shape)})", math.inf, None, False)
    if g.numel() == 0:
        return None
    rel = relative_diff({name: g}, {name: w}, "max") if w.abs().max() > 0 else float(g.abs().max())
    if rel <= tolerance:  # nan is a difference too
        return None
    norm = float((w * w).sum())
    scale = float((g * w).sum()) / norm if norm > 0 else None
    eps = torch.finfo(got.dtype).eps if got.dtype.is_floating_point else None
    return Finding(name, rel, scale, bool(g.abs().max() == 0 and w.abs().max() > 0), eps=eps)


def first_difference(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor],
                     tolerance: float = TOLERANCE) -> Finding | None:
    """The first tensor of `want` (in its order) that `got` misses, or differs from by more than
    `tolerance`; then the first tensor of `got` that `want` has not. None when they agree."""
    for name, w in want.items():
        g = got.get(name)
        if g is None:
            return Finding(name, math.inf, None, False, missing=True)
        if (finding := measure(name, g, w, tolerance)) is not None:
            return finding
    for name in got:
        if name not in want:
            return Finding(name, math.inf, None, False, extra=True)
    return None


def close(got: torch.Tensor | None, want: torch.Tensor | None, tolerance: float = TOLERANCE) -> bool:
    """Within `tolerance` of `want` (max |got − want| / max |want|); nan never is; None only to None."""
    if got is None or want is None:
        return got is None and want is None
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return True
    return bool((got - want).abs().max() <= tolerance * max(float(want.abs().max()), 1e-30))


def suspect(got: torch.Tensor | None, suspects: list[tuple[torch.Tensor, str]]) -> str | None:
    """The hint of the first suspect (what a typical bug computes) that `got` equals, or None."""
    return next((hint for tensor, hint in suspects if close(got, tensor)), None)


def near(x: float | None, target: float, rtol: float = 0.02) -> bool:
    return x is not None and abs(x - target) <= rtol * abs(target)


def explain(finding: Finding, world: int, what: str = "gradients") -> str:
    """The usual cause of `finding` at world size `world`, in one sentence."""
    if finding.missing:
        return f"no {what[:-1]} for this tensor: was it registered, and did its bucket or shard come back?"
    if finding.extra:
        return f"a {what[:-1]} the one-device model has not: keep the module's parameters and their names"
    if "(shape" in finding.name:
        return ("wrong shape: which slice does this rank keep (dist.get_rank(group), "
                "dist.get_world_size(group))?")
    if not math.isfinite(finding.rel):
        return f"nan or inf in the {what}: an overflow, or a buffer read before it was written"
    if finding.zero:
        return (f"zero {what}: nothing reached this tensor: its hook never fired, or fired before the "
                "gradient was there (Tensor.register_hook runs before p.grad is accumulated: use "
                "register_post_accumulate_grad_hook), or its bucket was never reduced (does every "
                "parameter get a hook, and does the last, partial bucket launch too?)")
    if world > 1 and near(finding.scale, world):
        return (f"{what} {world}× too large at world {world}: a missing 1/n. Sum with ReduceOp.SUM, "
                "then divide by the world size (never ReduceOp.AVG: gloo on older torch ignores it)")
    if world > 1 and near(finding.scale, 1 / world):
        return f"{what} {world}× too small at world {world}: divided twice, or divided before an average"
    if near(finding.scale, 2.0):
        return TWICE.format(what=what)
    if near(finding.scale, 0.5):
        return HALF.format(what=what)
    if finding.eps is not None and finding.rel <= ROUNDING * finding.eps:
        return (f"{what} off by {finding.rel:.1g} (relative), a few ulps of the result's dtype (eps "
                f"{finding.eps:.1g}): rounding, not logic — the same math summed in another order; the "
                "reference computes in float64: so must you (no float32 or bfloat16 on the way)")
    if finding.rel < 1e-6:
        return (f"{what} off by {finding.rel:.1g} (relative): a constant slightly off (an epsilon, a "
                "scale), or a sum in another order in lower precision; the labs compare at 1e-10")
    return (f"right scale, wrong values: pieces from the wrong rank or offset, a buffer reused "
            f"before its copy landed, or {what} read before the reduction finished (a missed wait(): "
            "async_op=True, isend, irecv and batch_isend_irecv return at once; wait() on each handle "
            "before reading or reusing its buffer)")


def amount_hint(got: float, want: float, what: str = "bytes") -> str:
    """A hint for a count (bytes sent, elements kept) that is twice or half the expected, or ''."""
    if want and near(got / want, 2.0):
        return TWICE.format(what=what)
    if want and near(got / want, 0.5):
        return HALF.format(what=what)
    return ""


def steps_pattern(failing_steps: list[int], steps: int) -> str:
    """A hint from which steps failed (0-based): only after the first → leftover state."""
    if failing_steps and 0 not in failing_steps and steps > 1:
        return ("right at step 1, wrong after: step 1 was right, so the step's math is; suspect state "
                "kept across steps: the optimizer state (rebuilt, reset or never built), gradients "
                "accumulated onto the last step's or overwritten, a buffer, ready flag or counter not "
                "reset, a pending handle — reset what belongs to a step when it ends, keep the rest")
    return ""


def worlds_pattern(failing: list[int], passing: list[int], length: int) -> str:
    """A hint from which world sizes failed: only those that do not divide `length`."""
    if failing and all(length % w for w in failing) and passing and all(length % w == 0 for w in passing):
        return (f"right when the world size divides the length ({passing}), wrong otherwise "
                f"({failing}): uneven chunks — the last chunks are shorter; compute each chunk's "
                "start and size, do not assume length / n")
    return ""


def uneven_pattern(failing: list[tuple[int, int]], passing: list[tuple[int, int]], prefer: int) -> str:
    """worlds_pattern over (world, length) cases: when every failing case is one the world size does
    not divide, and the even ones pass; told for the length `prefer` (the reported one) if it shows."""
    if not failing or any(length % world == 0 for world, length in failing):
        return ""
    for length in sorted({length for _, length in failing}, key=lambda length: (length != prefer, length)):
        hint = worlds_pattern(sorted(w for w, other in failing if other == length),
                              sorted(w for w, other in passing if other == length), length)
        if hint:
            return hint
    return ""


# An exception a rank raised (common/labs/rank.py records it): the usual cause by its words.
ERRORS = [
    (("size mismatch", "shapes cannot be multiplied", "must match the size", "doesn't match the broadcast",
      "shape '", "invalid for input of size", "expected input with shape"),
     "a tensor of the wrong shape reached this op: which slice does this rank keep, and of which "
     "dimension (dist.get_rank(group), dist.get_world_size(group) of the group you were given)?"),
    (("modified by an inplace operation",),
     "an in-place op on a tensor autograd saved for backward: work on a copy (.clone()) or out of place"),
    (("does not require grad and does not have a grad_fn",),
     "the result lost its graph (.detach(), .data, torch.no_grad() around the computation): keep it in "
     "differentiable torch ops"),
    (("backward through the graph a second time",),
     "backward ran twice through one graph: a tensor from the previous step, or a hook calling backward"),
    (("'NoneType' object has no attribute",),
     "a None where a tensor or a handle was expected: p.grad read before the gradient was accumulated "
     "(a hook on the wrong event: Tensor.register_hook fires before accumulation, "
     "register_post_accumulate_grad_hook after), the handle of a collective this rank never posted, "
     "or an attribute __init__ never set"),
    (("is not part of group",),
     "a peer outside the group you were given: take ranks and neighbours from that group "
     "(dist.get_rank(group), dist.get_global_rank(group, r)) and pass group= on to every call"),
    (("Connection closed by peer", "Connection reset by peer", "doesn't match expected size"),
     "gloo aborted this rank's collective: a peer stopped first, or the ranks disagree on a message's size"),
]


def explain_error(message: str) -> str:
    """The usual cause of an exception whose last line is `message`, or ''."""
    return next((hint for words, hint in ERRORS if any(w in message for w in words)), "")
