"""Chapter 05's figures of context parallelism, from tensor_parallel/context_parallel.py's own
layout functions and ring plan: which chunks each rank holds and which attention blocks it
computes (zig-zag against contiguous), and the ring's steps replayed in one process with the
code's merge (`ring_step`), so the partial softmax of every rank can be watched filling up."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from common.figures import Figure, Source, draw
from tensor_parallel.context_layout import (
    attention_work,
    block_pairs,
    rank_chunks,
    ring_exchanges,
    shard_sequence,
)
from tensor_parallel.context_parallel import ring_step

# --- the layouts -----------------------------------------------------------------------------------


def cp_layout_data(cp: int = 4, seq_len: int = 4096) -> dict:
    """For each layout: the chunks each rank holds, the (query chunk, key chunk) blocks each rank
    computes against every source's K/V ("full" or the causal diagonal; absent: skipped), and the
    causal work per rank (unmasked query-key pairs at seq_len)."""
    out = {}
    for layout in ("contiguous", "zigzag"):
        held = [list(rank_chunks(cp, r, layout)) for r in range(cp)]
        blocks = [[held[r][i], held[source][j], mode, r] for r in range(cp) for source in range(cp)
                  for i, j, mode in block_pairs(cp, r, source, layout)]
        out[layout] = {"chunks": sum(len(h) for h in held), "held": held, "blocks": blocks,
                       "work": [attention_work(seq_len, cp, r, layout) for r in range(cp)]}
    return {"cp": cp, "seq_len": seq_len, **out}


def cp_layout_draw(data: dict):
    cp = data["cp"]
    fig, axes = draw.figure(height=4.4, ncols=3, gridspec_kw={"width_ratios": [1, 1, 0.9]})
    for ax, layout in zip(axes.flat[:2], ("contiguous", "zigzag"), strict=True):
        d = data[layout]
        n = d["chunks"]
        draw.blank(ax, (-1.4, n + 0.1), (-1.5, n + 0.1))
        owner = {c: r for r, chunks in enumerate(d["held"]) for c in chunks}
        for c in range(n):  # the sequence, coloured by the rank holding each chunk
            draw.box(ax, c, -1.2, 1, 0.7, str(c), draw.rank_color(owner[c]), alpha=0.7, fontsize=draw.SMALL)
            draw.box(ax, -1.2, c, 0.7, 1, str(c), draw.rank_color(owner[c]), alpha=0.7, fontsize=draw.SMALL)
        for q, k, mode, r in d["blocks"]:
            colour = draw.rank_color(r)
            if mode == "full":
                draw.box(ax, k, q, 1, 1, "", colour, alpha=0.55, edge="#FFFFFF")
            else:  # the causal diagonal: the lower triangle of the block
                triangle = [(k, q), (k, q + 1), (k + 1, q + 1)]
                ax.add_patch(draw.plt.Polygon(triangle, facecolor=colour, alpha=0.55))
        ax.text(-0.3, -0.85, "keys", ha="right", va="center", fontsize=draw.SMALL)
        ax.text(-0.85, n + 0.05, "queries", ha="center", va="top", fontsize=draw.SMALL)
        ax.set_title(f"{layout}: {n} chunks", loc="left", fontsize=9, pad=2)
    ax = axes.flat[2]
    for k, layout in enumerate(("contiguous", "zigzag")):
        work = [w / 1e6 for w in data[layout]["work"]]
        ax.bar([r + 0.4 * k - 0.2 for r in range(cp)], work, width=0.38, label=layout,
               color=["#BBBBBB", "#0072B2"][k])
    ax.set_xticks(range(cp), [f"r{r}" for r in range(cp)])
    ax.set_ylabel(f"query-key pairs (millions), s = {data['seq_len']}")
    ax.legend(fontsize=draw.SMALL)
    ratio = {lay: max(data[lay]["work"]) / min(data[lay]["work"]) for lay in ("contiguous", "zigzag")}
    ax.set_title(f"work per rank: max/min\ncontiguous {ratio['contiguous']:.2f}, "
                 f"zig-zag {ratio['zigzag']:.2f}", loc="left", fontsize=9)
    fig.suptitle(f"Causal attention over cp = {cp} ranks: each block coloured by the rank that computes it\n"
                 "(blank: above the diagonal, skipped)", x=0.01, ha="left", fontweight="bold", fontsize=9.5)
    fig.tight_layout()
    return fig


def reversed_chunks(chunks: tuple[int, ...]) -> tuple[int, ...]:
    """A plausible bug: a rank's two chunks in the other order."""
    return tuple(reversed(chunks))


