"""Imports only go down, and no two folders import each other.

The floors, from the ground up (CONTRIBUTING.md, "Floors"):

    0  common/kernel/        the torch-only kernel a copied piece takes along
    1  common/               the loop, its instruments, the labs' machinery, the drawing kernel
    2  01–06 core files      each chapter's mechanism
    3  07_3d core files      the composition of 04, 05 and 06
    4  demos, benches, labs, exercises, yardsticks, figures   (train*.py, bench*.py, lab*.py, …,
                             every file under a chapter's figures/)
    5  tests/

A file imports only files of its own floor or below (inside a function too: a lazy import is
still a dependency), and the folders' graph has no pair that imports each other: `common/` finds
what it needs of a chapter by name (common.chapters), never by an import.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from common.chapters import ROOT
from common.copy_sets import NOT_CORE, imports, module_path

FLOOR_NAMES = ("the kernel", "common", "a chapter's core", "07's core", "demos, labs and figures", "tests")


def project_files() -> list[str]:
    folders = [*sorted(ROOT.glob("0[1-9]_*")), ROOT / "common"]
    return sorted(str(p.relative_to(ROOT)) for folder in folders for p in folder.rglob("*.py"))


def floor(path: str) -> int:
    parts = Path(path).parts
    if parts[0] == "common":
        return 0 if parts[1] == "kernel" else 1
    if "figures" in parts or (NOT_CORE.search(path) and not path.endswith("__init__.py")):
        return 4
    return 3 if parts[0] == "07_3d" else 2


def folder(path: str) -> str:
    """A room of the house: a chapter folder, `common/`, or one of common's folders (kernel, labs,
    figures). A chapter's own subfolders (07_3d/planner, figures/) are rooms of that chapter."""
    parts = Path(path).parts
    return "/".join(parts[:2]) if parts[0] == "common" and len(parts) > 2 else parts[0]


def edges() -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import of a project file by a project file."""
    out = []
    for path in project_files():
        for imp in imports(path):
            targets = [module_path(f"{imp.module}.{n}") for n in imp.names] if imp.names else []
            targets = [t for t in targets if t] or [module_path(imp.module)]
            out.extend((path, t, imp.line) for t in targets if t and t != path)
    return out


EDGES = edges()


def test_the_floors_see_every_file() -> None:
    assert len(project_files()) > 150 and len(EDGES) > 300


@pytest.mark.parametrize("floor_index", range(5), ids=FLOOR_NAMES[:5])
def test_no_import_climbs(floor_index: int) -> None:
    climbing = [f"{a}:{line} imports {b} ({FLOOR_NAMES[floor(b)]}, above {FLOOR_NAMES[floor(a)]})"
                for a, b, line in EDGES if floor(a) == floor_index and floor(b) > floor(a)]
    assert not climbing, "\n".join(climbing)


def test_no_two_folders_import_each_other() -> None:
    arrows = {(folder(a), folder(b)) for a, b, _ in EDGES if folder(a) != folder(b)}
    pairs = sorted({tuple(sorted(pair)) for pair in itertools.permutations({f for e in arrows for f in e}, 2)
                    if pair in arrows and pair[::-1] in arrows})
    witnesses = [next(f"{a}:{line} → {b}" for a, b, line in EDGES if (folder(a), folder(b)) == (x, y))
                 for x, y in pairs for x, y in ((x, y), (y, x))]
    assert not pairs, f"{len(pairs)} two-way folder pairs: " + "\n".join(witnesses)


def test_tests_are_imported_by_no_project_file() -> None:
    offenders = [f"{path}:{imp.line}" for path in project_files() for imp in imports(path)
                 if imp.module.split(".")[0] == "tests"]
    assert not offenders, offenders


def test_a_planted_climbing_import_is_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a kernel file that imports the loop, and the loop importing a chapter."""
    fake = [("common/kernel/model.py", "common/training.py", 1),
            ("common/training.py", "05_tensor_parallel/layers.py", 1)]
    assert [floor(b) > floor(a) for a, b, _ in fake] == [True, True]
    assert floor("07_3d/parallelize.py") > floor("06_pipeline/executor.py") > floor("common/run.py")
    assert floor("06_pipeline/figures/lesson.py") == floor("06_pipeline/train.py") == 4


MAX_LINES = 400  # a file is one idea that fits a reading; split a longer one by idea


def long_files(root: Path, paths: list[str]) -> list[str]:
    lengths = {p: len((root / p).read_text(encoding="utf-8").splitlines()) for p in paths}
    return [f"{p}: {n} lines" for p, n in lengths.items() if n > MAX_LINES]


def test_every_file_of_the_chapters_and_common_is_at_most_400_lines(tmp_path: Path) -> None:
    assert long_files(ROOT, project_files()) == []
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))  # the check can fail
    assert long_files(tmp_path, ["long.py"]) == [f"long.py: {MAX_LINES + 1} lines"]
