"""Chapter 05's figures of expert parallelism, from real routing: a seeded `tiny-moe` (float64)
runs forward in one process on each EP rank's own rows of a synthetic batch, and every MoE layer's
dispatcher records what `common.kernel.moe.route` decided and `permute` grouped (kept slots per expert).
From those counts: the tokens per expert per rank, the all-to-all send matrix and its bytes,
each layer's load (the rows each rank's experts process), and what a capacity drops.

The formulas drawn here are the chapter's (train_expert.py): per rank and MoE layer the
all-to-alls send 2(A + B)·dim·e bytes (A rows out, B rows in) plus the counts, and the load
imbalance of a step is the worst layer's max/mean rows over the EP ranks.
"""

from __future__ import annotations

import torch

from common.data import SyntheticTokens, split_inputs_targets
from common.figures import Figure, Source, draw
from common.kernel.model import build_model, get_config
from common.kernel.moe import LocalDispatcher, RoutingPlan, capacity, capacity_mask, moe_layers, permute


class _Recorder(LocalDispatcher):
    """The single-device dispatcher, keeping each dispatch's kept slots per expert and choices."""

    def __init__(self, log: list) -> None:
        self.log = log

    def dispatch(self, x: torch.Tensor, plan: RoutingPlan):
        rows, counts = permute(x, plan)
        self.log.append({"counts": counts, "experts": plan.experts.tolist(), "kept": plan.kept.tolist()})
        return rows, counts


def routed(ep: int = 4, batch: int = 8, seq_len: int = 32, seed: int = 0,
           capacity_factor: float | None = None, blocks: int | None = None) -> list[list[dict]]:
    """[rank][MoE layer] → {"counts": kept slots per expert, "experts", "kept": [N, k]}: each of ep
    ranks runs the model (its first `blocks` blocks; default all) on its batch/ep sequences (dp =
    ep, as train_expert.py's ranks do)."""
    cfg = get_config("tiny-moe", capacity_factor=capacity_factor)
    model = build_model(cfg, seed=seed, dtype=torch.float64)
    model.layers = model.layers[:blocks]
    tokens, _ = split_inputs_targets(SyntheticTokens(cfg.vocab_size, seq_len, seed).global_batch(0, batch))
    out = []
    for rank_rows in tokens.chunk(ep):
        log: list = []
        for layer in moe_layers(model):
            layer.dispatcher = _Recorder(log)
        with torch.no_grad():
            model(rank_rows)
        out.append(log)
    return out


def _send_matrix(counts: list[list[int]], ep: int) -> list[list[int]]:
    """send[src][dst]: rows rank src sends to rank dst (the slots of dst's E/ep experts)."""
    local = len(counts[0]) // ep
    return [[sum(c[dst * local:(dst + 1) * local]) for dst in range(ep)] for c in counts]


# --- one layer's dispatch and combine --------------------------------------------------------------


def moe_dispatch_data(ep: int = 4, layer: int = 0, batch: int = 8, seq_len: int = 32) -> dict:
    """Layer `layer` (of the MoE layers): kept slots per expert on each rank, the send matrix, and
    per rank A (rows out), B (rows in) and the all-to-all bytes at dim·e (float64)."""
    cfg = get_config("tiny-moe")
    first_dense = cfg.first_dense_layers
    counts = [rank[layer]["counts"] for rank in routed(ep, batch, seq_len, blocks=first_dense + layer + 1)]
    send = _send_matrix(counts, ep)
    out = [sum(send[r]) - send[r][r] for r in range(ep)]
    into = [sum(send[s][r] for s in range(ep)) - send[r][r] for r in range(ep)]
    e, E = 8, cfg.n_experts
    nbytes = [2 * (a + b) * cfg.dim * e + (ep - 1) / ep * E * 8 for a, b in zip(out, into, strict=True)]
    return {"ep": ep, "layer": layer, "experts": E, "top_k": cfg.top_k, "dim": cfg.dim,
            "tokens": batch // ep * seq_len, "counts": counts, "send": send, "A": out, "B": into,
            "bytes": nbytes}


