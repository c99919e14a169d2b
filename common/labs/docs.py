"""What each lab grades, written into its chapter's lesson from the graders themselves.

A lab's block sits between two marker lines in one page of its chapter: the chapter's main lab
in its README,

    <!-- lab-graded:begin -->
    <!-- lab-graded:end -->

and a named lab (`lab_<name>_check.py`) on the page about its mechanism, its name in its markers
(`<!-- lab-graded:begin expert -->` … `<!-- lab-graded:end expert -->`). The block lists the
lab's properties in the order they run, each with what it runs on and its checks by name (a
check's name is its function's, `check_in_flight` → *in flight*). In the README that is all (a
lesson is at most 220 lines); on a page, and from `python -m common.labs.docs N`, each check's
statement follows, once: the first paragraph of its docstring (a plan property's NCCL replay).
A check added, removed, renamed or reworded changes a block, and tests/test_lab_grader.py fails
until `python -m common.labs.docs --write` has rewritten it.
"""

from __future__ import annotations

import argparse
import importlib
import re
import textwrap
from pathlib import Path

from common.labs.grader import REPLAY, ROOT, Property, check_name, describe, lab_module, lab_names

CHAPTERS = range(1, 8)
REPLAYED = "replayed under NCCL's rules"
GENERATED = "<!-- generated: python -m common.labs.docs --write; tests/test_lab_grader.py checks it -->"


def markers(lab: str = "") -> tuple[str, str]:
    """The begin and end lines of a lab's block ("" : the chapter's main lab)."""
    name = f" {lab}" if lab else ""
    return f"<!-- lab-graded:begin{name} -->", f"<!-- lab-graded:end{name} -->"


def _fill(text: str, indent: str = "   ") -> str:
    return textwrap.fill(text, 100, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _where(prop: Property) -> str:
    """What a property runs on: one process, or its world sizes and the worlds it cuts into groups."""
    plain = list(dict.fromkeys(c["world"] for c in prop.configs if not c.get("groups")))
    cut = [f"a world of {c['world']} in groups {c['groups']}" for c in prop.configs if c.get("groups")]
    if plain == [1] and not cut:
        return "one process"
    worlds = [f"{', '.join(map(str, plain[:-1]))} and {plain[-1]}" if len(plain) > 1 else str(plain[0])] \
        if plain else []
    return "; ".join([f"{w} ranks" for w in worlds] + cut)


def label(check) -> str:
    """A check's name in the block: its function's, without check_."""
    return check_name(check).removeprefix("check_").replace("_", " ")


def _item(k: int, prop: Property) -> str:
    checks = REPLAYED if prop.plan else ", ".join(label(c) for c in prop.checks)
    return _fill(f"{k}. **{prop.name}** ({_where(prop)}{'; optional' if prop.optional else ''}): {checks}.")


def block(chapter: int, lab: str = "", full: bool = False) -> str:
    """The generated lines between a lab's markers; `full` adds each check's statement."""
    properties = importlib.import_module(lab_module(chapter, lab)).PROPERTIES
    command = f"make lab-check N={chapter}" + (f" LAB={lab}" if lab else "")
    more = "" if full else f" (each check stated by `python -m common.labs.docs {chapter}`)"
    out = [GENERATED, _fill(f"`{command}` grades, in order{more}:", "")]
    out += [_item(k, prop) for k, prop in enumerate(properties, 1)]
    if full:
        stated = {REPLAYED: REPLAY} if any(p.plan for p in properties) else {}
        for prop in properties:
            for check in prop.checks:
                stated.setdefault(label(check), describe(check))
        out += ["", *(_fill(f"- *{name}*: {text if text.endswith('.') else text + '.'}", "  ")
                      for name, text in stated.items())]
    return "\n".join(out)


def readme(chapter: int) -> Path:
    return next(ROOT.glob(f"0{chapter}_*")) / "README.md"


def homes(chapter: int, lab: str = "") -> list[Path]:
    """The pages of the chapter that hold the lab's begin marker (exactly one, when all is well)."""
    begin = markers(lab)[0]
    pages = sorted(readme(chapter).parent.rglob("*.md"))
    return [p for p in pages if begin in p.read_text(encoding="utf-8")]


def current(text: str, lab: str = "") -> str | None:
    """The text between the lab's markers, or None when the text has none."""
    begin, end = map(re.escape, markers(lab))
    match = re.search(begin + r"\n(.*?)\n?" + end, text, re.S)
    return None if match is None else match.group(1).strip("\n")


def expected(chapter: int, lab: str, page: Path) -> str:
    """The block a page should hold: compact in the README, with each check's statement elsewhere."""
    return block(chapter, lab, full=page != readme(chapter))


def write() -> list[str]:
    """Rewrite every lab's block; the pages changed, and each lab without exactly one home."""
    changed = []
    for chapter in CHAPTERS:
        for lab in lab_names(chapter):
            found = homes(chapter, lab)
            if len(found) != 1:
                begin, end = markers(lab)
                changed.append(f"chapter {chapter}, lab {lab or '(main)'}: {len(found)} pages hold {begin} … "
                               f"{end}; one must")
                continue
            (page,) = found
            text = page.read_text(encoding="utf-8")
            begin, end = markers(lab)
            generated = f"{begin}\n{expected(chapter, lab, page)}\n{end}"
            new = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _, g=generated: g, text,
                         flags=re.S)
            if new != text:
                page.write_text(new, encoding="utf-8")
                changed.append(str(page.relative_to(ROOT)))
    return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapters", nargs="*", type=int, help="print these chapters' labs, each check stated")
    parser.add_argument("--write", action="store_true", help="rewrite the lessons' lab-graded blocks")
    args = parser.parse_args(argv)
    if args.write:
        print("\n".join(write()) or "every block is up to date")
        return
    for chapter in args.chapters or CHAPTERS:
        for lab in lab_names(chapter):
            print(f"--- chapter {chapter}{', lab ' + lab if lab else ''}\n{block(chapter, lab, full=True)}\n")


if __name__ == "__main__":
    main()
