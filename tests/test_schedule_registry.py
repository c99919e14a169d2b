"""Chapter 06's schedule registry: one `SCHEDULES` entry per schedule, read by every place that
knows a schedule (the builder, the validation, the simulator's closed form, the figures, chapter
07's recipe and memory model). Pure Python, no ranks."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from pipeline.figures import lesson as figures
from pipeline.schedules import (
    SCHEDULES,
    ScheduleSpec,
    make_schedule,
    peak_in_flight,
    rank_stages,
    schedule_error,
)
from pipeline.simulator import bubble_formula, closed_form_bubble, simulate
from pipeline.simulator import bubble_fraction as simulated_bubble


def admissible(name: str, p_max: int = 6, m_max: int = 16):
    """Every (p, m, v) the entry accepts up to p_max, m_max (v up to 3 where it is free)."""
    spec = SCHEDULES[name]
    for p in range(1, p_max + 1):
        for v in (range(1, 4) if spec.free_v else (spec.default_v,)):
            for m in range(1, m_max + 1):
                if schedule_error(name, p, m, v) is None:
                    yield p, m, v


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_entry_agrees_with_the_schedule_it_builds(name):
    """Its in-flight count is the built lists' peak on every rank (in whole stages), its
    split_backward is theirs, its closed-form bubble is the simulated one."""
    spec = SCHEDULES[name]
    shapes = list(admissible(name))
    assert shapes, f"{name} admits no (p, m, v) up to p = 6, m = 16"
    for p, m, v in shapes:
        schedule = make_schedule(name, p, m, v)
        assert schedule.split_backward == spec.split_backward, (p, m, v)
        assert all(schedule.stages(r) == rank_stages(name, p, v, r) for r in range(p)), (p, m, v)
        for r in range(p):
            held = Fraction(peak_in_flight(schedule, r), schedule.v)
            assert held == spec.in_flight(p, m, v, r), (p, m, v, r)
        if m <= 8:  # the simulator is the slow part
            assert simulated_bubble(simulate(schedule), p) == spec.bubble(p, m, v), (p, m, v)


def fake_error(p: int, m: int, v: int) -> str | None:
    return None if m % 2 == 0 else f"--microbatches {m} with --schedule fake: use an even number"


FAKE = ScheduleSpec(build=lambda p, m, v: replace(make_schedule("gpipe", p, m), name="fake"),
                    label="a fake GPipe", bubble=lambda p, m, v: Fraction(p - 1, m + p - 1),
                    formula="(p-1)/(m+p-1), the fake's", in_flight=lambda p, m, v, r: Fraction(m),
                    error=fake_error, color="#000000")


def test_a_new_entry_is_picked_up_everywhere_without_other_edits(monkeypatch):
    """Register a fake schedule (GPipe under another name, with a precondition of its own): the
    builder, the validation, the simulator's closed form and text, the figures' labels, chapter
    07's recipe and memory model see it; removed, none of them does."""
    from parallel3d.memory_model import in_flight_microbatches
    from parallel3d.parallelize import Parallel3DConfig

    monkeypatch.setitem(SCHEDULES, "fake", FAKE)
    assert make_schedule("fake", 3, 4).render() == make_schedule("gpipe", 3, 4).render()
    assert schedule_error("fake", 3, 5) == "--microbatches 5 with --schedule fake: use an even number"
    assert "fake" in schedule_error("nope", 2, 2)
    assert "virtual stages" in schedule_error("fake", 2, 2, 2)
    assert closed_form_bubble("fake", 4, 8) == Fraction(3, 11)
    assert bubble_formula("fake") == "(p-1)/(m+p-1), the fake's"
    assert ("fake", 1, "a fake GPipe") in figures.lesson_schedules(2)
    drawn = figures.schedules_data(p=2, m=4, v=2)["timelines"]
    assert [t["title"] for t in drawn if t["name"] == "fake"] == ["a fake GPipe"]
    assert in_flight_microbatches(4, 8, 1, "fake", stage=3) == 8
    assert Parallel3DConfig(schedule="fake").v == 1
    monkeypatch.undo()
    assert "fake" not in SCHEDULES and "fake" in schedule_error("fake", 2, 2)
    assert all(name != "fake" for name, _, _ in figures.lesson_schedules(2))
    with pytest.raises(ValueError, match="fake"):
        in_flight_microbatches(4, 8, 1, "fake", stage=3)
    with pytest.raises(ValueError, match="fake"):
        Parallel3DConfig(schedule="fake")


def test_a_wrong_entry_is_caught_by_the_agreement_check(monkeypatch):
    """Negative control: 1F1B's entry claiming GPipe's in-flight count (m on every rank) is
    refused by the check above."""
    wrong = replace(SCHEDULES["1f1b"], in_flight=lambda p, m, v, r: Fraction(m))
    monkeypatch.setitem(SCHEDULES, "1f1b", wrong)
    with pytest.raises(AssertionError):
        test_each_entry_agrees_with_the_schedule_it_builds("1f1b")
