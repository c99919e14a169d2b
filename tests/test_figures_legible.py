"""Every figure reads on GitHub (common/figures/legible.py): each label is >= 10 px at the width
GitHub shows the image (scaled down to its ~830 px column when wider), and each font-family ends
in a generic family, so a viewer without DejaVu Sans still draws the text.

Committed SVGs are read as written; a PNG figure is judged on its live matplotlib figure at the
dpi it is saved with. The rule itself is checked on figures made to break it.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from common.figures import ROOT, all_figures, draw, illegible, legible, render

FIGURES = all_figures()
BY_PATH = {f.path: f for f in FIGURES}
PATHS = sorted(set(BY_PATH) | {str(p.relative_to(ROOT)) for p in ROOT.glob("0[1-7]_*/**/figures/*.svg")})


@pytest.mark.parametrize("path", PATHS)
def test_committed_figure_reads_on_github(path: str) -> None:
    if path.endswith(".svg"):
        problems = illegible(ROOT / path)
    else:  # a PNG's pixels hold no sizes: judge its drawing at the dpi it is saved with
        mpl_fig = render(BY_PATH[path])
        problems = legible.figure_problems(mpl_fig, dpi=plt.rcParams["savefig.dpi"])
        plt.close(mpl_fig)
    assert not problems, (f"{path}: {len(problems)} labels do not read on GitHub, e.g. "
                          f"{problems[:4]}: use at least draw.SMALL pt in a figure draw.WIDTH wide "
                          f"(legible.min_points(width) in a wider one), then `make figures`")


def _svg(tmp_path, width: float, size: float, **text) -> tuple[str, list[str]]:
    draw.style()
    fig, ax = draw.figure(height=1.0, width=width)
    fig.subplots_adjust(0, 0, 1, 1)  # the image is exactly `width` wide
    ax.text(0.5, 0.5, "label", fontsize=size, **text)
    ax.set_xticks([]), ax.set_yticks([])
    problems = legible.figure_problems(fig)
    fig.savefig(tmp_path / "f.svg", bbox_inches="tight")
    plt.close(fig)
    return (tmp_path / "f.svg").read_text(), problems


def test_the_kernels_smallest_size_reads_and_anything_smaller_does_not(tmp_path) -> None:
    svg, live = _svg(tmp_path, draw.WIDTH, draw.SMALL)
    assert legible.svg_problems(svg) == [] and live == []
    svg, live = _svg(tmp_path, draw.WIDTH, draw.SMALL - 0.5)
    assert len(legible.svg_problems(svg)) == 1 and len(live) == 1


def test_a_label_that_reads_in_a_narrow_figure_does_not_in_a_wide_one(tmp_path) -> None:
    svg, live = _svg(tmp_path, 14.0, 9.0)  # 9 pt = 12 px; 14.2 in (with the pad) = 1363 px
    assert legible.effective_px(12.0, 1363.2) == pytest.approx(7.31, abs=0.01)
    assert "read at 7.3 px" in " ".join(legible.svg_problems(svg)) and len(live) == 1


def test_a_font_without_a_generic_fallback_is_refused(tmp_path) -> None:
    svg, _ = _svg(tmp_path, draw.WIDTH, 9.0)
    assert "sans-serif" in svg and legible.svg_problems(svg) == []
    svg, _ = _svg(tmp_path, draw.WIDTH, 9.0, family="DejaVu Sans")
    assert any("no generic fallback" in p for p in legible.svg_problems(svg))


def test_log_ticks_are_plain_text_not_a_tiny_exponent(tmp_path) -> None:
    draw.style()
    fig, ax = draw.figure(height=2.0)
    ax.loglog([1, 1e6], [2, 2**20])
    ax.set_yscale("log", base=2)
    draw.finish(fig)
    fig.savefig(tmp_path / "f.svg", bbox_inches="tight")
    plt.close(fig)
    svg = (tmp_path / "f.svg").read_text()
    assert legible.svg_problems(svg) == []
    assert "<tspan" not in svg and ">1M</text>" in svg and "Ki</text>" in svg
