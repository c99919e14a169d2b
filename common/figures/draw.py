"""What every figure shares: one look (fonts, colours per rank, sizes readable on GitHub), and the
three shapes most of the course is drawn with: boxes on a grid (shards, blocks, ranks), arrows
between them (messages), and timelines (one lane per rank, a bar per action).

matplotlib is imported here and in the figure modules only; no core file needs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt  # no backend chosen here: a notebook's %matplotlib inline stays on
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

# One colour per rank (colour-blind-safe, Okabe-Ito then Tol's muted), and one per kind of action.
RANK_COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999",
               "#332288", "#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677", "#882255")
KIND_COLORS = {"forward": "#56B4E9", "backward": "#0072B2", "weight": "#009E73", "comm": "#E69F00",
               "gather": "#E69F00", "reduce": "#D55E00", "free": "#DDDDDD", "idle": "#FFFFFF",
               "compute": "#56B4E9", "optimizer": "#CC79A7"}
WIDTH = 9.0  # inches: a GitHub page column at 100 dpi


def style() -> None:
    """The course's look, and output that is the same bytes for the same data (no dates, fixed ids)."""
    plt.rcdefaults()
    plt.rcParams.update({
        "svg.fonttype": "none", "svg.hashsalt": "parallel-from-scratch", "figure.dpi": 100,
        "savefig.dpi": 100, "font.size": 9, "axes.titlesize": 10, "axes.titleweight": "bold",
        "axes.spines.top": False, "axes.spines.right": False, "legend.frameon": False,
        "font.family": "DejaVu Sans", "path.simplify": True,
    })


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def figure(height: float, width: float = WIDTH, ncols: int = 1, nrows: int = 1, **kw):
    """A new figure and its axes (a single axis when 1×1)."""
    return plt.subplots(nrows, ncols, figsize=(width, height), squeeze=nrows * ncols > 1, **kw) \
        if nrows * ncols > 1 else plt.subplots(figsize=(width, height), **kw)


def blank(ax, xlim: tuple[float, float], ylim: tuple[float, float], invert_y: bool = True) -> None:
    """An axis for a diagram: no ticks or spines, data coordinates as given (y down by default)."""
    ax.set_xlim(*xlim)
    ax.set_ylim(*(reversed(ylim) if invert_y else ylim))
    ax.set_axis_off()


def box(ax, x: float, y: float, w: float, h: float, text: str = "", color: str = "#FFFFFF",
        edge: str = "#333333", fontsize: float | None = None, alpha: float = 1.0,
        hatch: str | None = None, textcolor: str = "#000000") -> None:
    """A rectangle with its top-left at (x, y) (y down) and centred text."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge, linewidth=0.8, alpha=alpha,
                           hatch=hatch))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize,
                color=textcolor)


def arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str = "#333333",
          text: str = "", rad: float = 0.0, width: float = 1.0, fontsize: float | None = None) -> None:
    """An arrow from `start` to `end` (curved by `rad`), with a label at its middle."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=9, color=color,
                                 linewidth=width, connectionstyle=f"arc3,rad={rad}",
                                 shrinkA=2, shrinkB=2))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2, text, ha="center", va="center",
                fontsize=fontsize or 7, color=color,
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none"})


@dataclass(frozen=True)
class Bar:
    """One action on one lane of a timeline: [start, end), its kind (a KIND_COLORS key or a
    colour) and a short label drawn on it."""

    lane: int
    start: float
    end: float
    kind: str
    label: str = ""


def timeline(ax, bars: Iterable[Bar], lanes: Sequence[str], unit: str = "",
             legend: Sequence[str] | None = None, title: str = "") -> None:
    """Lanes top to bottom (lanes[0] on top), time left to right, a labelled bar per action."""
    bars = list(bars)
    for b in bars:
        color = KIND_COLORS.get(b.kind, b.kind)
        ax.add_patch(Rectangle((b.start, b.lane - 0.4), b.end - b.start, 0.8, facecolor=color,
                               edgecolor="#333333", linewidth=0.5))
        if b.label:
            ax.text((b.start + b.end) / 2, b.lane, b.label, ha="center", va="center", fontsize=6.5)
    end = max((b.end for b in bars), default=1.0)
    ax.set_xlim(0, end)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.tick_params(axis="y", length=0)
    ax.spines["left"].set_visible(False)
    if unit:
        ax.set_xlabel(unit)
    if title:
        ax.set_title(title, loc="left")
    if legend:
        ax.legend(handles=[Patch(facecolor=KIND_COLORS.get(k, k), edgecolor="#333333", label=k)
                           for k in legend], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