def moe_dispatch_draw(data: dict):
    ep, E, counts, send = data["ep"], data["experts"], data["counts"], data["send"]
    local = E // ep
    fig, (a, b) = draw.figure(height=3.3, ncols=2, gridspec_kw={"width_ratios": [E + 1, ep + 4]})
    a.imshow(counts, cmap="Blues", aspect="auto")
    for r in range(ep):
        for e in range(E):
            a.text(e, r, counts[r][e], ha="center", va="center", fontsize=draw.SMALL)
    for q in range(1, ep):
        a.axvline(q * local - 0.5, color="#333333", lw=1)
    a.set_xticks(range(E), [f"e{e}\nr{e // local}" for e in range(E)], fontsize=draw.SMALL)
    a.set_yticks(range(ep), [f"rank {r}" for r in range(ep)], fontsize=draw.SMALL)
    a.set_title(f"routed slots per expert, from each rank's {data['tokens']} tokens\n"
                f"(top-{data['top_k']}; expert e lives on rank e // {local})", loc="left", fontsize=8.5)
    b.imshow(send, cmap="Oranges", aspect="auto")
    for s in range(ep):
        for d in range(ep):
            b.text(d, s, send[s][d], ha="center", va="center", fontsize=draw.SMALL,
                   fontweight="bold" if s != d else "normal", color="#000000" if s != d else "#777777")
        b.text(ep - 0.3, s, f"A {data['A'][s]} out, B {data['B'][s]} in\n{data['bytes'][s] / 1024:.1f} KiB",
               ha="left", va="center", fontsize=draw.SMALL)
    b.set_xlim(-0.5, ep + 2.5)
    b.set_xticks(range(ep), [f"→ r{d}" for d in range(ep)], fontsize=draw.SMALL)
    b.set_yticks(range(ep), [f"r{s} sends" for s in range(ep)], fontsize=draw.SMALL)
    b.spines[["left", "bottom"]].set_visible(False)
    b.set_title("dispatch all-to-all: rows per\n(sender, receiver); combine sends the\ntranspose back; "
                "diagonal: stays home", loc="left", fontsize=8.5)
    fig.suptitle(f"Expert parallelism, EP {ep}: one MoE layer of tiny-moe, real routing;\nbytes per rank "
                 f"(fwd + bwd) = 2(A+B)·{data['dim']}·8 + counts", x=0.01, ha="left", fontweight="bold",
                 fontsize=9.5)
    fig.tight_layout()
    return fig


def rolled_experts(result: tuple) -> tuple:
    """A plausible bug: every token routed one expert over (an off-by-one in the expert ids)."""
    plan, balance = result
    rolled = (plan.experts + 1) % plan.n_experts
    return RoutingPlan(rolled, plan.weights, plan.kept, plan.n_experts), balance


# --- the load over layers ---------------------------------------------------------------------------


def moe_load_data(ep: int = 4, batch: int = 8, seq_len: int = 32) -> dict:
    """Per MoE layer: the rows each rank's experts process (column sums of the send matrix), its
    max/mean; the step's imbalance (the worst layer's), and what summing rows over the layers first
    would report instead."""
    per_rank = routed(ep, batch, seq_len)
    rows = []
    for layer in range(len(per_rank[0])):
        send = _send_matrix([rank[layer]["counts"] for rank in per_rank], ep)
        rows.append([sum(send[s][d] for s in range(ep)) for d in range(ep)])
    ratio = [max(r) / (sum(r) / ep) for r in rows]
    totals = [sum(r[d] for r in rows) for d in range(ep)]
    return {"ep": ep, "rows": rows, "ratio": ratio, "imbalance": max(ratio),
            "summed": max(totals) / (sum(totals) / ep)}


def moe_load_draw(data: dict):
    ep, rows = data["ep"], data["rows"]
    fig, ax = draw.figure(height=3.2)
    width = 0.8 / ep
    for d in range(ep):
        ax.bar([i + (d - (ep - 1) / 2) * width for i in range(len(rows))], [r[d] for r in rows], width=width,
               color=draw.rank_color(d), label=f"rank {d}")
    for i, ratio in enumerate(data["ratio"]):
        ax.text(i, max(rows[i]) + 1, f"{ratio:.2f}", ha="center", va="bottom", fontsize=draw.SMALL,
                fontweight="bold" if ratio == data["imbalance"] else "normal")
    ax.set_xticks(range(len(rows)), [f"MoE layer {i}" for i in range(len(rows))], fontsize=draw.SMALL)
    ax.set_ylabel("rows its experts process")
    ax.set_ylim(0, max(max(r) for r in rows) * 1.2)
    ax.legend(fontsize=draw.SMALL, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"Load per EP rank, each MoE layer (EP {ep}; above: max/mean of that layer). Each "
                 f"all-to-all waits for its slowest rank:\nthe step's imbalance is the worst layer's, "
                 f"{data['imbalance']:.2f}; rows summed over the layers first would say {data['summed']:.2f}",
                 loc="left", fontsize=8.5)
    return fig


# --- capacity: which slots a capacity factor drops ---------------------------------------------------


