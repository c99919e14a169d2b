"""The course reads in sittings (README.md, "The path"): each row of the front page's path is one
sitting, a lesson page and the pages read with it, closed by its Remember box and, where it has
one, its lab. A chapter too long for one sitting (05, 07) declares its sittings in its README
(`**05.2 Sequence parallel**`), each later sitting's page names itself in its opening lines, and
the front page names them in the same order. Every link and image of the lessons (their
notebooks' text cells too) resolves.

The bound on a sitting, SITTING_LINES, is measured, not chosen: the chapters read in one sitting
held, on 2026-12-07, 01 561 lines (lesson 188 + four pages), 02 424, 03 410, 04 394, 06 396; 05
whole held 663 and 07 whole 886, which is why each reads as four. 600 is the longest one-sitting
chapter plus room for one more section; the 1.2 × 561 = 673 a looser rule would give lets 05 back
in as a single sitting.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRONT = ROOT / "README.md"
SITTING_LINES = 600
ROW = re.compile(r"^\| \*\*(\d\d)(?:\.(\d+))? ([^*|]+)\*\* \| (.+?) \| (.+?) \|$", re.M)
LAB = re.compile(r"`make lab-check N=(\d)(?: LAB=(\w+))?(?: ONLY=(\w+))?`")


@dataclass(frozen=True)
class Sitting:
    number: str          # "01", "05.2"
    name: str
    chapter: Path
    pages: tuple[Path, ...]
    labs: tuple[tuple[int, str, str], ...]  # (N, LAB, ONLY), "" where not given

    @property
    def label(self) -> str:
        return f"{self.number} {self.name}"


def sittings(front: str) -> list[Sitting]:
    out = []
    for chapter, k, name, read, lab in ROW.findall(front):
        folder = next(ROOT.glob(f"{chapter}_*"))
        pages = tuple(ROOT / link for link in re.findall(r"\]\(([^)]+\.md)\)", read))
        labs = tuple((int(n), named, only) for n, named, only in LAB.findall(lab))
        out.append(Sitting(f"{chapter}.{k}" if k else chapter, name.strip(), folder, pages, labs))
    return out


def lines(path: Path) -> int:
    return path.read_text(encoding="utf-8").count("\n")


def opening(path: Path) -> str:
    """A page's text before its first "## " heading, whitespace collapsed."""
    text = path.read_text(encoding="utf-8")
    return " ".join(text.split("\n## ", 1)[0].split())


def lesson_pages(chapter: Path) -> list[Path]:
    return [p for p in chapter.rglob("*.md") if p.name != "NOTES.md"]


SITTINGS = sittings(FRONT.read_text(encoding="utf-8"))
CHAPTERS = sorted(p for p in ROOT.glob("0[1-7]_*") if p.is_dir())


def of(chapter: Path) -> list[Sitting]:
    return [s for s in SITTINGS if s.chapter == chapter]


def test_the_front_page_path_is_one_sitting_a_row_in_reading_order() -> None:
    assert [s.chapter for s in SITTINGS] == sorted(s.chapter for s in SITTINGS), (
        f"the path lists sittings out of chapter order: {[s.number for s in SITTINGS]}")
    for chapter in CHAPTERS:
        mine = of(chapter)
        assert mine, f"the front page's path has no sitting of {chapter.name}"
        numbers = [s.number for s in mine]
        two = chapter.name[:2]
        want = [two] if len(mine) == 1 else [f"{two}.{k}" for k in range(1, len(mine) + 1)]
        assert numbers == want, f"{chapter.name}'s sittings are numbered {numbers}, not {want}"
        assert mine[0].pages[0] == chapter / "README.md", f"{chapter.name}'s first sitting opens on README.md"
        read = [p for s in mine for p in s.pages]
        missing = sorted(p.relative_to(ROOT).as_posix() for p in set(lesson_pages(chapter)) - set(read))
        twice = sorted({p.relative_to(ROOT).as_posix() for p in read if read.count(p) > 1})
        assert not missing and not twice, f"{chapter.name}: pages in no sitting {missing}, in two {twice}"


