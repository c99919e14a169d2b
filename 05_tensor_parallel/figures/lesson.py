"""Chapter 05's figures of tensor and sequence parallelism, drawn from the plan the code applies.

Each reads `tensor_parallel.parallelize.plan_table` (what apply_tp_plan cuts, how, and which
collective sits at each boundary) on a meta-device model, or the chapter's closed forms; the
vocab figure also runs `vocab_parallel_cross_entropy`. No process group: single process, cheap.
"""

from __future__ import annotations

import math

import torch

from common.figures import Figure, Source, draw
from common.kernel.model import build_model, get_config
from tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tensor_parallel.formulas import Shape, layer_activation_terms
from tensor_parallel.parallelize import plan_table


def _table(model: str, t: int, sp: bool = False, **overrides) -> list[dict]:
    return plan_table(build_model(get_config(model, **overrides), device="meta"), t, sequence_parallel=sp)


def _block(rows: list[dict]) -> list[dict]:
    """The rows of block 0, named without the "layers.0." prefix."""
    return [{**r, "name": r["name"][len("layers.0."):]} for r in rows if r["name"].startswith("layers.0.")]


# --- the column / row split with f and g ----------------------------------------------------------


def tp_plan_data(model: str = "small", t: int = 4) -> dict:
    """One block's rows of the TP plan at t ranks: each weight's shape, split dim and pieces, and
    the collective at each boundary (f, g)."""
    return {"model": model, "t": t, "rows": _block(_table(model, t))}


def _pieces(shards: int, t: int) -> list[str]:
    """The label of each distinct piece: the ranks that hold it (t/shards consecutive ones)."""
    copies = t // shards
    return [f"r{i * copies}" + (f"-{(i + 1) * copies - 1}" if copies > 1 else "") for i in range(shards)]


def _matrix(ax, x: float, y: float, w: float, h: float, row: dict, t: int, kind: bool = False) -> None:
    """A weight [out, in] as a box split in its pieces: rows (dim 0) as stripes top to bottom,
    columns (dim 1) left to right, each coloured by the first rank holding it."""
    n, labels, copies = row["shards"], _pieces(row["shards"], t), t // row["shards"]
    for i in range(n):
        colour = draw.rank_color(i * copies)
        if row["dim"] == 0:
            draw.box(ax, x, y + i * h / n, w, h / n, labels[i], colour, alpha=0.55, fontsize=draw.SMALL)
        else:
            draw.box(ax, x + i * w / n, y, w / n, h, labels[i], colour, alpha=0.55, fontsize=draw.SMALL)
    out, inp = row["shape"]
    ax.text(x + w / 2, y - 0.08, f"{row['name'].split('.')[-1]} [{out}×{inp}]", ha="center", va="bottom",
            fontsize=draw.SMALL, fontweight="bold")
    if kind:
        ax.text(x + w / 2, y + h + 0.08, {0: "column-parallel", 1: "row-parallel"}[row["dim"]], ha="center",
                va="top", fontsize=draw.SMALL, color="#555555")


def _operator(ax, x: float, y: float, name: str) -> None:
    meaning = {"f": "identity fwd\nall-reduce bwd", "g": "all-reduce fwd\nidentity bwd"}[name]
    ax.add_patch(draw.plt.Circle((x, y), 0.3, facecolor=draw.KIND_COLORS["comm"], edgecolor="#333333"))
    ax.text(x, y, name, ha="center", va="center", fontsize=10, fontweight="bold")
    ax.text(x, y + 0.45, meaning, ha="center", va="top", fontsize=draw.SMALL)