# --- the ring's steps with the online-softmax merge -----------------------------------------------


def ring_attention_data(cp: int = 4, chunk: int = 4, seed: int = 0) -> dict:
    """Replay the ring forward on cp ranks in one process (zig-zag, one head): each rank starts with
    its own K/V block; after each step the blocks move one rank right as `ring_exchanges` posts
    them; at each step a rank merges its block into (out, lse) with `ring_step`. Recorded per step
    and rank: the block it holds, the chunk pairs it computes, and for each of its query chunks
    the share of the final softmax mass merged so far (exp(lse_now - lse_end), averaged)."""
    gen = torch.Generator().manual_seed(seed)
    s, d = 2 * cp * chunk, 4
    q, k, v = (torch.randn(1, 1, s, d, generator=gen, dtype=torch.float64) for _ in range(3))
    posted = dict(ring_exchanges("forward", cp))
    qs = [shard_sequence(q, cp, r, dim=2) for r in range(cp)]
    blocks = [torch.stack([shard_sequence(x, cp, r, dim=2) for x in (k, v)]) for r in range(cp)]
    held = list(range(cp))  # whose K/V block each rank holds
    state = [(torch.zeros_like(x), torch.full(x.shape[:-1], -math.inf, dtype=q.dtype)) for x in qs]
    steps, lses = [], []
    for step in range(cp):
        row = []
        for r in range(cp):
            state[r] = ring_step(qs[r], *state[r], blocks[held[r]], cp, r, held[r])
            pairs = [[rank_chunks(cp, r)[i], rank_chunks(cp, held[r])[j], mode]
                     for i, j, mode in block_pairs(cp, r, held[r])]
            row.append({"holds": held[r], "pairs": pairs})
        lses.append([lse.clone() for _, lse in state])
        steps.append({"ranks": row, "sends": "kv" in posted.get(step, ())})
        if "kv" in posted.get(step, ()):  # every rank sends right, receives from the left
            held = [held[(r - 1) % cp] for r in range(cp)]
    for step, row in enumerate(steps):
        for r, cell in enumerate(row["ranks"]):
            share = torch.exp(lses[step][r] - lses[-1][r]).view(2, chunk).mean(1)
            cell["share"] = [round(x, 4) for x in share.tolist()]
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = torch.cat([shard_sequence(want, cp, r, dim=2) for r in range(cp)], 2)
    exact = all(torch.allclose(out, got[:, :, r * 2 * chunk:(r + 1) * 2 * chunk], rtol=0, atol=1e-12)
                for r, (out, _) in enumerate(state))
    return {"cp": cp, "chunk": chunk, "steps": steps, "exact": exact,
            "backward": [[step, list(what)] for step, what in ring_exchanges("backward", cp)]}


