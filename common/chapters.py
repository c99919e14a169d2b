"""The chapters of the course, listed once: number, import name, folder.

Read from pyproject.toml's `[tool.setuptools.package-dir]` (the one place a folder gets its import
name), so adding a chapter is one line there. Whatever needs "every chapter" (the figures, the
labs' grader, the copy sets, the tests) takes it from here and finds the chapter's modules by name
(`importlib`), so nothing under `common/` imports a chapter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# import name → folder, in file order (common first)
PACKAGES: dict[str, str] = dict(re.findall(
    r'^(\w+) = "([\w/]+)"$',
    (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-dir]")[1].split("\n[")[0],
    re.M))
FOLDERS = {folder: name for name, folder in PACKAGES.items()}


@dataclass(frozen=True)
class Chapter:
    number: int  # 1 … 7
    package: str  # data_parallel
    folder: str  # 01_data_parallel

    @property
    def path(self) -> Path:
        return ROOT / self.folder


CHAPTERS: tuple[Chapter, ...] = tuple(sorted(
    (Chapter(int(folder.split("_")[0]), name, folder) for name, folder in PACKAGES.items()
     if re.match(r"\d\d_", folder)), key=lambda c: c.number))


def chapter(number: int) -> Chapter:
    for c in CHAPTERS:
        if c.number == number:
            return c
    raise KeyError(f"no chapter {number}: the chapters are {', '.join(str(c.number) for c in CHAPTERS)}")
