"""The ideal timeline of a schedule: its action lists run against their data dependencies with
unit costs and free communication.

    F(mb, s) starts after F(mb, s-1) ended           (the activation arrives)
    B(mb, s) starts after B(mb, s+1) ended           (the output gradient arrives)
    W(mb, s) starts after B(mb, s) ended             (same rank, earlier in its list)
    and each rank runs its list in order, one action at a time.

Costs: F = 1, B = 2 for schedules with a whole backward; F = B = W = 1 for zero-bubble; a chunk
of an interleaved schedule costs 1/v of a stage. The bubble fraction of a timeline is
1 - Σ busy / (p · makespan); `closed_form_bubble` gives the closed form of each SCHEDULES entry, which the
tests check against these simulations. If some rank can never start its next action the lists
deadlock, and `simulate` says where.
"""

from __future__ import annotations

from fractions import Fraction

from .schedules import SCHEDULES, Action, Schedule
from .timeline import Interval

UNIT_COSTS = {"F": Fraction(1), "B": Fraction(2), "W": Fraction(0)}
ZERO_BUBBLE_COSTS = {"F": Fraction(1), "B": Fraction(1), "W": Fraction(1)}


class DeadlockError(RuntimeError):
    pass


def unit_costs(schedule: Schedule) -> dict[str, Fraction]:
    """F = 1, B = 2 (or F = B = W = 1 when B is split), per stage: a chunk costs 1/v of that."""
    costs = ZERO_BUBBLE_COSTS if schedule.split_backward else UNIT_COSTS
    return {k: c / schedule.v for k, c in costs.items()}


def simulate(schedule: Schedule, costs: dict[str, Fraction | float] | None = None) -> list[Interval]:
    """Every action's [start, end) under `costs` (default: `unit_costs`). Exact (Fractions)."""
    costs = costs or unit_costs(schedule)
    p = schedule.p
    finished: dict[tuple[str, int, int], Fraction] = {}  # (kind, microbatch, stage) → end
    clock, position = [Fraction(0)] * p, [0] * p
    intervals: list[Interval] = []

    def dependency(rank: int, action: Action) -> tuple[str, int, int] | None:
        s = schedule.stage(rank, action.chunk)
        if action.kind == "F":
            return ("F", action.microbatch, s - 1) if s > 0 else None
        if action.kind == "B":
            if s < schedule.n_stages - 1:
                return ("B", action.microbatch, s + 1)
            return ("F", action.microbatch, s)
        return ("B", action.microbatch, s)

    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for rank in range(p):
            while position[rank] < len(schedule.actions[rank]):
                action = schedule.actions[rank][position[rank]]
                dep = dependency(rank, action)
                if dep is not None and dep not in finished:
                    break
                start = max(clock[rank], finished[dep] if dep is not None else Fraction(0))
                end = start + costs[action.kind]
                finished[(action.kind, action.microbatch, schedule.stage(rank, action.chunk))] = end
                intervals.append(Interval(rank, action, start, end))
                clock[rank], position[rank] = end, position[rank] + 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(schedule.actions[r][position[r]]) for r in range(p)
                     if position[r] < len(schedule.actions[r])}
            raise DeadlockError(f"{schedule.name} p={p} m={schedule.m} v={schedule.v} deadlocks: "
                                f"ranks wait at {stuck}")
    return intervals


def bubble_fraction(intervals: list[Interval], p: int | None = None) -> float:
    """1 - Σ busy / (p · makespan): the share of rank-time spent waiting."""
    p = p or 1 + max(i.rank for i in intervals)
    start, end = min(i.start for i in intervals), max(i.end for i in intervals)
    busy = sum(i.end - i.start for i in intervals)
    return 1 - busy / (p * (end - start))


def closed_form_bubble(name: str, p: int, m: int, v: int = 1) -> Fraction:
    """The bubble fraction of the schedule's closed form (its SCHEDULES entry), exact."""
    if name not in SCHEDULES:
        raise ValueError(f"no closed form for {name!r}")
    return SCHEDULES[name].bubble(p, m, v)


def bubble_formula(name: str, v: int = 1) -> str:
    return SCHEDULES[name].formula_text(v)