def moe_capacity_data(capacity_factor: float = 1.0, batch: int = 8, seq_len: int = 32,
                      eps: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """The first MoE layer's choices (its input does not depend on earlier drops) at each EP
    size: the slots ours drops (C per sequence, from the model's own route) and the slots a
    capacity over the tokens a rank dispatches would drop (GShard's, Switch's, Megatron's C; the
    same capacity_mask on the rank's tokens as one group), per rank."""
    cfg = get_config("tiny-moe")
    E, k = cfg.n_experts, cfg.top_k
    first = cfg.first_dense_layers + 1  # the blocks up to the first MoE layer
    choices = torch.tensor(routed(1, batch, seq_len, blocks=first)[0][0]["experts"])  # dropless, every token
    out, dropped = [], []  # dropped: ours, every slot of the batch in order, per layout
    for ep in eps:
        ours = routed(ep, batch, seq_len, capacity_factor=capacity_factor, blocks=first)
        tokens = batch // ep * seq_len
        per_rank = capacity(capacity_factor, tokens, k, E)
        ours_drops, rank_drops = [], []
        dropped.append([not kept for r in range(ep) for slots in ours[r][0]["kept"] for kept in slots])
        for r in range(ep):
            ours_drops.append(tokens * k - sum(ours[r][0]["counts"]))
            kept = capacity_mask(choices[r * tokens:(r + 1) * tokens].view(1, tokens, k), E, per_rank)
            rank_drops.append(int((~kept).sum()))
        out.append({"ep": ep, "tokens": tokens, "per_rank_capacity": per_rank, "ours": ours_drops,
                    "per_rank": rank_drops})
    return {"capacity_factor": capacity_factor, "seq_len": seq_len, "batch": batch, "top_k": k,
            "experts": E, "ours_capacity": capacity(capacity_factor, seq_len, k, E), "layouts": out,
            "same_slots": all(d == dropped[0] for d in dropped)}


def moe_capacity_draw(data: dict):
    fig, ax = draw.figure(height=3.0)
    layouts = data["layouts"]
    total = data["batch"] * data["seq_len"] * data["top_k"]
    xs = range(len(layouts))
    ours = [sum(lay["ours"]) for lay in layouts]
    theirs = [sum(lay["per_rank"]) for lay in layouts]
    ax.bar([x - 0.2 for x in xs], ours, width=0.38, color="#0072B2",
           label=f"ours: C = ⌈cf·T·k/E⌉ = {data['ours_capacity']} per sequence (T = {data['seq_len']})")
    ax.bar([x + 0.2 for x in xs], theirs, width=0.38, color="#E69F00",
           label="per rank: C = ⌈cf·N·k/E⌉, N = the tokens a rank dispatches")
    for x, lay, a, b in zip(xs, layouts, ours, theirs, strict=True):
        ax.text(x - 0.2, a + 0.5, str(a), ha="center", fontsize=draw.SMALL)
        ax.text(x + 0.2, b + 0.5, f"{b}\n(C={lay['per_rank_capacity']})", ha="center", fontsize=draw.SMALL)
    ax.set_xticks(list(xs), [f"EP {lay['ep']}: N = {lay['tokens']}" for lay in layouts], fontsize=draw.SMALL)
    ax.set_ylabel(f"slots dropped (of {total})")
    ax.set_ylim(0, max(ours + theirs) * 1.35 + 1)
    ax.legend(fontsize=draw.SMALL, loc="upper right")
    ax.set_title(f"Capacity factor {data['capacity_factor']}, first MoE layer of tiny-moe, {data['batch']} × "
                 f"{data['seq_len']} tokens: ours drops the same slots on any layout "
                 f"({'checked' if data['same_slots'] else 'NOT SO'});\na per-rank capacity "
                 "(GShard, Switch, Megatron) drops a different number as the layout changes", loc="left",
                 fontsize=8.5)
    return fig


ROUTE = "common.kernel.moe:route"
FIGURES = [
    Figure(name="moe_dispatch", path="05_tensor_parallel/figures/moe_dispatch.svg", data=moe_dispatch_data,
           draw=moe_dispatch_draw, sizes={"ep": 4, "layer": 0},
           sources=(Source(ROUTE, perturb=rolled_experts),
                    Source("common.kernel.moe:permute", perturb=lambda r: (r[0], r[1][::-1]))),
           alt="slots per expert per rank and the all-to-all send matrix of one MoE layer (real routing)"),
    Figure(name="moe_load", path="05_tensor_parallel/figures/moe_load.svg", data=moe_load_data,
           draw=moe_load_draw, sizes={"ep": 4}, sources=(Source(ROUTE, perturb=rolled_experts),),
           alt="rows per EP rank in each MoE layer, each layer's max/mean and the step's worst"),
    Figure(name="moe_capacity", path="05_tensor_parallel/figures/moe_capacity.svg", data=moe_capacity_data,
           draw=moe_capacity_draw, sizes={"capacity_factor": 1.0},
           sources=(Source("common.kernel.moe:capacity", perturb=lambda c: c + 1),
                    Source("common.kernel.moe:capacity_mask", perturb=lambda kept: torch.ones_like(kept))),
           alt="slots a capacity factor drops: ours per sequence against a per-rank capacity, by EP size"),
]
