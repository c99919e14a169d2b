"""The shared diagnosis (common/labs/diagnosis.py) tells apart what a wrong number usually means:
a rounding-sized difference from a logic error, twice from half as much, a missed wait() among
wrong values, and a failure from step 2 on as state kept across steps."""

from __future__ import annotations

import torch

from common.labs.diagnosis import amount_hint, explain, measure, steps_pattern

WANT = torch.linspace(1.0, 2.0, 64, dtype=torch.float64)


def hint(got: torch.Tensor, world: int = 1, tolerance: float = 1e-10) -> str:
    finding = measure("w", got, WANT, tolerance)
    assert finding is not None, "the planted difference must be a finding"
    return explain(finding, world)


def test_a_float32_result_off_by_its_rounding_is_rounding_not_logic():
    got = WANT.float()  # float32 rounding: relative differences ~1e-8
    assert 1e-10 < float(((got.double() - WANT) / WANT).abs().max()) < 1e-7
    assert "rounding, not logic" in hint(got)


def test_a_float64_result_off_by_1e_15_is_rounding_not_logic():
    got = WANT * (1 + 2e-15)
    assert "rounding, not logic" in hint(got, tolerance=0.0)


def test_a_float64_result_off_by_1e_8_is_logic_not_rounding():
    assert "rounding, not logic" not in hint(WANT * (1 + 1e-8))


def test_twice_and_half_as_much_get_their_own_hints():
    twice, half = hint(WANT * 2), hint(WANT / 2, world=3)
    assert "twice as much" in twice and "counted twice" in twice
    assert "half as much" in half and "overwritten" in half
    assert "twice as much (bytes" in amount_hint(2048, 1024)
    assert "half as much (bytes" in amount_hint(512, 1024)
    assert amount_hint(1024, 1024) == "" and amount_hint(3072, 1024) == ""


def test_values_at_the_right_scale_but_wrong_suspect_a_missed_wait():
    assert "wait()" in hint(WANT.flip(0), world=2)


def test_a_failure_from_step_2_on_says_step_1_was_right_and_names_kept_state():
    text = steps_pattern([1, 2], 3)
    assert "step 1 was right" in text
    assert all(word in text for word in ("optimizer state", "accumulated", "not reset"))
    assert steps_pattern([0, 1], 3) == ""


def test_the_rounding_line_sits_at_64_ulps_of_the_dtype():
    """Both sides of the line: 32 ulps of float64 is rounding, 256 ulps is not."""
    eps = torch.finfo(torch.float64).eps
    assert "rounding, not logic" in hint(WANT * (1 + 32 * eps), tolerance=0.0)
    assert "rounding, not logic" not in hint(WANT * (1 + 256 * eps), tolerance=0.0)


def test_a_small_relative_error_is_a_constant_slightly_off_and_a_larger_one_a_missed_wait():
    """1e-8 of the value reads as a constant slightly off; 1e-4, at the right scale, is a wait()."""
    larger = hint(WANT * (1 + 1e-4), world=2)
    assert "wait()" in larger and "constant slightly off" not in larger
    assert "constant slightly off" in hint(WANT * (1 + 1e-8))
