"""Every notebook's exercises can be failed and can be solved.

Each chapter has `exercises.py` (the checks the notebook calls on the student's function:
`EXERCISES = {name: check}`, each check prints ✓/✗ with the figure that decided and returns a
bool, never raises) and `solutions.py` (one function per name; the notebook never imports it).
`WRONG = {name: fn}` in exercises.py holds a plausible wrong answer per exercise (the mistake a
student is likely to make), which its check must reject.
"""

from __future__ import annotations

import re
from importlib import import_module

import nbformat
import pytest

from common.chapters import CHAPTERS
from common.notebooks import REPO_ROOT

PACKAGES = {c.folder: c.package for c in CHAPTERS}


def _exercises() -> list[tuple[str, str]]:
    return [(package, name) for package in PACKAGES.values()
            for name in import_module(f"{package}.exercises").EXERCISES]


CASES = _exercises()
IDS = [f"{package}.{name}" for package, name in CASES]


def _check(package: str, name: str):
    return import_module(f"{package}.exercises").EXERCISES[name]


def test_every_chapter_has_an_exercise():
    counts = {package: len(import_module(f"{package}.exercises").EXERCISES) for package in PACKAGES.values()}
    assert all(counts.values()), counts


@pytest.mark.parametrize(("package", "name"), CASES, ids=IDS)
def test_the_solution_passes(package, name):
    assert _check(package, name)(getattr(import_module(f"{package}.solutions"), name)) is True


@pytest.mark.parametrize(("package", "name"), CASES, ids=IDS)
def test_the_stub_fails_without_raising(package, name):
    def stub(*args, **kwargs):
        raise NotImplementedError("your code here")

    assert _check(package, name)(stub) is False


@pytest.mark.parametrize(("package", "name"), CASES, ids=IDS)
def test_a_plausible_wrong_answer_fails(package, name):
    assert _check(package, name)(import_module(f"{package}.exercises").WRONG[name]) is False


@pytest.mark.parametrize("wrong", [lambda n: float(n), lambda n: 1.0, lambda n: 2.0 * (n - 1),
                                   lambda n: (n - 1) / n, lambda n: n - 0.5])
def test_data_parallel_a_wrong_prediction_is_told_how_it_misses_not_the_figure(wrong, capsys):
    """Chapter 01: the ✗ says too large, too small or the wrong quantity; no number in it (the
    n it names aside) is a figure the simulation measured."""
    exercises = import_module("data_parallel.exercises")
    measured = [exercises.measured_error_without_1_over_n(n) for n in (2, 3, 4, 8)]
    assert exercises.EXERCISES["grad_error_without_1_over_n"](wrong) is False
    shown = capsys.readouterr().out.split("grad_error_without_1_over_n: ", 1)[1]
    numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", re.sub(r"n=\d+", "", shown))]
    assert not [x for x in numbers if any(abs(x - m) < 1e-3 * m for m in measured)], shown


@pytest.mark.parametrize("directory", PACKAGES)
def test_the_notebook_calls_every_check_and_never_imports_the_solutions(directory):
    package = PACKAGES[directory]
    cells = nbformat.read(REPO_ROOT / directory / "lesson.ipynb", as_version=4).cells
    source = "\n".join(c.source for c in cells if c.cell_type == "code")
    assert "solutions" not in source
    missing = [name for name in import_module(f"{package}.exercises").EXERCISES if name not in source]
    assert not missing, f"{directory}/lesson.ipynb never calls the check of {missing}"


def test_ring_allreduce_a_wrong_answer_is_told_where_not_the_answer(capsys):
    """Chapter 02: the ✗ of a wrong survivor names the failing chunk, not whose data survives."""
    exercises = import_module("ring_allreduce.exercises")
    solutions = import_module("ring_allreduce.solutions")
    assert exercises.EXERCISES["broken_ring_survivor"](exercises.WRONG["broken_ring_survivor"]) is False
    shown = capsys.readouterr().out
    assert "n=2: chunk 0" in shown and f"rank {solutions.broken_ring_survivor(0, 2)}'s" not in shown, shown


def test_zero_owned_elements_names_the_case_not_the_answer(capsys):
    """Chapter 03: a wrong count is reported with its case and what is inconsistent about it (the
    counts' sum against Ψ), never with the right count."""
    from zero.exercises import CASES, EXERCISES, WRONG, engine_owned_elements

    wrong = WRONG["owned_elements"]
    buckets, n, r = next((b, n, r) for b in CASES for n in (1, 2, 3, 4, 7) for r in range(n)
                         if wrong(b, n, r) != engine_owned_elements(b, n, r))
    assert EXERCISES["owned_elements"](wrong) is False
    verdict = capsys.readouterr().out.split(f"rank {r}: ", 1)[1]
    assert verdict.startswith(f"yours {wrong(buckets, n, r):,}")
    assert not re.search(rf"\b{engine_owned_elements(buckets, n, r):,}\b", verdict), verdict
