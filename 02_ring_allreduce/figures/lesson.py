"""Chapter 02's figures: the ring's steps replayed from its own plan, its bytes against the naive
root's, the alpha-beta model's time with the crossover, and the P2P groups ring.py posts."""

from __future__ import annotations

import re
from dataclasses import replace

from matplotlib.patches import Rectangle

from common.figures import Figure, Source, draw
from common.kernel.p2p_plan import find_deadlock
from ring_allreduce import cost_model, plan
from ring_allreduce.naive import naive_bytes_sent
from ring_allreduce.ring import SEGMENT_BYTES, ring_traffic

KiB, MiB, GiB = 2**10, 2**20, 2**30


# ---------------------------------------------------------------------------------------------
# ring_steps: every step of the ring, replayed from ring_exchanges


def ring_steps_data(n: int = 4) -> dict:
    """Replay `plan.ring_exchanges` (what ring.py runs) on n ranks, one element per chunk: after
    each step, how many ranks' values each rank's copy of each chunk sums, what each rank sent to
    its right neighbour and what it received from its left one."""
    sizes = [1] * n
    held = [[{r} for _ in range(n)] for r in range(n)]  # rank r starts with its own value of every chunk
    exchanges = {(phase, r): plan.ring_exchanges(phase, r, sizes, 1)
                 for phase in ("reduce_scatter", "all_gather") for r in range(n)}
    steps = [{"label": "start", "phase": "start", "sent": [None] * n, "received": [None] * n,
              "held": [[1] * n for _ in range(n)]}]
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(n - 1):
            sent = [next(e.send.chunk for e in exchanges[phase, r] if e.step == step) for r in range(n)]
            received = [next(e.recv.chunk for e in exchanges[phase, r] if e.step == step) for r in range(n)]
            incoming = [(r, received[r], set(held[(r - 1) % n][sent[(r - 1) % n]])) for r in range(n)]
            for r, chunk, values in incoming:
                held[r][chunk] = held[r][chunk] | values if phase == "reduce_scatter" else values
            steps.append({"label": f"{phase.replace('_', '-')} {step + 1}/{n - 1}", "phase": phase,
                          "sent": sent, "received": received,
                          "held": [[len(s) for s in row] for row in held]})
    return {"n": n, "steps": steps}


def ring_steps_draw(data: dict):
    n, steps = data["n"], data["steps"]
    cell, gap, h = 1.0, 1.1, 0.72  # a chunk's square; the link between two ranks; a row's cells
    rank_w = n * cell + gap
    right = n * rank_w
    fig, ax = draw.figure(height=0.36 * len(steps) + 1.5)
    draw.blank(ax, (-4.6, right + 0.1), (-1.3, len(steps) + 0.2))
    fs = max(draw.SMALL, min(8.0, 30.0 / n))
    for r in range(n):
        x = r * rank_w
        ax.text(x + n * cell / 2, -1.0, f"rank {r}", ha="center", va="center",
                color=draw.rank_color(r), fontweight="bold")
        for c in range(n):
            name = f"c{c}" if n <= 5 else str(c)  # "c" + two digits overlap their cell past 5 ranks
            ax.text(x + c * cell + cell * 0.46, -0.35, name, ha="center", va="center", fontsize=fs,
                    color="#666666")
    for row, step in enumerate(steps):
        ax.text(-gap - 0.1, row + h / 2, step["label"], ha="right", va="center", fontsize=8)
        for r in range(n):
            for c in range(n):
                count = step["held"][r][c]
                updated = step["received"][r] == c
                draw.box(ax, r * rank_w + c * cell, row, cell * 0.92, h, "Σ" if count == n else str(count),
                         color=draw.rank_color(c), alpha=0.12 + 0.88 * count / n, fontsize=fs,
                         edge="#BBBBBB")
                if updated:  # a heavy outline: the copy this step changed
                    ax.add_patch(Rectangle((r * rank_w + c * cell, row), cell * 0.92, h, fill=False,
                                           edgecolor="#000000", linewidth=2.0))
            chunk = step["sent"][r]
            if chunk is None:
                continue
            xs = [r * rank_w + n * cell + gap / 2 - 0.04] + ([-gap / 2 - 0.04] if r == n - 1 else [])
            for x in xs:  # the link r → r+1 (the last one wraps round to rank 0's left)
                ax.annotate("", xy=(x + 0.42, row + h / 2), xytext=(x - 0.42, row + h / 2),
                            arrowprops={"arrowstyle": "-|>", "color": draw.rank_color(chunk), "lw": 1.6})
                ax.text(x, row + h / 2 - 0.2, f"c{chunk}", ha="center", va="bottom", fontsize=fs,
                        color=draw.rank_color(chunk), fontweight="bold")
    ax.set_title(f"Ring all-reduce on {n} ranks, step by step", loc="left")
    fig.text(0.01, 0.01, "Each row: every rank's copy of each chunk c after that step, with the number "
             "of ranks it sums (Σ: all n).\nArrow between two ranks: the chunk sent over that link during "
             "the step (rank n−1's link wraps to rank 0); outlined: the copy it updated.",
             fontsize=draw.SMALL, color="#333333", va="bottom")
    fig.subplots_adjust(left=0.01, right=0.99, top=0.92, bottom=0.1)
    return fig