def ring_attention_draw(data: dict):
    cp, steps = data["cp"], data["steps"]
    fig, ax = draw.figure(height=0.95 * len(steps) + 1.3)
    cell = 3.0
    draw.blank(ax, (-1.6, cp * cell), (-0.7, len(steps) + 0.2))
    for r in range(cp):
        ax.text(r * cell + 1.3, -0.45, f"rank {r} (chunks {', '.join(map(str, rank_chunks_of(data, r)))})",
                ha="center", va="center", fontsize=draw.SMALL, color=draw.rank_color(r), fontweight="bold")
    for i, row in enumerate(steps):
        ax.text(-0.2, i + 0.4, f"step {i}", ha="right", va="center", fontsize=8)
        for r, c in enumerate(row["ranks"]):
            x = r * cell
            pairs = ", ".join(f"{q}·{k}{'◣' * (mode == 'causal')}" for q, k, mode in c["pairs"]) or "none"
            draw.box(ax, x, i, 0.9, 0.8, f"K/V\nof r{c['holds']}", draw.rank_color(c["holds"]), alpha=0.5,
                     fontsize=draw.SMALL)
            ax.text(x + 1.0, i + 0.12, f"blocks {pairs}", ha="left", va="center", fontsize=draw.SMALL)
            for j, share in enumerate(c["share"]):
                y = i + 0.38 + 0.22 * j
                ax.add_patch(draw.Rectangle((x + 1.0, y), 1.5, 0.16, facecolor="#FFFFFF", edgecolor="#999999",
                                            linewidth=0.5))
                ax.add_patch(draw.Rectangle((x + 1.0, y), 1.5 * share, 0.16, facecolor=draw.rank_color(r),
                                            alpha=0.7))
                ax.text(x + 2.55, y + 0.08, f"{share:.0%}", ha="left", va="center", fontsize=draw.SMALL)
        if row["sends"]:
            ax.text(cp * cell - 0.35, i + 0.9, "then each sends its K/V block right →", ha="right",
                    va="center", fontsize=draw.SMALL, color=draw.KIND_COLORS["comm"])
    ax.set_title(f"Ring attention forward, cp = {cp}, zig-zag: replayed with ring_exchanges and ring_step; "
                 f"equals one device: {'yes' if data['exact'] else 'NO'}\n"
                 "bars: the share of each of its query chunks' softmax merged so far, by the log-sum-exp "
                 "rule\nlse = log(e^lse₁ + e^lse₂), out = e^(lse₁−lse)·out₁ + e^(lse₂−lse)·out₂;  "
                 "q·k: query chunk · key chunk computed (◣ diagonal)", loc="left", fontsize=8.5)
    return fig


def rank_chunks_of(data: dict, r: int) -> list[int]:
    """The query chunks of rank r, from the first step's pairs (its own block: the diagonal)."""
    return sorted({q for q, _, _ in data["steps"][0]["ranks"][r]["pairs"]})


def lse_shifted(merged: tuple) -> tuple:
    """A plausible bug: the running log-sum-exp off by a constant (a missing scale or max)."""
    return merged[0], merged[1] - 1.0


def last_group_dropped(groups: list) -> list:
    """A plausible bug: the ring posts one transfer too few (a rank computes a stale block)."""
    return groups[:-1]


FIGURES = [
    Figure(name="cp_layout", path="05_tensor_parallel/figures/cp_layout.svg", data=cp_layout_data,
           draw=cp_layout_draw, sizes={"cp": 4, "seq_len": 4096},
           sources=(Source("tensor_parallel.context_layout:rank_chunks", perturb=reversed_chunks),
                    Source("tensor_parallel.context_layout:block_pairs", perturb=lambda pairs: pairs[:-1]),
                    Source("tensor_parallel.context_layout:attention_work", perturb=lambda w: w + 1)),
           alt="the causal attention blocks each rank computes, contiguous against zig-zag, and its work"),
    Figure(name="ring_attention_steps", path="05_tensor_parallel/figures/ring_attention_steps.svg",
           data=ring_attention_data, draw=ring_attention_draw, sizes={"cp": 4},
           sources=(Source("tensor_parallel.context_layout:ring_exchanges", perturb=last_group_dropped),
                    Source("tensor_parallel.context_parallel:ring_step", perturb=lse_shifted)),
           alt="the ring's steps: which K/V block each rank holds and how much of its softmax is merged"),
]