def tp_plan_draw(data: dict):
    rows, t = {r["name"]: r for r in data["rows"]}, data["t"]
    fig, ax = draw.figure(height=5.0)
    draw.blank(ax, (-0.5, 14.8), (-0.2, 8.1))
    lanes = [("attention", ["wq", "wk", "wv"], "wo", "attention\n(its heads)", 0.0),
             ("feed_forward", ["w1", "w3"], "w2", "silu(w1 x)\n⊙ w3 x", 4.8)]
    for sub, columns, row_name, core, y0 in lanes:
        norm = "attention_norm" if sub == "attention" else "ffn_norm"
        mid = y0 + 0.65 * len(columns)
        ax.text(-0.3, mid, "x", ha="right", va="center", fontsize=10)
        draw.box(ax, 0.0, mid - 0.4, 1.4, 0.8, "RMSNorm\n(replicated)" if rows[norm]["dim"] is None else "",
                 "#EEEEEE", fontsize=draw.SMALL)
        draw.arrow(ax, (1.4, mid), (2.1, mid))
        _operator(ax, 2.4, mid, rows[sub]["comm"])
        for i, name in enumerate(columns):
            top = y0 + i * 1.3 + 0.3
            _matrix(ax, 3.8, top, 1.8, 0.75, rows[f"{sub}.{name}"], t)
            draw.arrow(ax, (2.7, mid), (3.8, top + 0.37))
            draw.arrow(ax, (5.6, top + 0.37), (6.6, mid))
        ax.text(4.7, y0 + 1.3 * len(columns) + 0.15, "column-parallel: rows split", ha="center", va="top",
                fontsize=draw.SMALL, color="#555555")
        draw.box(ax, 6.6, mid - 0.5, 1.6, 1.0, core, "#F7F7F7", fontsize=draw.SMALL)
        ax.text(8.65, mid - 0.15, "no comm", ha="center", va="bottom", fontsize=draw.SMALL)
        draw.arrow(ax, (8.2, mid), (9.1, mid))
        _matrix(ax, 9.1, mid - 0.8, 1.8, 1.6, rows[f"{sub}.{row_name}"], t, kind=True)
        ax.text(11.45, mid - 0.15, "partial\nsums", ha="center", va="bottom", fontsize=draw.SMALL)
        draw.arrow(ax, (10.9, mid), (11.95, mid))
        _operator(ax, 12.25, mid, rows[f"{sub}.{row_name}"]["comm"])
        draw.arrow(ax, (12.55, mid), (13.3, mid))
        ax.text(13.35, mid, "+ x\n(whole, on\nevery rank)", ha="left", va="center", fontsize=draw.SMALL)
    ax.set_title(f"One block of {data['model']} at TP {t}, cut by LLAMA_TP_PLAN (plan_table)\n"
                 "column-parallel weights keep rows of torch's [out, in], row-parallel ones columns;\n"
                 "f before, g after: one all-reduce per sub-layer forward, one backward", loc="left")
    return fig


def swapped_dims(rows: list[dict]) -> list[dict]:
    """A plausible bug: column and row confused in torch's [out, in] layout."""
    return [{**r, "dim": {0: 1, 1: 0}.get(r["dim"], r["dim"])} for r in rows]


# --- attention heads over the ranks ----------------------------------------------------------------


