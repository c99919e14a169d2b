"""What every lab's test checks (tests/test_lab_0N*.py): the grader is fair and its diagnoses are right.

- the reference (lab_solution.py) passes every property, and every configuration of every
  property ran, and every check of every property (none skipped);
- the untouched skeleton (lab.py) fails fast, naming what is not implemented, and hangs nothing;
- each planted typical bug (a textual edit of the reference) fails the check that names it, with
  the hint that names it, and fails the lab;
- every check of the lab is the one that fails for at least one planted bug (a check whose body
  stopped checking goes red: its bug passes), and one planted bug is an error of 1e-8 (a
  tolerance loosened a million times goes red).
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import NamedTuple

from common.labs.grader import PACKAGES, Verdict, check_name, describe, grade, lab_module, lab_path


class Bug(NamedTuple):
    """An edit of the reference (the typical bug), the property (part of its name) that shows it,
    the status (fail, raised, died, hang, deadlock), the words its hint or detail must print, and
    the check that fails (a check's name; "replay" for a deadlock; None for the others)."""

    edits: list[tuple[str, str]]
    only: str | tuple[str, ...]
    status: str
    words: str
    check: str | None = None


def graded(chapter: int, path: Path | None = None, only=None, lab: str = "") -> tuple[list[Verdict], str]:
    lines: list[str] = []
    verdicts = grade(chapter, path, only=only, out=lines.append, lab=lab)
    return verdicts, "\n".join(lines)


def properties(chapter: int, lab: str = "") -> list:
    return importlib.import_module(lab_module(chapter, lab)).PROPERTIES


def assert_reference_passes(chapter: int, lab: str = "") -> None:
    verdicts, text = graded(chapter, lab_path(chapter, lab, solution=True), lab=lab)
    assert verdicts and all(v.passed for v in verdicts), text
    for prop, verdict in zip(properties(chapter, lab), verdicts, strict=True):
        assert verdict.configs == [dict(c) for c in prop.configs], f"{prop.name}: not every configuration ran"
        want = ["replay"] if prop.plan else [check_name(c) for c in prop.checks]
        assert verdict.checks == want, f"{prop.name}: ran the checks {verdict.checks}, not {want}"
        assert all(prop.descriptions()), f"{prop.name}: a check without a docstring (the README block)"


def assert_skeleton_fails_fast(chapter: int, lab: str = "", budget_s: float = 30.0) -> None:
    start = time.perf_counter()
    verdicts, text = graded(chapter, lab_path(chapter, lab), lab=lab)
    assert time.perf_counter() - start < budget_s, text
    assert verdicts[0].status == "todo" and "not implemented" in verdicts[0].detail, text
    assert all(v.status in ("todo", "skipped") for v in verdicts), text


def plant(chapter: int, tmp_path: Path, edits: list[tuple[str, str]], lab: str = "") -> Path:
    """The reference with a few edits: the bug a student typically makes."""
    source = lab_path(chapter, lab, solution=True).read_text()
    for old, new in edits:
        assert source.count(old) == 1, f"a planted edit must match the reference once: {old!r}"
        source = source.replace(old, new)
    path = tmp_path / f"lab_{PACKAGES[chapter]}{'_' + lab if lab else ''}_bug.py"
    path.write_text(source)
    return path


def assert_bug_diagnosed(chapter: int, tmp_path: Path, bug: Bug, lab: str = "") -> list[Verdict]:
    """The planted bug fails the first property it runs with `bug.status`, at `bug.check`, and
    `bug.words` are in what that verdict prints; the lab fails."""
    verdicts, text = graded(chapter, plant(chapter, tmp_path, bug.edits, lab), only=bug.only, lab=lab)
    failed = [v for v in verdicts if not v.passed]
    assert failed, f"the planted bug passed:\n{text}"
    assert failed[0].status == bug.status and bug.words in "\n".join(failed[0].lines()), text
    assert failed[0].check == bug.check, f"failed at check {failed[0].check}, not {bug.check}:\n{text}"
    assert failed[0].failed, f"a failing verdict that does not fail the lab:\n{text}"
    return verdicts


def assert_checks_covered(chapter: int, bugs: dict[str, Bug], lab: str = "") -> None:
    """Every check of every property is the failing check of some planted bug (its negative
    control), and some bug is a 1e-8 error (the pinned tolerance)."""
    checks = {check_name(c): describe(c) for p in properties(chapter, lab) for c in p.checks}
    uncovered = sorted(set(checks) - {bug.check for bug in bugs.values()})
    assert not uncovered, f"checks no planted bug fails: {uncovered}"
    assert any("1e-8" in name for name in bugs), "no planted error of 1e-8: the tolerance is not pinned"
