"""Chapter 05's lesson keeps its shape (issue 30; DESIGN.md, Layout): README.md is the core lesson
(at most 220 lines, closing with a Remember box, the lab's graded list between its markers), and
every other lesson page beside it is at most 200 lines, linked from the README, and shows a
figure. Which figures, and that each is drawn from the code: tests/test_figures.py."""

from __future__ import annotations

import re
from pathlib import Path

CHAPTER = Path(__file__).resolve().parent.parent / "05_tensor_parallel"
README = CHAPTER / "README.md"
PAGES = sorted(p for p in CHAPTER.glob("*.md") if p.name not in ("README.md", "NOTES.md"))


def test_the_readme_is_one_sitting_and_ends_with_remember() -> None:
    text = README.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= 220, f"05_tensor_parallel/README.md has {lines} lines: move an idea to a page beside it"
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[-1] == "Remember", f"the lesson must close with its Remember box, not {headings[-1]!r}"
    assert text.count("<!-- lab-graded:begin -->") == 1 and text.count("<!-- lab-graded:end -->") == 1


def test_every_page_is_short_linked_from_the_readme_and_shows_a_figure() -> None:
    assert {p.name for p in PAGES} >= {"sequence_parallel.md", "context_parallel.md", "expert_parallel.md"}
    readme = README.read_text(encoding="utf-8")
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert text.count("\n") <= 200, f"{page.name} has {text.count(chr(10))} lines (at most 200)"
        assert f"]({page.name})" in readme, f"README.md never links {page.name}"
        assert re.search(r"!\[[^\]]+\]\(figures/", text), f"{page.name} shows no figure"