def tp_heads_data(model: str = "small", tps: tuple[int, ...] = (4, 8)) -> dict:
    """For each TP size: the query heads and K/V heads each rank holds (by the plan's pieces of wq
    and wk), and the K/V head each query head reads (GQA: head i reads K/V head i // (H / H_kv))."""
    cfg = get_config(model)
    panels = []
    for t in tps:
        rows = {r["name"]: r for r in _block(_table(model, t))}
        q, k = rows["attention.wq"], rows["attention.wk"]
        n_q, n_kv = q["shape"][0] // cfg.head_dim, k["shape"][0] // cfg.head_dim
        q_per, kv_per, copies = n_q // q["shards"], n_kv // k["shards"], t // k["shards"]
        ranks = [{"q": list(range(r * q_per, (r + 1) * q_per)),
                  "kv": list(range((r // copies) * kv_per, (r // copies + 1) * kv_per))} for r in range(t)]
        panels.append({"t": t, "n_q": n_q, "n_kv": n_kv, "kv_copies": copies, "ranks": ranks,
                       "reads": [i // (n_q // n_kv) for i in range(n_q)]})
    return {"model": model, "panels": panels}


def tp_heads_draw(data: dict):
    panels = data["panels"]
    fig, axes = draw.figure(height=2.0 * len(panels) + 0.5, nrows=len(panels))
    for ax, p in zip(axes.flat, panels, strict=True):
        t, n_q = p["t"], p["n_q"]
        width = n_q / t  # one rank's column
        draw.blank(ax, (-1.6, n_q + 0.1), (-0.6, 2.9))
        ax.text(-0.15, 0.65, "query\nheads", ha="right", va="center", fontsize=draw.SMALL)
        ax.text(-0.15, 2.25, "K/V\nheads", ha="right", va="center", fontsize=draw.SMALL)
        for r, held in enumerate(p["ranks"]):
            colour = draw.rank_color(r)
            ax.text((r + 0.5) * width, -0.3, f"rank {r}", ha="center", va="center", fontsize=draw.SMALL,
                    color=colour,
                    fontweight="bold")
            kv_w = width / len(held["kv"])
            for j, kv in enumerate(held["kv"]):
                draw.box(ax, r * width + j * kv_w + 0.05, 1.9, kv_w - 0.1, 0.7, f"kv{kv}", colour, alpha=0.6,
                         fontsize=draw.SMALL)
            for i in held["q"]:
                draw.box(ax, i + 0.05, 0.3, 0.9, 0.7, f"q{i}", colour, alpha=0.6, fontsize=draw.SMALL)
                if p["reads"][i] in held["kv"]:
                    j = held["kv"].index(p["reads"][i])
                    ax.plot([i + 0.5, r * width + (j + 0.5) * kv_w], [1.0, 1.9], color="#555555", lw=0.7)
        ok = all(p["reads"][i] in held["kv"] for held in p["ranks"] for i in held["q"])
        copies = p["kv_copies"]
        how = (f"{p['n_kv']} K/V heads < t: each replicated on {copies} ranks, its gradient summed over them"
               if copies > 1 else f"{p['n_kv']} K/V heads, {p['n_kv'] // t} per rank")
        ax.set_title(f"TP {t}: {n_q} query heads, {n_q // t} per rank; {how}\n"
                     f"each rank holds the K/V heads its queries read (lines): {'yes' if ok else 'NO'}",
                     loc="left", fontsize=8.5, fontweight="normal")
    fig.suptitle(f"Attention split by heads ({data['model']}, GQA): wq, wk, wv keep whole heads",
                 x=0.02, ha="left", fontweight="bold", fontsize=10)
    fig.tight_layout()
    return fig


def kv_never_replicated(rows: list[dict]) -> list[dict]:
    """A plausible bug: K/V cut into t pieces even when there are fewer heads than ranks."""
    t = max(r["shards"] for r in rows)
    return [{**r, "shards": t} if r["name"].endswith((".wk", ".wv")) else r for r in rows]


# --- the vocab-parallel cross-entropy --------------------------------------------------------------


def vocab_ce_data(vocab: int = 10, t: int = 4, tokens: int = 3, seed: int = 0) -> dict:
    """Each rank's slice of the logits (the head's pieces by the plan, padded to a multiple of t),
    the three numbers per token it contributes (its max; after the MAX all-reduce, its Σ exp and,
    on the target's owner, the target logit), and the loss the code computes from them."""
    rows = {r["name"]: r for r in _table("tiny", t, vocab_size=vocab)}
    head = rows["output"]
    width = math.ceil(head["shape"][0] / head["shards"])
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, vocab, generator=gen, dtype=torch.float64) * 2
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    padded = torch.cat([logits, logits.new_full((tokens, width * t - vocab), -math.inf)], 1)
    pieces = padded.split(width, 1)
    m = torch.stack([p.max(1).values for p in pieces], 1)  # [tokens, t]: the MAX all-reduce's inputs
    total = m.max(1, keepdim=True).values
    sums = torch.stack([(p - total).exp().sum(1) for p in pieces], 1)  # the SUM all-reduce's inputs
    loss = vocab_parallel_cross_entropy(logits, targets, None, 0, vocab)
    return {"vocab": vocab, "t": t, "width": width, "dim": head["dim"], "logits": padded.tolist(),
            "targets": targets.tolist(), "max": m.tolist(), "sumexp": sums.tolist(), "loss": loss.tolist()}


def vocab_ce_draw(data: dict):
    t, width, tokens = data["t"], data["width"], len(data["targets"])
    cols = t * width
    fig, ax = draw.figure(height=1.5 + 0.5 * tokens)
    rw, sw = 1.5, 1.75  # the widths of a per-rank column and of a summary column
    draw.blank(ax, (-1.4, cols + 0.6 + rw * t + sw * 4), (-1.1, tokens + 1.2))
    for r in range(t):
        colour = draw.rank_color(r)
        ax.text(r * width + width / 2, -0.5, f"rank {r}\nids {r * width}–{(r + 1) * width - 1}",
                ha="center", fontsize=draw.SMALL, color=colour, fontweight="bold")
        ax.text(cols + 0.6 + rw * (r + 0.5), -0.5, f"r{r}", ha="center", fontsize=draw.SMALL, color=colour,
                fontweight="bold")
    x = cols + 0.6 + rw * t
    for k, head in enumerate(("MAX\nm", "SUM\nΣ", "z_y − m", "loss\n(code)")):
        ax.text(x + sw * (k + 0.5), -0.5, head, ha="center", fontsize=draw.SMALL, fontweight="bold")
    for n, row in enumerate(data["logits"]):
        y = n + 0.45
        ax.text(-0.2, y, f"token {n}", ha="right", va="center", fontsize=draw.SMALL)
        for v, z in enumerate(row):
            pad = not math.isfinite(z)
            draw.box(ax, v, n, 0.95, 0.9, "−∞" if pad else f"{z:.1f}", draw.rank_color(v // width),
                     alpha=0.15 if pad else 0.45, hatch="//" if pad else None, fontsize=draw.SMALL,
                     edge="#000000" if v == data["targets"][n] else "#BBBBBB")
        for r in range(t):
            ax.text(cols + 0.6 + rw * (r + 0.5), y, f"{data['max'][n][r]:.1f}\n{data['sumexp'][n][r]:.2g}",
                    ha="center",
                    va="center", fontsize=draw.SMALL, color=draw.rank_color(r))
        m, total = max(data["max"][n]), sum(data["sumexp"][n])
        target = data["logits"][n][data["targets"][n]] - m
        for k, value in enumerate((f"{m:.1f}", f"{total:.3f}", f"{target:.2f}", f"{data['loss'][n]:.3f}")):
            ax.text(x + sw * (k + 0.5), y, value, ha="center", va="center", fontsize=draw.SMALL)
    ax.text(0, tokens + 0.2, f"Outlined: each token's target (its owner alone contributes z_y); hatched: "
            f"padding to {cols} = {t}·{width}, −∞. Per rank: its max m_r,\n"
            "then Σ exp(z − m) over its ids. "
            f"One all-reduce MAX, one SUM of [Σ, z_y]: 3 numbers per token, not {data['vocab']} logits. "
            "loss = log Σ − (z_y − m)", ha="left", va="top", fontsize=draw.SMALL)
    ax.set_title(f"Vocab-parallel cross-entropy, V = {data['vocab']} over TP {t}: the logits stay split",
                 loc="left")
    fig.subplots_adjust(left=0.08, right=0.99)
    return fig


# --- sequence parallelism: who holds which tokens ------------------------------------------------


def sp_regions_data(model: str = "small", t: int = 4) -> dict:
    """Through one block, without and with SP: after each step, whether a rank holds the whole
    sequence or its s/t tokens, and the whole width h or its 1/t slice (column outputs, row partial
    sums), following the collectives plan_table names at each boundary."""
    out = {}
    for sp in (False, True):
        rows = {r["name"]: r for r in _block(_table(model, t, sp))}
        tokens = "s/t" if sp else "s"  # the block's input: SP's embedding reduce-scattered it
        steps = []
        for sub, norm, col, row in (("attention", "attention_norm", "wq", "wo"),
                                    ("feed_forward", "ffn_norm", "w1", "w2")):
            steps.append({"label": "RMSNorm", "tokens": tokens, "width": "h", "comm": rows[norm]["comm"]})
            before = rows[sub]["comm"]
            tokens = "s" if before in ("all-gather", "f") else tokens
            split = "h/t" if rows[f"{sub}.{col}"]["dim"] == 0 else "h"
            steps.append({"label": f"{sub.replace('_', ' ')}\n(column → row)", "tokens": tokens,
                          "width": split, "comm": before})
            after = rows[f"{sub}.{row}"]["comm"]
            tokens = "s/t" if after == "reduce-scatter" else tokens
            steps.append({"label": "+ residual", "tokens": tokens, "width": "h", "comm": after})
        out["sp" if sp else "tp"] = steps
    return {"model": model, "t": t, **out}


def sp_regions_draw(data: dict):
    t = data["t"]
    fig, axes = draw.figure(height=2.1 + 0.5 * t, nrows=2)
    titles = ("TP only: the norms and residuals hold the whole sequence on every rank (t copies)",
              "TP + SP: they hold s/t tokens per rank; all-gather before the column layers, reduce-scatter "
              "after the row ones")
    for ax, key, title in zip(axes.flat, ("tp", "sp"), titles, strict=True):
        steps = data[key]
        draw.blank(ax, (-1.2, 3.0 * len(steps)), (-1.5, t + 0.1))
        for i, step in enumerate(steps):
            x0 = i * 3.0
            label = step["label"] + ("\n(weight grad summed)" if step["comm"] == "grad all-reduce" else "")
            ax.text(x0 + 1.0, -0.95, label, ha="center", va="center", fontsize=draw.SMALL)
            if step["comm"] and step["comm"] != "grad all-reduce":
                ax.text(x0 - 0.5, -0.3, step["comm"], ha="center", va="center", fontsize=draw.SMALL,
                        rotation=0,
                        color=draw.KIND_COLORS["reduce"], fontweight="bold")
            for r in range(t):
                ax.text(-0.2, r + 0.4, f"r{r}", ha="right", va="center", fontsize=draw.SMALL,
                        color=draw.rank_color(r))
                own = step["width"] == "h/t" or step["tokens"] == "s/t"  # different on every rank
                for c in range(t):  # the sequence in t blocks of s/t tokens
                    held = step["tokens"] == "s" or c == r
                    colour = (draw.rank_color(r) if own else "#888888") if held else "#FFFFFF"
                    draw.box(ax, x0 + c * 2.0 / t, r, 2.0 / t * 0.95, 0.8, "", colour,
                             alpha=0.6 if held else 1.0, edge="#BBBBBB")
                if step["width"] == "h/t":
                    ax.text(x0 + 1.0, r + 0.4, "h/t", ha="center", va="center", fontsize=draw.SMALL)
        ax.set_title(title, loc="left", fontsize=8.5)
    fig.suptitle(f"Sequence parallelism ({data['model']}, t = {t}): what each rank holds through one block\n"
                 "a bar = the sequence in t blocks of s/t tokens; grey: the same copy on every rank; colour: "
                 "this rank's own", x=0.02, ha="left", fontweight="bold", fontsize=9.5)
    fig.tight_layout()
    return fig


def gather_forgotten(rows: list[dict]) -> list[dict]:
    """A plausible bug: SP's column layers fed by f instead of the all-gather."""
    return [{**r, "comm": "f" if r["comm"] == "all-gather" else r["comm"]} for r in rows]


# --- sequence parallelism: the activation memory ---------------------------------------------------


def sp_memory_data(model: str = "llama2-7b", s: int = 4096, b: int = 1, e: int = 2,
                   tps: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    """Bytes one block saves for backward per rank, by term (formulas.layer_activation_terms), in
    units of s·b·h·e, for each t, without and with SP."""
    c = get_config(model)
    bars = []
    for t in tps:
        for sp in (False, True):
            x = Shape(b, s, c.dim, c.n_heads, c.n_kv_heads, c.hidden_dim, c.n_layers, c.vocab_size,
                      c.head_dim, t, sp, e)
            terms = layer_activation_terms(x)
            bars.append({"t": t, "sp": sp, "terms": {k: v / (s * b * c.dim * e) for k, v in terms.items()}})
    return {"model": model, "s": s, "b": b, "e": e, "bars": bars}


def sp_memory_draw(data: dict):
    fig, ax = draw.figure(height=3.6)
    names = list(data["bars"][0]["terms"])
    colours = ["#0072B2", "#56B4E9", "#999999", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#F0E442"]
    xs = []
    for i, bar in enumerate(data["bars"]):
        x = i + (i // 2) * 0.6
        xs.append(x)
        bottom = 0.0
        for k, name in enumerate(names):
            v = bar["terms"][name]
            ax.bar(x, v, bottom=bottom, color=colours[k % len(colours)], edgecolor="white", linewidth=0.5,
                   label=name if i == 0 else None)
            bottom += v
        ax.text(x, bottom + 0.2, f"{bottom:.1f}", ha="center", fontsize=draw.SMALL)
    ax.set_xticks(xs, [f"t={b['t']}\n{'SP' if b['sp'] else 'TP'}" for b in data["bars"]], fontsize=draw.SMALL)
    ax.set_ylabel("saved bytes / (s·b·h·e), one block, one rank")
    ax.legend(reversed(ax.get_legend_handles_labels()[0]), reversed(names), fontsize=draw.SMALL,
              loc="upper left",
              bbox_to_anchor=(1.0, 1.0), title="term (formulas.layer_activation_terms)",
              title_fontsize=draw.SMALL)
    fig.subplots_adjust(right=0.6)
    ax.set_title(f"Activations one block saves per rank ({data['model']}, s = {data['s']}, b = {data['b']}, "
                 f"e = {data['e']})\nTP divides the column/row tensors by t; SP also the norm regions",
                 loc="left")
    return fig


def first_term_doubled(terms: dict) -> dict:
    """A plausible bug: one term counted twice."""
    first = next(iter(terms))
    return {**terms, first: 2 * terms[first]}


def plus_one(loss: torch.Tensor) -> torch.Tensor:
    """A plausible bug: the loss off by a constant (log Σ taken before the max was subtracted)."""
    return loss + 1


PLAN = "tensor_parallel.parallelize:plan_table"
FIGURES = [
    Figure(name="tp_plan", path="05_tensor_parallel/figures/tp_plan.svg", data=tp_plan_data,
           draw=tp_plan_draw, sizes={"model": "small", "t": 4}, sources=(Source(PLAN, perturb=swapped_dims),),
           alt="one block's column- and row-parallel weights with f and g, from the TP plan"),
    Figure(name="tp_heads", path="05_tensor_parallel/figures/tp_heads.svg", data=tp_heads_data,
           draw=tp_heads_draw, sizes={"model": "small", "tps": (4, 8)},
           sources=(Source(PLAN, perturb=kv_never_replicated),),
           alt="query and K/V heads per rank, K/V heads replicated when fewer than ranks"),
    Figure(name="vocab_parallel_ce", path="05_tensor_parallel/figures/vocab_parallel_ce.svg",
           data=vocab_ce_data, draw=vocab_ce_draw, sizes={"vocab": 10, "t": 4},
           sources=(Source(PLAN, perturb=swapped_dims),
                    Source("tensor_parallel.cross_entropy:vocab_parallel_cross_entropy", perturb=plus_one)),
           alt="the logits split by vocab over the ranks, and the three numbers per token they exchange"),
    Figure(name="sp_regions", path="05_tensor_parallel/figures/sp_regions.svg", data=sp_regions_data,
           draw=sp_regions_draw, sizes={"model": "small", "t": 4},
           sources=(Source(PLAN, perturb=gather_forgotten),),
           alt="the tokens each rank holds through one block, without and with sequence parallelism"),
    Figure(name="sp_memory", path="05_tensor_parallel/figures/sp_memory.svg", data=sp_memory_data,
           draw=sp_memory_draw, sizes={"model": "llama2-7b", "s": 4096},
           sources=(Source("tensor_parallel.formulas:layer_activation_terms", perturb=first_term_doubled),),
           alt="activation bytes one block saves per rank, by term, against t, with and without SP"),
]
