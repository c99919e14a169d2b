"""Chapter 06's exercises: the checks that lesson.ipynb calls on the student's functions.

Each check prints ✓ or ✗ with the figure that decided and returns a bool; it never raises (a
stub's NotImplementedError prints "✗ not solved yet"). It runs in one process, against the
unit-cost simulator. (Writing 1F1B itself is the chapter's lab: lab.py, `make lab-check N=6`.)

    min_microbatches(p, target, v)  the smallest m whose 1F1B / interleaved bubble is ≤ target
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import count

from common.exercise import attempt
from pipeline.schedules import make_schedule, schedule_error
from pipeline.simulator import bubble_fraction, closed_form_bubble, simulate


def check_min_microbatches(min_microbatches: Callable) -> bool:
    """For p = 4, 8, 16 (v = 1) and p = 4, 8 (v = 2), targets 10% and 5%: the bubble at your m
    (simulated for 1F1B, the closed form for interleaved) is ≤ target, and at m − 1 it is not."""
    def body() -> tuple[bool, str]:
        found = []
        for p, v in [(4, 1), (8, 1), (16, 1), (4, 2), (8, 2)]:
            for target in (0.10, 0.05):
                m = min_microbatches(p, target, v)
                name = "1f1b" if v == 1 else "interleaved"
                runnable = next(k for k in count(m) if schedule_error(name, p, k, v) is None)
                at_m = float(closed_form_bubble(name, p, m, v))
                if v == 1:
                    at_m = float(bubble_fraction(simulate(make_schedule(name, p, runnable, v)), p))
                before = float(closed_form_bubble(name, p, m - 1, v)) if m > 1 else 1.0
                if not (at_m <= target + 1e-12 and before > target):
                    return False, (f"p={p} v={v} target {target}: m = {m} gives bubble {at_m:.4f}, "
                                   f"m − 1 gives {before:.4f}")
                found.append(f"p={p},v={v}: {m}")
        return True, "smallest m for 10%: " + ", ".join(found[::2])
    return attempt(body)


EXERCISES: dict[str, Callable[[Callable], bool]] = {"min_microbatches": check_min_microbatches}


def _article_rule(p: int, target: float, v: int = 1) -> int:
    """Solves the article's (p − 1)/m ≤ target: bubble against the useful work, not the step."""
    return math.ceil((p - 1) / (v * target) - 1e-9)


WRONG: dict[str, Callable] = {"min_microbatches": _article_rule}