@pytest.mark.parametrize("chapter", [c for c in CHAPTERS if len(of(c)) > 1], ids=lambda c: c.name)
def test_a_chapter_of_several_sittings_declares_them_as_the_front_page_names_them(chapter: Path) -> None:
    declared = re.findall(r"\*\*(\d\d\.\d+ [^*]+)\*\*", opening(chapter / "README.md"))
    named = [s.label for s in of(chapter)]
    assert declared == named, (f"{chapter.name}/README.md's opening declares the sittings {declared}; "
                               f"the front page's path names {named}: one order, one set of names")
    for sitting in of(chapter):
        for page in sitting.pages[1 if sitting.pages[0] == chapter / "README.md" else 0:]:
            assert f"**{sitting.label}**" in opening(page), (
                f"{page.relative_to(ROOT)} opens without naming its sitting **{sitting.label}**")


@pytest.mark.parametrize("sitting", SITTINGS, ids=lambda s: s.number)
def test_every_sitting_closes_with_its_remember_box_and_fits_one_sitting(sitting: Sitting) -> None:
    lesson = sitting.pages[0]
    headings = re.findall(r"^## (.+)$", lesson.read_text(encoding="utf-8"), re.M)
    assert headings and headings[-1].startswith("Remember"), (
        f"sitting {sitting.label}: {lesson.relative_to(ROOT)} must close with its Remember section, "
        f"not {headings[-1:]}")
    total = sum(lines(p) for p in sitting.pages)
    assert total <= SITTING_LINES, (
        f"sitting {sitting.label} reads {total} lines ({', '.join(p.name for p in sitting.pages)}), "
        f"more than one sitting ({SITTING_LINES}): split it into sittings, as 05 and 07 are")


def graded(chapter: Path, lab: str) -> tuple[list[Path], list[str]]:
    """The pages holding the lab's graded list, and its properties' names."""
    begin = f"<!-- lab-graded:begin{' ' + lab if lab else ''} -->"
    homes = [p for p in lesson_pages(chapter) if begin in p.read_text(encoding="utf-8")]
    block = homes[0].read_text(encoding="utf-8").split(begin, 1)[1] if homes else ""
    return homes, re.findall(r"^\d+\. \*\*(.+?)\*\*", block.split("<!-- lab-graded:end", 1)[0], re.M)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.name)
def test_every_lab_is_named_by_the_sitting_that_grades_it(chapter: Path) -> None:
    labs = [""] * (chapter / "lab_check.py").exists() + sorted(
        m[1] for p in chapter.glob("lab_*_check.py") if (m := re.fullmatch(r"lab_(\w+)_check\.py", p.name)))
    whole = {}
    for sitting in of(chapter):
        for n, lab, only in sitting.labs:
            assert n == int(chapter.name[:2]), f"sitting {sitting.label} names chapter {n}'s lab"
            assert lab in labs, f"sitting {sitting.label}: `LAB={lab}` is no lab of {chapter.name} ({labs})"
            homes, properties = graded(chapter, lab)
            if only:
                hits = [p for p in properties if only in p]
                assert len(hits) == 1, (f"sitting {sitting.label}: `ONLY={only}` picks {hits} of the lab's "
                                        f"properties; it must pick one")
            else:
                whole.setdefault(lab, []).append(sitting.label)
                assert set(homes) & set(sitting.pages), (
                    f"sitting {sitting.label} names `LAB={lab}`, graded on "
                    f"{[p.relative_to(ROOT).as_posix() for p in homes]}, none of its pages")
    assert {lab: len(names) for lab, names in whole.items()} == dict.fromkeys(labs, 1), (
        f"{chapter.name}: each lab {labs} is named whole by exactly one sitting, not {whole}")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, links and code marks dropped, punctuation gone."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def unfenced(path: Path) -> str:
    """The page without its fenced code blocks (whose lines are neither headings nor links)."""
    return re.sub(r"^\s*```.*?^\s*```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)


def anchors(path: Path) -> set[str]:
    out, count = set(), {}
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", unfenced(path), re.M):
        s = slug(heading)
        n = count[s] = count.get(s, -1) + 1
        out.add(f"{s}-{n}" if n else s)  # GitHub numbers a repeated heading's anchor
    return out


def linking_text(page: Path) -> str:
    """Where a page's links are: a page's prose, a notebook's markdown cells; code marks dropped."""
    if page.suffix == ".ipynb":
        cells = json.loads(page.read_text(encoding="utf-8"))["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    else:
        text = unfenced(page)
    return re.sub(r"`[^`\n]*`", "", text)


DOCS = sorted([p for c in CHAPTERS for p in [*c.rglob("*.md"), c / "lesson.ipynb"]]
              + [FRONT, ROOT / "CONTRIBUTING.md"])


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_and_image_of_the_lessons_resolves(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", linking_text(page)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there: {broken}"
