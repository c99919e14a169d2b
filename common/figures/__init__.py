"""Every figure of the course, drawn by code from what the code runs (CONTRIBUTING.md, "Figures").

A `Figure` is data plus a drawing. `data(**sizes)` calls the code path the figure pictures (the
ring's recorded P2P plan, a pipeline's schedule data, ZeRO's flat-buffer partition, the TP plan
table, the mesh's groups, real routing counts) and returns plain, JSON-able data; `draw(data)`
turns it into a matplotlib figure. Nothing in a figure is typed in by hand, so a figure cannot
disagree with the code it shows.

Each figure names its `sources`: the functions its data must come from, each with a `perturb`
that changes that function's result. tests/test_figures.py holds every figure to them:
  - replace a source with one that raises, and `data()` must raise (the data goes through it);
  - replace it with the perturbed one, and `data()` must change (the data follows the code);
  - the file the lesson shows is stamped with a hash of its data, and the hash must be today's
    (a figure not regenerated after its code changed goes red; `make figures` mends it);
  - every image a lesson or page shows exists, and every figure is shown by one;
  - every label reads at >= 10 px where GitHub shows it, in a font with a generic fallback
    (legible.py; tests/test_figures_legible.py).

`make figures` (python -m common.figures) writes them all; `show("ring_steps", n=8)` draws one
with other sizes in a notebook. Each chapter owns the code of its pictures: its package's
`figures` (e.g. 02_ring_allreduce/figures/, beside the images it writes) lists them in FIGURES.
This package is the drawing kernel they share (Figure, Source, draw.py, the stamp); it finds the
chapters' figures by name through common.chapters and never imports a chapter.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.chapters import CHAPTERS, ROOT

STAMP = "pfs-figure-data sha256 "


@dataclass(frozen=True)
class Source:
    """A function a figure's data comes from ("package.module:function"), and how to change its
    result so that the test can see the figure follow it."""

    target: str
    perturb: Callable[[Any], Any]


@dataclass(frozen=True)
class Figure:
    """One picture of one idea: `path` (from the repository root, in a chapter folder), its
    `data` from `sources`, its `draw`, the `sizes` the lesson shows (defaults of `data`)."""

    name: str
    path: str
    data: Callable[..., Any]
    draw: Callable[[Any], Any]
    sources: tuple[Source, ...]
    sizes: dict[str, Any] = field(default_factory=dict)
    alt: str = ""

    def compute(self, **sizes: Any) -> Any:
        return self.data(**{**self.sizes, **sizes})


def canonical(data: Any) -> Any:
    """The data with floats rounded to 9 significant digits: CPUs round the last bits
    differently, and a figure must not change with the machine."""
    if isinstance(data, float):
        return float(f"{data:.9g}") if math.isfinite(data) else str(data)
    if isinstance(data, dict):
        return {str(k): canonical(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [canonical(v) for v in data]
    if isinstance(data, (str, int, bool)) or data is None:
        return data
    raise TypeError(f"figure data must be JSON-able (dict, list, str, int, float, bool, None), got "
                    f"{type(data).__name__}: convert it in the figure's data function")


def data_hash(data: Any) -> str:
    text = json.dumps(canonical(data), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def figure_packages() -> list[str]:
    """The packages that hold figures, in course order: each chapter's `<package>.figures`."""
    return [f"{c.package}.figures" for c in CHAPTERS if (c.path / "figures" / "__init__.py").exists()]


def all_figures() -> list[Figure]:
    """Every figure of the course, in course order."""
    out: list[Figure] = []
    for package in figure_packages():
        out.extend(importlib.import_module(package).FIGURES)
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        raise ValueError(f"figure names must be unique: {sorted(n for n in names if names.count(n) > 1)}")
    return out


def figure(name: str) -> Figure:
    for f in all_figures():
        if f.name == name:
            return f
    raise KeyError(f"no figure named {name!r}: one of {[f.name for f in all_figures()]}")


