"""Timelines: when each action ran on each rank, drawn as text (one row per rank) or as a PNG,
and the bubble they show.

An `Interval` is one action on one rank with its start and end (seconds for a real run, unit
costs for the simulator). A real run's seconds come from the executor: the host clock on CPU,
CUDA events on the compute stream on a GPU (the host clock there would time kernel launches).
The measured bubble fraction of a step is 1 - Σ busy / (p · span),
span = first start to last end over all ranks; time a rank spends waiting for a neighbour's
activation or gradient counts as bubble, like the idle cells of the ideal timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any


@dataclass(frozen=True)
class Interval:
    rank: int
    action: Any  # schedules.Action
    start: Any  # float seconds, or a Fraction of unit costs
    end: Any


def measured_bubble(intervals: list[Interval], p: int | None = None) -> float:
    """1 - Σ busy / (p · span) over the intervals of one step."""
    p = p or 1 + max(i.rank for i in intervals)
    start, end = min(i.start for i in intervals), max(i.end for i in intervals)
    busy = sum(i.end - i.start for i in intervals)
    return float(1 - busy / (p * (end - start)))


def shift(intervals: list[Interval], origin: float) -> list[Interval]:
    return [Interval(i.rank, i.action, i.start - origin, i.end - origin) for i in intervals]


FILL = {"F": "-", "B": "=", "W": "~"}


def cell_label(action) -> str:
    """F3: forward of micro-batch 3 on chunk 0; f3 on chunk 1 (odd chunks in lowercase)."""
    kind = action.kind.lower() if getattr(action, "chunk", 0) % 2 else action.kind
    return f"{kind}{action.microbatch}"


def render_text(intervals: list[Interval], width: int | None = None, p: int | None = None,
                title: str | None = None) -> str:
    """One row per rank, time left to right: each action is its label (F3, B0, W2; lowercase on
    odd chunks) padded with its fill (- F, = B, ~ W); '.' is idle time. Exact unit-cost timelines
    (Fractions) get 2 columns per shortest action when `width` is None; measured ones `width`
    (default 96) columns."""
    p = p or 1 + max(i.rank for i in intervals)
    start, end = min(i.start for i in intervals), max(i.end for i in intervals)
    if width is None and all(isinstance(i.end - i.start, Fraction) for i in intervals):
        scale = 2 / min(i.end - i.start for i in intervals if i.end > i.start)
        width = round((end - start) * scale)
    else:
        width = width or 96
        scale = width / float(end - start)
    rows = [["."] * width for _ in range(p)]
    for i in sorted(intervals, key=lambda i: i.start):
        a, b = round(float((i.start - start) * scale)), round(float((i.end - start) * scale))
        b = max(b, a + 1)
        label = cell_label(i.action)
        fill = FILL.get(i.action.kind, "-")
        for k, col in enumerate(range(a, min(b, width))):
            rows[i.rank][col] = label[k] if k < len(label) and b - a >= len(label) else (
                label[0] if k == 0 else fill)
    lines = [title] if title else []
    lines += [f"rank {r} |{''.join(row)}|" for r, row in enumerate(rows)]
    span = f"{float(end - start):.4g}" + (" units" if isinstance(end - start, Fraction) else " s")
    lines.append(f"bubble {measured_bubble(intervals, p):.3f} · span {span}  (F forward, B backward, "
                 f"W weight grad, lowercase: odd chunk, . idle)")
    return "\n".join(lines)


COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
LEGEND = {"F": "F forward", "B": "B backward", "W": "W weight grad"}


def plot(intervals: list[Interval], ax, p: int | None = None, title: str = "") -> None:
    """Draw one timeline on a matplotlib axis: a bar per action (labelled with its micro-batch), one
    lane per rank (rank 0 on top), lighter shades for later chunks, a legend of the kinds drawn.
    The x axis is in seconds for a measured run, in time units (a stage's forward = 1) for unit costs."""
    from matplotlib.patches import Patch

    p = p or 1 + max(i.rank for i in intervals)
    origin = min(i.start for i in intervals)
    for i in intervals:
        chunk = getattr(i.action, "chunk", 0)
        ax.barh(i.rank, float(i.end - i.start), left=float(i.start - origin), height=0.8,
                color=COLORS.get(i.action.kind, "grey"), alpha=1.0 - 0.35 * min(chunk, 2),
                edgecolor="white", linewidth=0.5)
        if float(i.end - i.start) > 0:
            ax.text(float(i.start - origin + (i.end - i.start) / 2), i.rank, str(i.action.microbatch),
                    ha="center", va="center", fontsize=6, color="white")
    kinds = {i.action.kind for i in intervals}
    split = "W" in kinds
    handles = [Patch(color=COLORS[k], label="B input grad" if k == "B" and split else LEGEND[k])
               for k in "FBW" if k in kinds]
    if any(getattr(i.action, "chunk", 0) for i in intervals):
        handles.append(Patch(color=COLORS["F"], alpha=0.65, label="lighter: chunk 1"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    unit_costs = all(isinstance(i.end - i.start, Fraction) for i in intervals)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("time units (a whole stage's forward = 1)" if unit_costs else "s")
    ax.set_title(f"{title}  bubble {measured_bubble(intervals, p):.3f}", fontsize=9)


def save_png(timelines: dict[str, list[Interval]], path: str) -> None:
    """One panel per named timeline, stacked, into a PNG (matplotlib is imported here only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.2 + 0.9 * len(timelines) * 2),
                             squeeze=False)
    for ax, (name, intervals) in zip(axes[:, 0], timelines.items(), strict=True):
        plot(intervals, ax, title=name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