def sending_what_arrives(exchanges: list) -> list:
    """A plausible bug for the test: each step sends the chunk it receives, not the one it summed."""
    return [replace(e, send=e.recv) for e in exchanges]


# ---------------------------------------------------------------------------------------------
# ring_bytes: bytes per rank and per link, ring against the naive root, as n grows


def ring_bytes_data(size_bytes: int = MiB, ns: tuple[int, ...] = (2, 3, 4, 8, 16, 32, 64)) -> dict:
    """Per n, in units of S: the most any rank sends in the ring (`ring_traffic`, float32 elements;
    every link carries what its sender sends), what the naive root sends (`naive_bytes_sent`) and
    what its link carries both ways, and what every other rank sends to it."""
    elements = size_bytes // 4
    rows = []
    for n in ns:
        ring = max(ring_traffic(elements, 4, r, n)[0] for r in range(n)) / size_bytes
        root = naive_bytes_sent(size_bytes, 0, n) / size_bytes
        rows.append({"n": n, "ring_per_rank": ring, "naive_root_sends": root,
                     "naive_root_link": 2 * root,  # it receives as much as it sends
                     "naive_other_sends": naive_bytes_sent(size_bytes, 1, n) / size_bytes})
    return {"size_bytes": size_bytes, "rows": rows}


