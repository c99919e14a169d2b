"""Every lesson notebook runs top to bottom on CPU in under 2 minutes."""

from __future__ import annotations

import pytest

from common.notebooks import REPO_ROOT, execute, lesson_notebooks

NOTEBOOKS = lesson_notebooks()


def test_every_chapter_with_a_train_py_has_a_lesson_notebook():
    chapters = sorted(p.parent for p in REPO_ROOT.glob("0*_*/train.py"))
    assert chapters == sorted(p.parent for p in NOTEBOOKS)


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.parent.name for p in NOTEBOOKS])
def test_lesson_notebook_runs_on_cpu_in_under_two_minutes(notebook):
    assert execute(notebook, timeout_s=120) < 120
