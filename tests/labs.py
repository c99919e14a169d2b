"""What every lab's test checks (tests/test_lab_0N.py): the grader is fair and its diagnoses are right.

- the reference (lab_solution.py) passes every property;
- the untouched skeleton (lab.py) fails fast, naming what is not implemented, and hangs nothing;
- each planted typical bug (a textual edit of the reference) fails with the hint that names it.
"""

from __future__ import annotations

import time
from pathlib import Path

from common.grader import PACKAGES, Verdict, grade

REPO = Path(__file__).resolve().parent.parent


def lab_dir(chapter: int) -> Path:
    return next(REPO.glob(f"0{chapter}_*"))


def graded(chapter: int, path: Path | None = None, only: str | None = None) -> tuple[list[Verdict], str]:
    lines: list[str] = []
    verdicts = grade(chapter, path, only=only, out=lines.append)
    return verdicts, "\n".join(lines)


def assert_reference_passes(chapter: int) -> None:
    verdicts, text = graded(chapter, lab_dir(chapter) / "lab_solution.py")
    assert verdicts and all(v.passed for v in verdicts), text


def assert_skeleton_fails_fast(chapter: int, budget_s: float = 30.0) -> None:
    start = time.perf_counter()
    verdicts, text = graded(chapter, lab_dir(chapter) / "lab.py")
    assert time.perf_counter() - start < budget_s, text
    assert verdicts[0].status == "todo" and "not implemented" in verdicts[0].detail, text
    assert all(v.status in ("todo", "skipped") for v in verdicts), text


Edit = tuple[str, str]  # (text of lab_solution.py, its replacement)


def plant(chapter: int, tmp_path: Path, edits: list[Edit]) -> Path:
    """The reference with a few edits: the bug a student typically makes."""
    source = (lab_dir(chapter) / "lab_solution.py").read_text()
    for old, new in edits:
        assert source.count(old) == 1, f"a planted edit must match the reference once: {old!r}"
        source = source.replace(old, new)
    path = tmp_path / f"lab_{PACKAGES[chapter]}_bug.py"
    path.write_text(source)
    return path


def assert_bug_diagnosed(chapter: int, tmp_path: Path, edits: list[Edit], only: str, status: str,
                         hint: str) -> None:
    """The planted bug fails property `only` with `status`, and `hint` is in what it prints."""
    verdicts, text = graded(chapter, plant(chapter, tmp_path, edits), only=only)
    failed = [v for v in verdicts if not v.passed]
    assert failed, f"the planted bug passed:\n{text}"
    assert failed[0].status == status and hint in "\n".join(failed[0].lines()), text
