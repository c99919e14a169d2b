"""Every chapter's lesson keeps its shape (CONTRIBUTING.md, "How a chapter is laid out"):
README.md is the core lesson (at most 220 lines, its lab's graded list between its markers, a
figure, closing with a Remember box); every other lesson page beside it is at most 200 lines,
linked from its chapter's README, and shows a figure (drawn by code, or a measurement:
common.figures.MEASURED); the front page's path links every lesson page, in reading order. That
each figure is drawn from the code: tests/test_figures.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p for p in ROOT.glob("0[1-7]_*") if p.is_dir())
FRONT = ROOT / "README.md"


def pages(chapter: Path) -> list[Path]:
    """The lesson pages beside a chapter's README (its subfolders' READMEs included), NOTES.md not."""
    found = [p for p in chapter.rglob("*.md") if p.name != "NOTES.md" and p != chapter / "README.md"]
    return sorted(found, key=lambda p: str(p.relative_to(chapter)))


def lines(path: Path) -> int:
    return path.read_text(encoding="utf-8").count("\n")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.name)
def test_the_lesson_is_one_sitting_and_ends_with_remember(chapter: Path) -> None:
    readme = chapter / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert lines(readme) <= 220, f"{chapter.name}/README.md has {lines(readme)} lines: move an idea to a page"
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings and headings[-1].startswith("Remember"), (
        f"{chapter.name}'s lesson must close with its Remember box, not {headings[-1:]}")
    assert text.count("<!-- lab-graded:begin -->") == 1 and text.count("<!-- lab-graded:end -->") == 1, (
        f"{chapter.name}/README.md: the Lab section's graded list goes between its two markers")
    assert re.search(r"!\[[^\]]+\]\(figures/", text), f"{chapter.name}/README.md shows no figure"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.name)
def test_every_page_is_short_linked_from_its_lesson_and_shows_a_figure(chapter: Path) -> None:
    lesson = (chapter / "README.md").read_text(encoding="utf-8")
    for page in pages(chapter):
        name = page.relative_to(chapter).as_posix()
        assert lines(page) <= 200, f"{chapter.name}/{name} has {lines(page)} lines (a page is at most 200)"
        assert f"]({name}" in lesson, f"{chapter.name}/README.md never links {name}"
        assert re.search(r"!\[[^\]]+\]\([^)]+\.(svg|png)\)", page.read_text(encoding="utf-8")), (
            f"{chapter.name}/{name} shows no figure (drawn by code, or a measurement)")


def test_the_front_page_path_meets_every_page_in_reading_order() -> None:
    front = FRONT.read_text(encoding="utf-8")
    order = [p for chapter in CHAPTERS for p in (chapter / "README.md", *pages(chapter))]
    where = {}
    for page in order:
        link = f"]({page.relative_to(ROOT).as_posix()})"
        assert link in front, f"the front page's path never links {page.relative_to(ROOT)}"
        where[page] = front.index(link)
    chapters = [where[chapter / "README.md"] for chapter in CHAPTERS]
    assert chapters == sorted(chapters), "the front page lists the chapters out of order"
    for chapter in CHAPTERS:
        assert all(where[p] > where[chapter / "README.md"] for p in pages(chapter)), (
            f"a page of {chapter.name} comes before its lesson on the front page's path")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.name)
def test_committed_notebook_outputs_name_no_machine_path(chapter: Path) -> None:
    """A committed output printing the author's absolute path (a home, a checkout) says nothing to
    a reader and leaks the machine it ran on."""
    notebook = json.loads((chapter / "lesson.ipynb").read_text(encoding="utf-8"))
    def text(out: dict) -> str:
        return "".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
    leaks = [(i, m.group(0)) for i, cell in enumerate(notebook["cells"]) for out in cell.get("outputs", [])
             for m in re.finditer(r"(?<![\w.])/(work|home|root|tmp|Users|private|mnt)/[\w./-]+", text(out))]
    assert not leaks, f"{chapter.name}/lesson.ipynb prints machine paths (cell, path): {leaks[:3]}"
