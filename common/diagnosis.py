"""What a wrong gradient usually means: the labs' grader reads a symptom off the numbers.

A strategy bug moves whole tensors, and the way it moves them names the bug:

    got ≈ n · want            a missing 1/n: the gradients were summed, never averaged
    got ≈ want / n            divided twice
    got = 0, want ≠ 0         the tensor's hook never fired, or its bucket was never reduced
    right at step 1 only      state left over from the previous step (ready flags, buffers)
    right unless n ∤ length   uneven chunks: the last rank's piece is shorter (worlds_pattern,
                              uneven_pattern)
    got = one rank's own      never reduced at all (each rank kept its local gradient)

`first_difference` finds the first tensor (in the reference's order) beyond the tolerance and
measures it; `explain` turns that into a sentence; the labs' checks add the patterns that need
several runs (steps, world sizes). The metric is common.reference's: per tensor,
max |a − b| / max(max |b|, SCALE_FLOOR · the largest |b| of any tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.reference import relative_diff


@dataclass(frozen=True)
class Finding:
    """The first tensor that differs: its name, the max relative difference, and `scale`, the
    least-squares factor s of got ≈ s · want (None when want is all zeros)."""

    name: str
    rel: float
    scale: float | None
    zero: bool  # got is all zeros while want is not
    missing: bool = False  # got has no such tensor

    def __str__(self) -> str:
        if self.missing:
            return f"{self.name}: missing"
        if self.zero:
            return f"{self.name}: all zeros"
        scaled = self.scale is not None and abs(self.scale - 1) > 1e-3
        scale = f" ({self.scale:.3g}× the reference)" if scaled else ""
        return f"{self.name}: max rel diff {self.rel:.2g}{scale}"


def first_difference(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor],
                     tolerance: float = 1e-10) -> Finding | None:
    """The first tensor of `want` (in its order) that `got` misses by more than `tolerance`."""
    for name, w in want.items():
        g = got.get(name)
        if g is None:
            return Finding(name, float("inf"), None, False, missing=True)
        g, w = g.detach().double().cpu(), w.detach().double().cpu()
        if g.shape != w.shape:
            shapes = f"shape {list(g.shape)}, expected {list(w.shape)}"
            return Finding(f"{name} ({shapes})", float("inf"), None, False)
        rel = relative_diff({name: g}, {name: w}, "max") if w.abs().max() > 0 else float(g.abs().max())
        if not rel <= tolerance:  # nan is a difference too
            norm = float((w * w).sum())
            scale = float((g * w).sum()) / norm if norm > 0 else None
            return Finding(name, rel, scale, bool(g.abs().max() == 0 and w.abs().max() > 0))
    return None


def near(x: float | None, target: float, rtol: float = 0.02) -> bool:
    return x is not None and abs(x - target) <= rtol * abs(target)


def explain(finding: Finding, world: int, what: str = "gradients") -> str:
    """The usual cause of `finding` at world size `world`, in one sentence."""
    if finding.missing:
        return f"no {what[:-1]} for this tensor: was it registered, and did its bucket or shard come back?"
    if finding.zero:
        return (f"zero {what}: this tensor's hook never fired, or its bucket was never reduced "
                "(does every parameter get a hook, and does the last, partial bucket launch too?)")
    if world > 1 and near(finding.scale, world):
        return (f"{what} {world}× too large at world {world}: a missing 1/n. Sum with ReduceOp.SUM, "
                "then divide by the world size (never ReduceOp.AVG: gloo on older torch ignores it)")
    if world > 1 and near(finding.scale, 1 / world):
        return f"{what} {world}× too small at world {world}: divided twice, or divided before an average"
    if world > 1 and near(finding.scale, 2.0):
        return f"{what} 2× too large: counted twice (reduced twice, or accumulated on top of the last step)"
    return (f"right scale, wrong values: pieces from the wrong rank or offset, a buffer reused "
            f"before its copy landed, or {what} read before the reduction finished")


def steps_pattern(failing_steps: list[int], steps: int) -> str:
    """A hint from which steps failed (0-based): only after the first → leftover state."""
    if failing_steps and 0 not in failing_steps and steps > 1:
        return ("right at step 1, wrong after: state left over from the previous step (ready "
                "flags, counters, buffers not zeroed, a pending handle) — reset it when a step ends")
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
