"""Every figure is drawn from the code it pictures (CONTRIBUTING.md, "Figures"; common/figures).

For each figure and each of its sources: replaced by a function that raises, the figure's data
raises (its data goes through that code); replaced by one whose result is perturbed, the data
changes (it follows the code). The file a lesson shows carries the hash of today's data (not
stale), every image a lesson or page shows exists, and every figure is shown somewhere.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from common.chapters import CHAPTERS
from common.figures import MEASURED, ROOT, Figure, all_figures, data_hash, lesson_images, stamp_of

FIGURES = all_figures()


class ReachedError(Exception):
    """Raised by a source replaced in the test: the figure's data went through it."""


def replaced(monkeypatch: pytest.MonkeyPatch, target: str, make) -> None:
    """Replace the function `module:name` everywhere it is bound (its module and every module
    that imported it by name), with `make(original)`."""
    module_name, name = target.split(":")
    original = getattr(importlib.import_module(module_name), name)
    new = make(original)
    project = ("common", *(c.package for c in CHAPTERS))
    for mod in list(sys.modules.values()):  # vars(): a lazy module's __getattr__ would import things
        if getattr(mod, "__name__", "").split(".")[0] in project and vars(mod).get(name) is original:
            monkeypatch.setattr(mod, name, new)


def raising(target: str):
    def f(*args, **kwargs):
        raise ReachedError(target)
    return f


def perturbed(original, perturb):
    def f(*args, **kwargs):
        return perturb(original(*args, **kwargs))
    return f


def test_there_are_figures() -> None:
    assert FIGURES, "common.figures.all_figures() found no figure"


@pytest.mark.parametrize("fig", FIGURES, ids=lambda f: f.name)
def test_figure_data_comes_from_its_sources(fig: Figure, monkeypatch: pytest.MonkeyPatch) -> None:
    assert fig.sources, f"{fig.name} names no source: what code does it picture?"
    base = fig.compute()
    for source in fig.sources:
        with monkeypatch.context() as m:
            replaced(m, source.target, lambda original, t=source.target: raising(t))
            with pytest.raises(ReachedError):
                fig.compute()
        with monkeypatch.context() as m:
            replaced(m, source.target, lambda original, p=source.perturb: perturbed(original, p))
            changed = fig.compute()
        assert data_hash(changed) != data_hash(base), (
            f"{fig.name}: perturbing {source.target} left the figure's data unchanged")


@pytest.mark.parametrize("fig", FIGURES, ids=lambda f: f.name)
def test_committed_figure_is_drawn_from_todays_data(fig: Figure) -> None:
    path = ROOT / fig.path
    assert path.exists(), f"{fig.path} is missing: run `make figures`"
    assert stamp_of(path) == data_hash(fig.compute()), (
        f"{fig.path} was drawn from other data than the code gives today: run `make figures`")


def test_every_image_a_lesson_shows_exists_and_every_figure_is_shown() -> None:
    shown = lesson_images()
    missing = [(page, img) for page, imgs in shown.items() for img in imgs if not (ROOT / img).exists()]
    assert not missing, f"lessons show images that do not exist: {missing}"
    everything = {img for imgs in shown.values() for img in imgs}
    unshown = [f.path for f in FIGURES if f.path not in everything]
    assert not unshown, f"figures no lesson or page shows: {unshown}"
    drawn = {f.path for f in FIGURES}
    unknown = sorted(img for img in everything if img not in drawn and img not in MEASURED)
    assert not unknown, (f"images shown that no figure draws and MEASURED does not list with its "
                         f"command: {unknown}")


def test_every_figure_of_a_chapter_is_a_cell_of_its_notebook() -> None:
    """Notebooks follow the pages: each figure a chapter's lesson or page shows is redrawn by a
    `show("name", ...)` cell of the chapter's lesson.ipynb, where the learner changes the sizes."""
    by_path = {f.path: f.name for f in FIGURES}
    absent = []
    for page, images in lesson_images().items():
        notebook = ROOT / Path(page).parts[0] / "lesson.ipynb"
        if not notebook.exists():  # the front page
            continue
        cells = json.loads(notebook.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        absent += [(page, by_path[img]) for img in images
                   if img in by_path and f'show("{by_path[img]}"' not in code]
    assert not absent, f"figures no notebook cell redraws: {absent}"
