"""Chapter 05's figure of Ulysses context parallelism, replayed in one process with ulysses.py's own
packing (`to_heads`, `from_tokens`, `to_tokens`, `from_heads`): every element of q, k and v is
labelled by its head and global position, the all-to-all is "rank r receives block r of every
rank's send", and the figure reads back who holds which heads of which tokens at each stage."""

from __future__ import annotations

import torch

from common.figures import Figure, Source, draw
from tensor_parallel.context_layout import shard_sequence
from tensor_parallel.ulysses import from_heads, from_tokens, to_heads, to_tokens

STRIDE = 1000  # an element's value: head · STRIDE + global position


def _exchange(sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """An even all-to-all among len(sends) ranks in one process: rank r gets block r of each send."""
    return [torch.stack([send[r] for send in sends]) for r in range(len(sends))]


def _held(x: torch.Tensor, rank: int) -> list[list[int]]:
    """[rank, head, position] of every element of x [B, h, t, 1] (values head·STRIDE + position)."""
    values = x[0, :, :, 0].round().long()
    return sorted({(int(v) // STRIDE, int(v) % STRIDE, rank) for v in values.flatten()})


def ulysses_data(cp: int = 4, heads: int = 8, kv_heads: int = 2, seq_len: int = 16,
                 layout: str = "zigzag") -> dict:
    """Per stage, who holds what: "before" (q and k of the rank's s/cp tokens, every head),
    "after the first all-to-all" (H/cp query heads, the K heads they use, all s tokens),
    "after the second" (the output: every head of the rank's tokens again), as [head, position,
    rank] triples; the output is the gathered q itself (attention left out: this is data movement)."""
    def labelled(h: int) -> torch.Tensor:
        return (torch.arange(h)[:, None] * STRIDE + torch.arange(seq_len)).double()[None, :, :, None]

    q, k = labelled(heads), labelled(kv_heads)
    local = [[shard_sequence(x, cp, r, 2, layout) for x in (q, k)] for r in range(cp)]
    gathered = [from_tokens(t, layout) for t in _exchange([to_heads(lq, lk, lk, cp) for lq, lk in local])]
    hq = heads // cp
    hk = (gathered[0].shape[1] - hq) // 2  # the K heads a rank gathers (K/V repeated to cp if fewer)
    backs = [from_heads(t) for t in _exchange([to_tokens(g[:, :hq], cp, layout) for g in gathered])]
    return {"cp": cp, "heads": heads, "kv_heads": kv_heads, "seq_len": seq_len, "layout": layout,
            "before": {"q": [e for r, (lq, _) in enumerate(local) for e in _held(lq, r)],
                       "k": [e for r, (_, lk) in enumerate(local) for e in _held(lk, r)]},
            "after_first": {"q": [e for r, g in enumerate(gathered) for e in _held(g[:, :hq], r)],
                            "k": [e for r, g in enumerate(gathered) for e in _held(g[:, hq:hq + hk], r)]},
            "after_second": {"q": [e for r, b in enumerate(backs) for e in _held(b, r)]}}


def ulysses_draw(data: dict):
    s, heads, kv, cp = data["seq_len"], data["heads"], data["kv_heads"], data["cp"]
    stages = [("before: q, k, v [B, H, s/cp, d] — every head, s/cp tokens", data["before"]),
              ("after all-to-all 1: [B, H/cp, s, d] — H/cp heads, every token", data["after_first"]),
              ("after all-to-all 2: output [B, H, s/cp, d] — back to the tokens", data["after_second"])]
    fig, axes = draw.figure(height=2.0 + 0.19 * 3 * (heads + kv), nrows=3)
    for ax, (title, held) in zip(axes.flat, stages, strict=True):
        rows = [("q", h) for h in range(heads)] + [("k", h) for h in range(kv)] * ("k" in held)
        draw.blank(ax, (-2.2, s + 0.2), (-0.1, len(rows) + 0.1))
        cells: dict[tuple[str, int, int], list[int]] = {}
        for kind in held:
            for head, pos, rank in held[kind]:
                cells.setdefault((kind, head, pos), []).append(rank)
        for y, (kind, head) in enumerate(rows):
            ax.text(-0.2, y + 0.5, f"{'output' if kind == 'q' and 'k' not in held else kind} head {head}",
                    ha="right", va="center", fontsize=draw.SMALL)
            for pos in range(s):
                ranks = sorted(cells.get((kind, head, pos), []))
                for i, r in enumerate(ranks):  # a K/V head repeated to several ranks: one slice each
                    draw.box(ax, pos, y + i / len(ranks), 1, 1 / len(ranks), "", draw.rank_color(r),
                             edge="#FFFFFF", alpha=0.8)
        ax.set_title(title, loc="left", fontsize=8.5, pad=2)
    axes.flat[0].text(s + 0.2, -0.3, "token position →", ha="right", va="bottom", fontsize=draw.SMALL)
    handles = [draw.Rectangle((0, 0), 1, 1, color=draw.rank_color(r), alpha=0.8) for r in range(cp)]
    fig.legend(handles, [f"rank {r}" for r in range(cp)], loc="lower center", ncol=cp, fontsize=draw.SMALL)
    fig.suptitle(f"Ulysses, cp = {cp}, H = {heads}, H_kv = {kv} ({data['layout']} tokens): each cell "
                 "coloured by the rank holding it\n"
                 "(a K/V head repeated to several ranks: split cells; V moves as K)", x=0.01, ha="left",
                 fontweight="bold", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 0.94))
    return fig


FIGURES = [
    Figure(name="ulysses_all_to_all", path="05_tensor_parallel/figures/ulysses_all_to_all.svg",
           data=ulysses_data, draw=ulysses_draw, sizes={"cp": 4, "heads": 8, "kv_heads": 2, "seq_len": 16},
           sources=(Source("tensor_parallel.ulysses:to_heads", perturb=lambda send: send.flip(0)),
                    Source("tensor_parallel.ulysses:from_tokens", perturb=lambda whole: whole.roll(1, 1)),
                    Source("tensor_parallel.ulysses:to_tokens", perturb=lambda send: send.flip(0))),
           alt="who holds which heads of which tokens before and after each of Ulysses' two all-to-alls"),
]