def ring_bytes_draw(data: dict):
    rows = data["rows"]
    ns = [r["n"] for r in rows]
    fig, ax = draw.figure(height=3.4, width=7.5)
    ax.plot(ns, [r["naive_root_link"] for r in rows], "s-", color="#D55E00",
            label="naive: the root's link, (n−1)·S in + (n−1)·S out")
    ax.plot(ns, [r["naive_root_sends"] for r in rows], "s--", color="#D55E00", alpha=0.6,
            label="naive: the root sends (n−1)·S")
    ax.plot(ns, [r["ring_per_rank"] for r in rows], "o-", color="#0072B2", lw=2,
            label="ring: every rank sends, every link carries 2(n−1)/n·S")
    ax.plot(ns, [r["naive_other_sends"] for r in rows], ":", color="#999999",
            label="naive: each other rank sends S")
    ax.axhline(2, color="#0072B2", lw=0.8, alpha=0.4)
    ax.text(ns[-1], 2.15, "2·S: the ring never reaches it", ha="right", va="bottom", fontsize=draw.SMALL,
            color="#0072B2")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ticks = [2**k for k in range(0, 12) if 2**k <= 2 * max(r["naive_root_link"] for r in rows)]
    ax.set_yticks(ticks, [f"{t} S" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("ranks n")
    ax.set_ylabel("bytes per all-reduce / S")
    ax.set_title("One root is a bottleneck: its link's bytes grow like n, the ring's stay below 2·S",
                 loc="left")
    ax.legend(fontsize=draw.SMALL, loc="upper left")
    ax.grid(alpha=0.25, which="both")
    return fig


def ring_sends_one_phase(result: tuple[int, int]) -> tuple[int, int]:
    """A plausible bug: counting the reduce-scatter only."""
    return result[0] // 2, result[1]


# ---------------------------------------------------------------------------------------------
# alpha_beta: time against size, ring against naive root, with the crossover S* and S½


def alpha_beta_data(alpha_us: float = 10.0, bandwidth_gbs: float = 45.0, n: int = 8,
                    ns: tuple[int, ...] = (2, 4, 8, 64)) -> dict:
    """`cost_model.AlphaBeta.time` of the ring (ring.py's segments) and of the naive root, from
    1 KiB to 1 GiB, at a latency alpha and a bandwidth 1/beta (default: a 400 Gb/s InfiniBand
    link, ≈ 45 GB/s achieved, ~10 µs a message); the crossover `crossover_bytes` and the ring's
    `half_bandwidth_bytes`; and naive/ring per n in `ns`."""
    model = cost_model.AlphaBeta(alpha_us * 1e-6, 1 / (bandwidth_gbs * 1e9))
    sizes = [2**k for k in range(10, 31)]

    def times(k: int) -> dict:
        return {"ring": [model.time("ring", s, k, SEGMENT_BYTES) for s in sizes],
                "naive": [model.time("naive", s, k) for s in sizes]}

    per_n = {str(k): times(k) for k in ns}
    return {"alpha_us": alpha_us, "bandwidth_gbs": bandwidth_gbs, "n": n, "sizes": sizes,
            "time": times(n), "per_n": per_n,
            "crossover": {str(k): cost_model.crossover_bytes(model.alpha, model.beta, k) for k in (n, *ns)},
            "half": cost_model.half_bandwidth_bytes(model.alpha, model.beta, n)}


def _size_label(nbytes: float) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit:
            return f"{nbytes / unit:.3g} {name}"
    return f"{nbytes:.0f} B"


def alpha_beta_draw(data: dict):
    fig, (left, right) = draw.figure(height=3.6, ncols=2, nrows=1)
    sizes, n = data["sizes"], data["n"]
    left.plot(sizes, [t * 1e6 for t in data["time"]["ring"]], "-", color="#0072B2", lw=2, label="ring")
    left.plot(sizes, [t * 1e6 for t in data["time"]["naive"]], "-", color="#D55E00", lw=2,
              label="naive root")
    star, half = data["crossover"][str(n)], data["half"]
    left.axvline(star, color="#333333", ls="--", lw=0.8)
    at = left.get_xaxis_transform()  # x in bytes, y in axes fraction
    left.text(star * 1.15, 0.72, f"S* = {_size_label(star)}:\nnaive faster below", fontsize=draw.SMALL,
              va="top",
              transform=at)
    left.axvline(half, color="#0072B2", ls=":", lw=0.8)
    left.text(half * 1.15, 0.04, f"S½ = {_size_label(half)}:\nthe ring's two terms\nare equal",
              fontsize=draw.SMALL,
              color="#0072B2", va="bottom", transform=at)
    left.set(xscale="log", yscale="log", xlabel="all-reduce size S", ylabel="time (µs)")
    left.set_title(f"n = {n}: T = latencies·α + bytes·β", loc="left")
    left.legend(fontsize=draw.SMALL, loc="upper left")
    left.grid(alpha=0.25, which="major")
    for i, (k, t) in enumerate(data["per_n"].items()):
        ratio = [a / b for a, b in zip(t["naive"], t["ring"], strict=True)]
        right.plot(sizes, ratio, "-", color=draw.RANK_COLORS[i], lw=1.6, label=f"n = {k}")
    right.axhline(1, color="#333333", lw=0.8)
    right.set(xscale="log", yscale="log", xlabel="all-reduce size S", ylabel="naive time / ring time")
    right.set_title("naive / ring: below 1 the naive root wins", loc="left")
    ticks = [s for s in sizes if s in (KiB, 16 * KiB, 256 * KiB, 4 * MiB, 64 * MiB, GiB)]
    for ax in (left, right):
        ax.set_xticks(ticks, [_size_label(t).replace(".0", "") for t in ticks])
        ax.minorticks_off()
    right.legend(fontsize=draw.SMALL, loc="upper left")
    right.grid(alpha=0.25, which="major")
    fig.suptitle(f"The alpha-beta model: α = {data['alpha_us']:g} µs a message, 1/β = "
                 f"{data['bandwidth_gbs']:g} GB/s (cost_model.py)", x=0.01, ha="left", fontsize=10,
                 fontweight="bold")
    fig.tight_layout()
    return fig


def naive_waits_for_each_sender(terms: tuple[float, float]) -> tuple[float, float]:
    """A plausible bug, the model this chapter had: the root charged 2(n-1) latencies (n = 8)."""
    return 7 * terms[0], terms[1]


# ---------------------------------------------------------------------------------------------
# ring_plan: the P2P groups every rank posts, as ring_plan lays them out, replayed under NCCL's rules

PHASE_COLORS = {"call check": "#DDDDDD", "reduce-scatter": "#F5B48A", "all-gather": "#9CCFEA"}


def ring_plan_data(n: int = 3, length: int = 8, segment_elements: int = 2, check: bool = True) -> dict:
    """`plan.ring_plan` of one all-reduce of `length` float32 elements on n ranks with segments of
    `segment_elements` (uneven chunks, several segments a chunk), its call check first; and
    `find_deadlock`'s verdict on it under NCCL's rules."""
    groups = plan.ring_plan("all_reduce", plan.chunk_sizes(length, n), 4, 4 * segment_elements, check=check)
    deadlock = find_deadlock(groups)

    def op(kind: str, peer: int, nbytes: int, label: str) -> dict:
        m = re.search(r"chunk (\d+) \[(\d+):(\d+)\]", label)
        phase = next(p for p in PHASE_COLORS if label.startswith(p))
        what = f"c{m.group(1)}[{m.group(2)}:{m.group(3)}]" if m else "32 B"
        return {"kind": kind, "peer": peer, "what": what, "phase": phase}

    return {"n": n, "length": length, "chunks": plan.chunk_sizes(length, n), "segment": segment_elements,
            "groups": {str(r): [[op(*o) for o in g] for g in gs] for r, gs in groups.items()},
            "deadlock": None if deadlock is None else str(deadlock).splitlines()[0]}


def ring_plan_draw(data: dict):
    n, groups = data["n"], data["groups"]
    most = max(len(g) for g in groups.values())
    fig, ax = draw.figure(height=0.62 * n + 1.5)
    draw.blank(ax, (-1.3, most + 0.05), (-1.75, n))
    for r in range(n):
        ax.text(-0.15, r + 0.42, f"rank {r}", ha="right", va="center", color=draw.rank_color(r),
                fontweight="bold")
        for g, group in enumerate(groups[str(r)]):
            text = "\n".join(f"{'→' if o['kind'] == 'send' else '←'}{o['peer']} {o['what']}" for o in group)
            draw.box(ax, g + 0.04, r, 0.92, 0.84, text, color=PHASE_COLORS[group[0]["phase"]],
                     fontsize=draw.SMALL)
    verdict = "no deadlock" if data["deadlock"] is None else data["deadlock"]
    ax.text(-1.3, -1.45, f"n = {n}, {data['length']} elements in chunks {data['chunks']}, segments of "
            f"{data['segment']} elements · find_deadlock under NCCL's rules: {verdict}", fontsize=8,
            va="center")
    for i, (phase, color) in enumerate(PHASE_COLORS.items()):
        draw.box(ax, -1.3 + i * 2.2, -0.9, 0.3, 0.3, color=color)
        ax.text(-0.9 + i * 2.2, -0.75, phase, va="center", fontsize=8)
    ax.set_title("ring_plan: every rank's P2P groups of one all-reduce, in issue order", loc="left")
    fig.text(0.01, 0.01, "A box is one batch_isend_irecv group: →p sends to rank p, ←p receives from rank p; "
             "c1[0:2]: elements 0 and 1 of chunk 1 (one segment).", fontsize=draw.SMALL, color="#333333")
    fig.subplots_adjust(left=0.01, right=0.99, top=0.9, bottom=0.1)
    return fig


def ungrouped(groups: dict) -> dict:
    """A plausible bug: every send and receive posted as a group of its own (fine on gloo)."""
    return {r: [[o] for g in gs for o in g] for r, gs in groups.items()}


FIGURES = [
    Figure(name="ring_bytes", path="02_ring_allreduce/figures/ring_bytes.svg",
           data=ring_bytes_data, draw=ring_bytes_draw, sizes={"size_bytes": MiB},
           sources=(Source("ring_allreduce.ring:ring_traffic", perturb=ring_sends_one_phase),
                    Source("ring_allreduce.naive:naive_bytes_sent", perturb=lambda b: 2 * b)),
           alt="bytes per all-reduce against n: the naive root's link grows like n, the ring stays below 2S"),
    Figure(name="ring_steps", path="02_ring_allreduce/figures/ring_steps.svg",
           data=ring_steps_data, draw=ring_steps_draw, sizes={"n": 4},
           sources=(Source("ring_allreduce.plan:ring_exchanges", perturb=sending_what_arrives),),
           alt="the ring all-reduce's reduce-scatter and all-gather steps, replayed from ring_exchanges"),
    Figure(name="alpha_beta", path="02_ring_allreduce/figures/alpha_beta.svg",
           data=alpha_beta_data, draw=alpha_beta_draw, sizes={"alpha_us": 10.0, "bandwidth_gbs": 45.0},
           sources=(Source("ring_allreduce.cost_model:naive_terms", perturb=naive_waits_for_each_sender),
                    Source("ring_allreduce.cost_model:ring_terms", perturb=lambda t: (t[0], 2 * t[1])),
                    Source("ring_allreduce.cost_model:crossover_bytes", perturb=lambda s: 2 * s + 1)),
           alt="the alpha-beta model's all-reduce time against size, ring and naive root, with the "
               "crossover"),
    Figure(name="ring_plan", path="02_ring_allreduce/figures/ring_plan.svg",
           data=ring_plan_data, draw=ring_plan_draw, sizes={"n": 3},
           sources=(Source("ring_allreduce.plan:ring_plan", perturb=ungrouped),
                    Source("common.kernel.p2p_plan:find_deadlock", perturb=lambda d: "deadlock")),
           alt="every rank's P2P groups of one ring all-reduce, from ring_plan, checked by find_deadlock"),
]