def render(fig: Figure, **sizes: Any):
    """The matplotlib figure of `fig` at `sizes` (the lesson's where not given)."""
    from common.figures import draw

    draw.style()
    mpl_fig = fig.draw(fig.compute(**sizes))
    draw.finish(mpl_fig)
    return mpl_fig


def save(fig: Figure) -> Path:
    """Draw `fig` at the lesson's sizes into its file, stamped with its data's hash."""
    from common.figures import draw

    draw.style()
    data = fig.compute()
    mpl_fig = fig.draw(data)
    draw.finish(mpl_fig)
    path = ROOT / fig.path
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = STAMP + data_hash(data)
    if path.suffix == ".svg":
        metadata = {"Date": None, "Creator": None, "Description": stamp}
    else:
        metadata = {"Software": None, "Description": stamp}
    mpl_fig.savefig(path, metadata=metadata, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(mpl_fig)
    return path


def illegible(path: Path) -> list[str]:
    """What in a written figure file does not read on GitHub (legible.py); empty when all does."""
    from common.figures import legible

    if path.suffix == ".svg":
        return legible.svg_problems(path.read_text(encoding="utf-8"))
    return []  # a PNG is judged while drawn: tests/test_figures_legible.py


def stamp_of(path: Path) -> str | None:
    """The data hash written into a figure file by `save`, or None."""
    raw = path.read_bytes()
    m = re.search(re.escape(STAMP.encode()) + rb"([0-9a-f]{16})", raw)
    return m.group(1).decode() if m else None


def show(name: str, **sizes: Any):
    """In a notebook: draw figure `name` with other sizes (e.g. show("ring_steps", n=8))."""
    return render(figure(name), **sizes)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Draw every figure of the course into its chapter "
                                     "folder (make figures).")
    parser.add_argument("names", nargs="*", help="only these figures (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a figure file is missing, stale or illegible")
    args = parser.parse_args(argv)
    figures = [f for f in all_figures() if not args.names or f.name in args.names]
    stale = 0
    for fig in figures:
        path = ROOT / fig.path
        if args.check:
            want = data_hash(fig.compute())
            ok = path.exists() and stamp_of(path) == want
            stale += not ok
            print(f"{'ok   ' if ok else 'STALE'} {fig.path}")
        else:
            print(f"wrote {save(fig).relative_to(ROOT)}")
        problems = illegible(path) if path.exists() else []
        stale += bool(problems)
        for problem in problems[:5]:
            print(f"ILLEGIBLE {fig.path}: {problem}")
        if len(problems) > 5:
            print(f"ILLEGIBLE {fig.path}: ... and {len(problems) - 5} more (tests/test_figures_legible.py)")
    return 1 if stale else 0


# Images a lesson shows that are measurements, not pictures of a plan: each with the command that
# makes it (a bench or a profile on some machine; their data is a run's, so no stamp is checked).
MEASURED: dict[str, str] = {
    "01_data_parallel/trace.png": "python -m common.profile (01 README, 'Look at a trace')",
    "02_ring_allreduce/bandwidth.png": "make bench-2",
    "03_zero/bench.png": "make bench-3",
    "04_fsdp/trace.png": "python -m common.profile (04 README)",
    "05_tensor_parallel/bench.png": "make bench-5",
    "06_pipeline/timelines.png": "make bench-6 (06 against_torch.md)",
    "06_pipeline/trace.png": "python -m common.profile (06 README)",
}


def lesson_images() -> dict[str, list[str]]:
    """Every image each lesson page shows inline (![alt](path)), as paths from the root."""
    out: dict[str, list[str]] = {}
    pages = [*sorted(ROOT.glob("0[1-7]_*/**/*.md")), ROOT / "README.md"]
    for page in pages:
        if ".venv" in page.parts:
            continue
        shown = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text(encoding="utf-8"))
        shown += re.findall(r"<img [^>]*src=\"([^\"]+)\"", page.read_text(encoding="utf-8"))
        rel = str(page.relative_to(ROOT))
        out[rel] = [str((page.parent / s).resolve().relative_to(ROOT)) for s in shown
                    if not s.startswith(("http://", "https://"))]
    return out
