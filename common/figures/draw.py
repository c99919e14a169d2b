"""What every figure shares: one look (fonts, colours per rank, sizes readable on GitHub: the rule
and its check are legible.py), and the three shapes most of the course is drawn with: boxes on a
grid (shards, blocks, ranks), arrows between them (messages), and timelines (one lane per rank, a
bar per action).

matplotlib is imported here and in the figure modules only; no core file needs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt  # no backend chosen here: a notebook's %matplotlib inline stays on
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle
from matplotlib.ticker import FuncFormatter, LogFormatterSciNotation, NullFormatter

from common.figures.legible import CSS_PX_PER_INCH, min_points

# One colour per rank (colour-blind-safe, Okabe-Ito then Tol's muted), and one per kind of action.
RANK_COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#999999",
               "#332288", "#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677", "#882255")
KIND_COLORS = {"forward": "#56B4E9", "backward": "#0072B2", "weight": "#009E73", "comm": "#E69F00",
               "gather": "#E69F00", "reduce": "#D55E00", "free": "#DDDDDD", "idle": "#FFFFFF",
               "compute": "#56B4E9", "optimizer": "#CC79A7"}
# inches: with the saved pad on each side 8.6 in = 826 CSS px, inside GitHub's 830 px column, so
# an SVG is shown at its size (1 pt = 4/3 px)
WIDTH = 8.4
PAD = 0.1  # inches of white around the tight box, each side
# The smallest font (pt) a figure WIDTH wide may use: 10 px on GitHub (legible.py). A figure drawn
# wider (a legend beside the axes) needs larger text: legible.min_points(its saved width).
SMALL = min_points(WIDTH + 2 * PAD)
# Text stays text in the SVG (small, diffable files whose sizes a test can read); the viewer draws
# it with the first of these fonts it has. matplotlib lays it out with DejaVu Sans, which it ships;
# the fallbacks are narrower, so a label still fits where it was placed.
SANS = ("DejaVu Sans", "Bitstream Vera Sans", "Arial", "Helvetica", "Liberation Sans")
MONO = ("DejaVu Sans Mono", "Bitstream Vera Sans Mono", "Menlo", "Consolas", "Liberation Mono")


def style() -> None:
    """The course's look, and output that is the same bytes for the same data (no dates, fixed ids).
    Each font-family the SVG writes ends in its generic family (sans-serif, monospace)."""
    plt.rcdefaults()
    plt.rcParams.update({
        "svg.fonttype": "none", "svg.hashsalt": "parallel-from-scratch", "figure.dpi": 100,
        "savefig.dpi": CSS_PX_PER_INCH, "savefig.pad_inches": PAD, "font.size": 9, "axes.titlesize": 10,
        "axes.titleweight": "bold", "legend.fontsize": SMALL, "axes.spines.top": False,
        "axes.spines.right": False, "legend.frameon": False, "font.family": "sans-serif",
        "font.sans-serif": list(SANS), "font.monospace": list(MONO), "path.simplify": True,
    })


def _power_label(base: float):
    """A log axis's tick as plain text (1, 10, 1k, 1M; 1Ki, 1Mi in base 2; 1e-4 below 0.01):
    matplotlib's 10^k writes the exponent at 0.7 of the tick size, too small to read."""
    units = ("", "Ki", "Mi", "Gi", "Ti", "Pi") if base == 2 else ("", "k", "M", "G", "T", "P")
    step = 1024.0 if base == 2 else 1000.0

    def label(v: float, _pos: int | None = None) -> str:
        if v <= 0:
            return ""
        if v < 0.01:
            return f"{v:.0e}".replace("e-0", "e-")
        k = 0
        while v >= step and k < len(units) - 1:
            v, k = v / step, k + 1
        return f"{v:g}{units[k]}"
    return label


def saved_width(fig) -> float:
    """The inches `fig` is saved at (bbox_inches="tight", with the pad)."""
    fig.canvas.draw()
    return fig.get_tightbbox().width + 2 * plt.rcParams["savefig.pad_inches"]


def wrap_titles(fig, originals: dict | None = None) -> dict:
    """Break a title that runs past the figure's right edge, or into the next axes' title, into
    lines that fit (a long title must not widen the image or overrun its neighbour). Returns each
    title's text as drawn; pass it back to re-break them after the axes moved."""
    import textwrap

    originals = originals if originals is not None else {}
    renderer = fig.canvas.get_renderer()
    right_edge = fig.bbox.x1

    def wrap(title, room: float) -> None:
        text = originals.setdefault(title, title.get_text())
        title.set_text(text)
        width = title.get_window_extent(renderer).width
        if text and width > room:
            chars = max(int(max(map(len, text.split("\n"))) * max(room, 1.0) / width), 20)
            title.set_text("\n".join(textwrap.fill(line, chars) for line in text.split("\n")))

    if fig._suptitle is not None:
        wrap(fig._suptitle, fig.bbox.width - 16)
    for ax in fig.axes:
        box = ax.get_position()
        neighbours = [o.get_window_extent().x0 for o in fig.axes if o is not ax and o.get_visible()
                      and o.get_position().x0 > box.x0 and o.get_position().y0 < box.y1
                      and o.get_position().y1 > box.y0]
        limit = min(neighbours, default=right_edge) - 8
        for title in (ax.title, ax._left_title, ax._right_title):
            wrap(title, limit - title.get_window_extent(renderer).x0)
    return originals


def fit(fig) -> None:
    """Pull a figure whose labels stick out past its sides (long lane names, a legend beside the
    axes) back inside WIDTH: its axes narrow, its text keeps its size."""
    if saved_width(fig) > WIDTH + 2 * PAD + 0.01:
        fig.tight_layout()


def clear_suptitle(fig) -> None:
    """Move the axes down when the figure's title (grown by wrap_titles) reaches into them."""
    if fig._suptitle is None or not fig._suptitle.get_text():
        return
    renderer = fig.canvas.get_renderer()
    bottom = fig._suptitle.get_window_extent(renderer).y0 - 4
    if max(ax.get_tightbbox(renderer).y1 for ax in fig.axes) > bottom:
        fig.tight_layout(rect=(0, 0, 1, bottom / fig.bbox.height))


def finish(fig) -> None:
    """What every figure gets after its drawing (common.figures.render and save call it): its
    titles broken to fit, its labels pulled inside WIDTH (a wider image shrinks every label on
    GitHub), and each log axis left with matplotlib's 10^k ticks labelled as plain text."""
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log" and isinstance(axis.get_major_formatter(),
                                                        LogFormatterSciNotation):
                base = axis.get_transform().base
                axis.set_major_formatter(FuncFormatter(_power_label(base)))
                axis.set_minor_formatter(NullFormatter())
    drawn = wrap_titles(fig)
    fit(fig)
    wrap_titles(fig, drawn)
    clear_suptitle(fig)
    wrap_titles(fig, drawn)


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
                fontsize=fontsize or SMALL, color=color,
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
            ax.text((b.start + b.end) / 2, b.lane, b.label, ha="center", va="center", fontsize=SMALL)
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
                           for k in legend], loc="upper left", bbox_to_anchor=(1.0, 1.0))
