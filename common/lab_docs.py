"""What each lab grades, written into its chapter's README from the graders themselves.

Each chapter README's Lab section holds a block between the lines

    <!-- lab-graded:begin -->
    <!-- lab-graded:end -->

made of the chapter's labs' properties, in the order they run: each property's name, what it
runs on, and its checks' one-line descriptions (the first line of each check's docstring; a plan
property's NCCL replay). A check added, removed or reworded changes the block, and
tests/test_lab_grader.py fails until `python -m common.lab_docs --write` has rewritten it.
"""

from __future__ import annotations

import argparse
import importlib
import re
import textwrap
from pathlib import Path

from common.grader import ROOT, Property, lab_module, lab_names

BEGIN, END = "<!-- lab-graded:begin -->", "<!-- lab-graded:end -->"
CHAPTERS = range(1, 8)


def _where(prop: Property) -> str:
    """What a property runs on: one process, or its world sizes and the worlds it cuts into groups."""
    plain = list(dict.fromkeys(c["world"] for c in prop.configs if not c.get("groups")))
    cut = [f"a world of {c['world']} cut into groups {c['groups']}" for c in prop.configs if c.get("groups")]
    if plain == [1] and not cut:
        return "in one process"
    worlds = [f"{', '.join(map(str, plain[:-1]))} and {plain[-1]}" if len(plain) > 1 else str(plain[0])] \
        if plain else []
    return "on " + "; ".join([f"{w} ranks" for w in worlds] + cut)


OPTIONAL = " (optional: reported, never needed to pass; written and wrong, it fails)"


def _item(k: int, prop: Property) -> str:
    text = f"{k}. **{prop.name}** ({_where(prop)}){OPTIONAL if prop.optional else ''}: " + " ".join(
        d if d.endswith(".") else d + "." for d in prop.descriptions())
    return textwrap.fill(text, 100, subsequent_indent="   ", break_long_words=False, break_on_hyphens=False)


def block(chapter: int) -> str:
    """The generated lines between the markers of chapter `chapter`'s README."""
    out = ["<!-- generated from the labs' checks: python -m common.lab_docs --write; "
           "tests/test_lab_grader.py checks it -->"]
    for lab in lab_names(chapter):
        command = f"make lab-check N={chapter}" + (f" LAB={lab}" if lab else "")
        properties = importlib.import_module(lab_module(chapter, lab)).PROPERTIES
        intro = (f"`{command}` grades, in this order (a ✓ needs every check of its property; the first "
                 "check to fail in time decides a ✗):")
        out += ["", textwrap.fill(intro, 100, break_long_words=False, break_on_hyphens=False), ""]
        out += [_item(k, prop) for k, prop in enumerate(properties, 1)]
    return "\n".join(out)


def readme(chapter: int) -> Path:
    return next(ROOT.glob(f"0{chapter}_*")) / "README.md"


def current(text: str) -> str | None:
    """The text between the markers, or None when the README has none."""
    match = re.search(re.escape(BEGIN) + r"\n(.*?)\n?" + re.escape(END), text, re.S)
    return None if match is None else match.group(1).strip("\n")


def write() -> list[str]:
    """Rewrite every README's block; the changed ones. A README without the markers is reported."""
    changed = []
    for chapter in CHAPTERS:
        path = readme(chapter)
        text = path.read_text(encoding="utf-8")
        if current(text) is None:
            changed.append(f"{path.relative_to(ROOT)}: no {BEGIN} … {END} block to write into")
            continue
        generated = f"{BEGIN}\n{block(chapter)}\n{END}"
        new = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _, g=generated: g, text, flags=re.S)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(str(path.relative_to(ROOT)))
    return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the READMEs' lab-graded blocks")
    args = parser.parse_args(argv)
    if args.write:
        print("\n".join(write()) or "every README is up to date")
        return
    for chapter in CHAPTERS:
        print(f"--- {readme(chapter).relative_to(ROOT)}\n{block(chapter)}\n")


if __name__ == "__main__":
    main()
