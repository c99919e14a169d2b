"""Chapter 06's exercises: the checks that lesson.ipynb calls on the student's functions.

Each check prints ✓ or ✗ with the figure that decided and returns a bool; it never raises (a
stub's NotImplementedError prints "✗ not solved yet"). Both run in one process, against the
schedules as data and the unit-cost simulator.

    one_f_one_b_order(p, m, rank)   rank's 1F1B action list, e.g. ["F0", "F1", "B0", "F2", …]:
                                    min(p−rank−1, m) warm-up forwards, then one F one B, then the rest
    min_microbatches(p, target, v)  the smallest m with bubble (p−1)/(v·m+p−1) ≤ target
"""

from __future__ import annotations

import math
from collections.abc import Callable

from common.exercise import attempt
from pipeline.schedules import make_schedule, one_f_one_b
from pipeline.simulator import bubble_fraction, closed_form_bubble, simulate


def check_one_f_one_b_order(order: Callable) -> bool:
    """Every rank of every (p ≤ 6, m ≤ 10) against pipeline.schedules.one_f_one_b."""
    def body() -> tuple[bool, str]:
        cases = 0
        for p in range(1, 7):
            for m in range(1, 11):
                want = one_f_one_b(p, m).actions
                for rank in range(p):
                    expected = [f"{a.kind}{a.microbatch}" for a in want[rank]]
                    got = [str(a) for a in order(p, m, rank)]
                    if got != expected:
                        at = next((i for i, (x, y) in enumerate(zip(got, expected, strict=False)) if x != y),
                                  min(len(got), len(expected)))
                        return False, (f"p={p} m={m} rank {rank}: yours {' '.join(got)}\n"
                                       f"{' ' * 20}1F1B  {' '.join(expected)}  (first difference at "
                                       f"position {at})")
                    cases += 1
        return True, f"{cases} (p, m, rank) cases, p ≤ 6, m ≤ 10: every order equals pipeline.schedules"
    return attempt(body)


def check_min_microbatches(min_microbatches: Callable) -> bool:
    """For p = 4, 8, 16 (v = 1) and p = 4, 8 (v = 2), targets 10% and 5%: the bubble at your m
    (simulated for 1F1B, the closed form for interleaved) is ≤ target, and at m − 1 it is not."""
    def body() -> tuple[bool, str]:
        found = []
        for p, v in [(4, 1), (8, 1), (16, 1), (4, 2), (8, 2)]:
            for target in (0.10, 0.05):
                m = min_microbatches(p, target, v)
                name = "1f1b" if v == 1 else "interleaved"
                runnable = m if v == 1 else math.ceil(m / p) * p  # interleaved needs m % p == 0
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


EXERCISES: dict[str, Callable[[Callable], bool]] = {"one_f_one_b_order": check_one_f_one_b_order,
                                                     "min_microbatches": check_min_microbatches}


def _warmup_p_minus_rank(p: int, m: int, rank: int) -> list[str]:
    """Warms up with p − rank forwards (one too many: the last rank then runs F1 before B0)."""
    warmup = min(p - rank, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - warmup, m)]


def _article_rule(p: int, target: float, v: int = 1) -> int:
    """Solves the article's (p − 1)/m ≤ target: bubble against the useful work, not the step."""
    return math.ceil((p - 1) / (v * target) - 1e-9)


WRONG: dict[str, Callable] = {"one_f_one_b_order": _warmup_p_minus_rank, "min_microbatches": _article_rule}
