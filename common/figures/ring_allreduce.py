"""Chapter 02's figures: the ring all-reduce, step by step, replayed from the ring's own plan."""

from __future__ import annotations

from dataclasses import replace

from ring_allreduce import plan

from . import draw
from .__init__ import Figure, Source


def ring_steps_data(n: int = 4) -> dict:
    """Replay `plan.ring_exchanges` (what ring.py runs) on n ranks, one element per chunk: after
    each step, how many ranks' values each rank's copy of each chunk sums, and what each sent."""
    sizes = [1] * n
    held = [[{r} for _ in range(n)] for r in range(n)]  # rank r starts with its own value of every chunk
    exchanges = {(phase, r): plan.ring_exchanges(phase, r, sizes, 1)
                 for phase in ("reduce_scatter", "all_gather") for r in range(n)}
    steps = [{"label": "start", "sent": [None] * n, "held": [[1] * n for _ in range(n)]}]
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(n - 1):
            sent = [next(e.send.chunk for e in exchanges[phase, r] if e.step == step) for r in range(n)]
            incoming = [(r, next(e.recv.chunk for e in exchanges[phase, r] if e.step == step),
                         set(held[(r - 1) % n][sent[(r - 1) % n]])) for r in range(n)]
            for r, chunk, values in incoming:
                held[r][chunk] = held[r][chunk] | values if phase == "reduce_scatter" else values
            steps.append({"label": f"{phase.replace('_', '-')} {step + 1}/{n - 1}", "sent": sent,
                          "held": [[len(s) for s in row] for row in held]})
    return {"n": n, "steps": steps}


def ring_steps_draw(data: dict):
    n, steps = data["n"], data["steps"]
    fig, ax = draw.figure(height=0.42 * len(steps) + 0.6)
    cell, gap = 1.0, 0.6  # a chunk's square; space between ranks
    rank_w = n * cell + gap
    draw.blank(ax, (-2.6, n * rank_w), (-1.0, len(steps)))
    for r in range(n):
        ax.text(r * rank_w + n * cell / 2, -0.6, f"rank {r}", ha="center", va="center",
                color=draw.rank_color(r), fontweight="bold")
    for row, step in enumerate(steps):
        ax.text(-0.3, row + 0.4, step["label"], ha="right", va="center", fontsize=8)
        for r in range(n):
            for c in range(n):
                count = step["held"][r][c]
                full = count == n
                draw.box(ax, r * rank_w + c * cell, row, cell * 0.92, 0.8,
                         f"{count}/{n}" if not full else "Σ", color=draw.rank_color(c),
                         alpha=0.15 + 0.85 * count / n, fontsize=6.5,
                         edge="#000000" if step["sent"][r] == c else "#BBBBBB")
            if step["sent"][r] is not None:
                x = r * rank_w + step["sent"][r] * cell + cell * 0.46
                ax.text(x, row + 0.93, "▲ sent →", ha="center", va="top", fontsize=5.5)
    ax.set_title(f"Ring all-reduce on {n} ranks: chunk c of every rank (colour), summed over k of the "
                 f"{n} ranks (k/{n}; Σ = all); outlined: the chunk sent to the right this step",
                 loc="left", fontsize=9)
    return fig


def sending_what_arrives(exchanges: list) -> list:
    """A plausible bug for the test: each step sends the chunk it receives, not the one it summed."""
    return [replace(e, send=e.recv) for e in exchanges]


FIGURES = [
    Figure(name="ring_steps", path="02_ring_allreduce/figures/ring_steps.svg",
           data=ring_steps_data, draw=ring_steps_draw, sizes={"n": 4},
           sources=(Source("ring_allreduce.plan:ring_exchanges", perturb=sending_what_arrives),),
           alt="the ring all-reduce's reduce-scatter and all-gather steps, replayed from ring_exchanges"),
]
