"""Chapter 07's figures: the mesh's groups, one rank's 3D step, and recomputation's trade.

The mesh is `common.kernel.mesh.group_ranks` (the lines `build_mesh` makes groups of) placed by
`coordinates`; one 3D step composes the pipeline's action list (06: `make_schedule`, `simulate`,
`p2p.exchanges`) with what runs inside each action: TP's collectives per block (05:
`block_comm_bytes`, counted in collectives), context parallelism's ring steps (05:
`ring_exchanges`) and FSDP's gathers over the schedule (07: `comm_formulas.fsdp_gathers`, the
trainer's own count). Recomputation is measured on a seeded small model (the saved-tensor ledger
and torch's FLOP counter, in this process) beside `memory_model.layer_activation_bytes` and the
planner's compute overhead at LLaMA-2 70B's size. Single process: no process group is created.
"""

from __future__ import annotations

import math

import torch

from common.figures import Figure, Source, draw
from common.kernel.mesh import MeshShape, coordinates, group_ranks
from common.kernel.model import CONFIGS, LlamaConfig, build_model, loss_fn
from common.memory import ActivationMeter
from parallel3d import memory_model
from parallel3d.comm_formulas import fsdp_gathers
from parallel3d.memory_model import head_activation_bytes, layer_activation_bytes
from parallel3d.planner.pricing import recompute_fraction
from parallel3d.recompute import apply_recompute
from pipeline import p2p
from pipeline.schedules import gpipe, make_schedule
from pipeline.simulator import simulate
from pipeline.stage import layer_partition
from tensor_parallel.context_layout import ring_exchanges
from tensor_parallel.formulas import Shape, block_comm_bytes

DIM_COLORS = {"tp": "#0072B2", "cp": "#CC79A7", "dp": "#009E73", "dp_cp": "#009E73", "pp": "#D55E00"}
DIM_TEXT = {"tp": "TP: all-reduce in every block (NVLink, inside a node)",
            "cp": "CP: K/V blocks round a ring, every attention",
            "dp": "DP: FSDP's all-gather / reduce-scatter per unit",
            "dp_cp": "DP × CP: FSDP shards over these (same parameters)",
            "pp": "PP: send/recv of activations between stages"}


# --- the mesh -----------------------------------------------------------------------------------

def mesh_data(dp: int = 2, pp: int = 2, tp: int = 2, cp: int = 1) -> dict:
    """Every rank's coordinates and every line of every dimension (the groups build_mesh makes)."""
    shape = MeshShape(pp=pp, dp_shard=dp, cp=cp, tp=tp)
    lines = group_ranks(shape)
    dims = ["tp", *(["cp"] if cp > 1 else []), "dp", *(["dp_cp"] if cp > 1 and dp > 1 else []), "pp"]
    at = [coordinates(r, shape) for r in range(shape.world)]
    return {"sizes": {"dp": dp, "pp": pp, "cp": cp, "tp": tp},
            "coords": [[a.dp, a.pp, a.cp, a.tp] for a in at],
            "lines": {d: lines[d] for d in dims}}


def mesh_draw(data: dict):
    sizes, coords, lines = data["sizes"], data["coords"], data["lines"]
    dp, pp, cp, tp = sizes["dp"], sizes["pp"], sizes["cp"], sizes["tp"]
    cols = dp * cp * tp
    n = len(lines)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    w_cell = 1.0
    gap = 0.35  # between DP (and CP) blocks of a row
    fig, axes = draw.figure(height=nrows * (0.55 * pp + 1.25) + 0.4, ncols=ncols, nrows=nrows)
    axes = axes.ravel() if hasattr(axes, "ravel") else [axes]

    def xy(rank: int) -> tuple[float, float]:
        d, p, c, t = coords[rank]
        return ((d * cp + c) * tp + t) * w_cell + (d * cp + c) * gap, p * 1.0

    width = cols * w_cell + (dp * cp - 1) * gap
    for ax, (dim, groups) in zip(axes, lines.items(), strict=False):
        draw.blank(ax, (-1.2, width + 0.1), (-0.9, pp + 0.1))
        member = {r: k for k, g in enumerate(groups) for r in g}
        for r in range(len(coords)):
            x, y = xy(r)
            k = member[r]
            draw.box(ax, x, y, w_cell * 0.88, 0.8, str(r), color=draw.RANK_COLORS[k % len(draw.RANK_COLORS)],
                     alpha=0.85, fontsize=8, textcolor="#000000")
        for p in range(pp):
            ax.text(-0.15, p + 0.4, f"pp {p}", ha="right", va="center", fontsize=draw.SMALL)
        for d in range(dp):
            for c in range(cp):
                x = ((d * cp + c) * tp) * w_cell + (d * cp + c) * gap
                ax.text(x + tp * w_cell / 2 - 0.06, -0.25, f"dp {d}" + (f" cp {c}" if cp > 1 else ""),
                        ha="center", va="center", fontsize=draw.SMALL)
        shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups[:4])
        shown += " …" if len(groups) > 4 else ""
        ax.set_title(f"{dim.upper().replace('_', ' × ')}: {len(groups)} groups of {len(groups[0])}\n{shown}",
                     fontsize=8.5, loc="left", color=DIM_COLORS[dim])
        ax.text(-1.1, pp + 0.15, DIM_TEXT[dim], fontsize=draw.SMALL, va="top", color="#333333")
    for ax in axes[n:]:
        ax.set_axis_off()
    mesh = " × ".join(f"{k} {sizes[k]}" for k in ("pp", "dp", "cp", "tp") if k != "cp" or cp > 1)
    formula = ("((pp_r·dp + dp_r)·cp + cp_r)·tp + tp_r" if cp > 1 else "(pp_r·dp + dp_r)·tp + tp_r")
    fig.suptitle(f"The mesh, world {len(coords)} = {mesh}: rank = {formula}; one colour per group",
                 x=0.01, ha="left", fontsize=10, fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


# --- one rank's 3D step -------------------------------------------------------------------------

def tp_collectives_per_block(cfg: LlamaConfig, tp: int, b: int, s: int, e: int) -> int:
    """All-reduces one block's forward + backward runs (chapter 05's bytes, in collectives of
    one activation [b, s, h] each: 2(t−1)/t·b·s·h·e)."""
    if tp == 1:
        return 0
    x = Shape(b=b, s=s, h=cfg.dim, a=cfg.n_heads, kv=cfg.n_kv_heads, F=cfg.hidden_dim, L=1,
              V=cfg.vocab_size, head_dim=cfg.head_dim, t=tp, sequence_parallel=False, e=e)
    return round(block_comm_bytes(x).get("all_reduce", 0.0) / (2 * (tp - 1) / tp * b * s * cfg.dim * e))


def step_data(dp: int = 2, pp: int = 2, tp: int = 2, cp: int = 1, rank: int = 0,
              schedule: str = "1f1b", m: int = 4, model: str = "tiny") -> dict:
    """What global rank `rank` does in one step: its pipeline actions (simulated times) and,
    inside each, in order, the collectives it joins and with which ranks (FULL_SHARD, no SP)."""
    cfg = CONFIGS[model]
    shape = MeshShape(pp=pp, dp_shard=dp, cp=cp, tp=tp)
    at = coordinates(rank, shape)
    lines = group_ranks(shape)
    peers = {d: next(g for g in lines[d] if rank in g) for d in ("tp", "cp", "dp_cp", "pp")}
    sched = make_schedule(schedule, pp, m, 2 if schedule == "interleaved" else 1)
    intervals = simulate(sched)
    stages = layer_partition(cfg.n_layers, sched.n_stages)
    per_block = tp_collectives_per_block(cfg, tp, 1, 16, 2)
    ring_f = len(ring_exchanges("forward", cp)) if cp > 1 else 0
    ring_b = len(ring_exchanges("backward", cp)) if cp > 1 else 0
    me = at.pp
    actions = sched.actions[me]
    segs = p2p.segments(sched, me)
    groups = p2p.exchanges(sched, me)
    group_before = {seg[0]: groups[k] for k, seg in enumerate(segs)}
    pp_peer = {r_in_pp: peers["pp"][r_in_pp] for r_in_pp in range(pp)}
    out = []
    for i, a in enumerate(actions):
        stage = sched.stage(me, a.chunk)
        blocks = list(stages[stage])
        mine = [x for x in actions[:i + 1] if x.chunk == a.chunk]
        before = [x for x in actions[:i] if x.chunk == a.chunk]
        # which action's backward call gathers, and which end with one (comm_bytes_per_step's rule)
        backward = "W" if sched.split_backward and stage == 0 else "B"
        ends = (("W",) if stage == 0 else ("B", "W")) if sched.split_backward else ("B",)
        gathered, root_gathered = (fsdp_gathers(mine, root, True, backward, ends)
                                   - fsdp_gathers(before, root, True, backward, ends)
                                   for root in (False, True))
        root = ["embed"] * (stage == 0) + ["head"] * (stage == sched.n_stages - 1)
        ops: list[list] = []  # [dimension, what, detail], in the order the rank runs them
        if a in group_before:
            ops += [["pp", "recv", f"{m_.kind} {m_.microbatch} ← {pp_peer[m_.src]}"]
                    for m_ in group_before[a].recvs]
        if root:  # the root unit (embedding; final norm + head) stays gathered
            ops += [["dp", "all-gather", "root"]] * root_gathered
        if "embed" in root and a.kind == "F":
            ops.append(["compute", "embed", ""])
        if "head" in root and a.kind == "B":
            ops.append(["compute", "head", "+ loss"])
        order = blocks if a.kind == "F" else blocks[::-1]
        half = per_block // 2  # forward: the g's after wo and w2; backward: the f's before wq/wk/wv, w1/w3
        for blk in order:
            ops += [["dp", "all-gather", f"block {blk}"]] * gathered
            if a.kind == "W":  # zero bubble's weight gradient: no activation collective
                ops.append(["compute", "dW", str(blk)])
            for part in () if a.kind == "W" else ("attn", "mlp") if a.kind == "F" else ("mlp", "attn"):
                ops.append(["compute", part, str(blk)])
                if part == "attn" and cp > 1:
                    ops.append(["cp", "ring", f"×{ring_f if a.kind == 'F' else ring_b}"])
                ops += [["tp", "all-reduce", ""]] * (half - half // 2 if part == "attn" else half // 2)
            if a.kind == ("W" if sched.split_backward else "B"):  # FSDP reduces after each backward
                ops.append(["dp", "reduce-scatter", f"block {blk}"])
        if "head" in root and a.kind == "F":
            ops.append(["compute", "head", "+ loss"])
        if "embed" in root and a.kind != "F":
            ops.append(["compute", "embed", ""])
        if root and a.kind == ("W" if sched.split_backward else "B"):
            ops.append(["dp", "reduce-scatter", "root"])
        sends = (group_before[actions[i + 1]].sends if i + 1 < len(actions) and actions[i + 1] in group_before
                 else groups[-1].sends if i + 1 == len(actions) else ())
        ops += [["pp", "send", f"{m_.kind} {m_.microbatch} → {pp_peer[m_.dst]}"] for m_ in sends]
        iv = next(x for x in intervals if x.rank == me and x.action == a)
        out.append({"kind": a.kind, "mb": a.microbatch, "chunk": a.chunk, "stage": stage,
                    "start": float(iv.start), "end": float(iv.end), "ops": ops})
    totals: dict[str, int] = {}
    for a in out:
        for dim, what, _ in a["ops"]:
            if dim != "compute":
                totals[f"{dim} {what}"] = totals.get(f"{dim} {what}", 0) + 1
    return {"sizes": {"dp": dp, "pp": pp, "cp": cp, "tp": tp}, "rank": rank,
            "coords": [at.dp, at.pp, at.cp, at.tp], "peers": peers, "schedule": schedule, "m": m,
            "model": model, "actions": out, "totals": totals}


OP_COLORS = {"compute": "#EEEEEE", **DIM_COLORS}
SHORT = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "ring": "K/V ring"}


def chip(op: list) -> str:
    dim, what, detail = op
    if dim == "compute":
        return f"{what} {detail}"
    if dim == "pp":
        return f"{what} {detail}"
    return f"{SHORT[what]} {detail.replace('block ', '')}".strip()


def step_draw(data: dict):
    acts, peers, sizes = data["actions"], data["peers"], data["sizes"]
    dims = [d for d in ("tp", "cp", "dp_cp", "pp") if len(peers[d]) > 1]
    zoom = [next(a for a in acts if a["kind"] == "F"), next(a for a in acts if a["kind"] != "F")]
    per_row = 9
    rows = sum(math.ceil(len(a["ops"]) / per_row) for a in zoom)
    fig, (top, bottom) = draw.figure(height=0.32 * (len(dims) + 1) + 1.0 + 0.36 * rows + 1.3, nrows=2,
                                     gridspec_kw={"height_ratios": [0.32 * (len(dims) + 1) + 0.5,
                                                                    0.36 * rows + 1.0]})
    bars = [draw.Bar(0, a["start"], a["end"], {"F": "#56B4E9", "B": "#E69F00", "W": "#009E73"}[a["kind"]],
                     f"{a['kind']}{a['mb']}") for a in acts]
    names = {"tp": "TP", "cp": "CP", "dp_cp": "FSDP", "pp": "PP"}
    draw.timeline(top, bars, ["compute", *(f"{names[d]} {{{','.join(map(str, peers[d]))}}}" for d in dims)])
    for a in acts:  # a tick per collective, on its dimension's lane, in the order the action runs them
        n = len(a["ops"])
        for k, (dim, _, _) in enumerate(a["ops"]):
            key = "dp_cp" if dim == "dp" else dim
            if key in dims:
                x = a["start"] + (k + 0.5) / n * (a["end"] - a["start"])
                lane = 1 + dims.index(key)
                top.plot([x, x], [lane - 0.3, lane + 0.3], color=OP_COLORS[dim], lw=1.3)
    top.set_xlabel("time in the pipeline (a stage's forward = 1); a tick per collective, where the action "
                   "runs it")
    d, p, c, t = data["coords"]
    mesh = " × ".join(f"{k} {sizes[k]}" for k in ("dp", "pp", "cp", "tp") if k != "cp" or sizes["cp"] > 1)
    top.set_title(f"rank {data['rank']} (dp {d}, pp {p}{f', cp {c}' if sizes['cp'] > 1 else ''}, tp {t}) "
                  f"of {mesh}, {data['schedule']}, m = {data['m']}, {data['model']} (FULL_SHARD): one step",
                  loc="left", fontsize=9)
    draw.blank(bottom, (0, per_row), (0, rows * 0.45 + len(zoom) * 0.45 + 0.5))
    y = 0.0
    for a in zoom:
        bottom.text(0, y, f"inside {a['kind']}{a['mb']} (stage {a['stage']}), in order:", fontsize=8,
                    fontweight="bold", va="top")
        y += 0.3
        for k, op in enumerate(a["ops"]):
            if k and k % per_row == 0:
                y += 0.45
            draw.box(bottom, k % per_row, y, 0.95, 0.38, chip(op), color=OP_COLORS[op[0]],
                     alpha=1 if op[0] == "compute" else 0.45, fontsize=draw.SMALL)
        y += 0.6
    totals = ", ".join(f"{names['dp_cp' if k.split()[0] == 'dp' else k.split()[0]]} {k.split()[1]} ×{v}"
                       for k, v in sorted(data["totals"].items()))
    bottom.text(0, y, f"per step: {totals}.\nAG all-gather, RS reduce-scatter (FSDP, per block); AR "
                "all-reduce (TP, in the blocks; the embedding's and the head's are\nleft out: chapter 05's "
                "microbatch_comm_bytes counts them); then one all-reduce of ‖g‖² over the world, and the "
                "optimizer step.",
                fontsize=draw.SMALL, va="top")
    fig.tight_layout()
    return fig


# --- recomputation: memory against compute ------------------------------------------------------

SMALL = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16)


def recompute_data(b: int = 2, s: int = 64, model: str = "llama2-70b", seq_len: int = 4096,
                   tp: int = 8) -> dict:
    """Per mode: on a seeded small LLaMA (b × s tokens, float32) the saved-tensor ledger's peak
    over forward + backward, measured in this process, beside the formula; at `model`'s size (one
    sequence of `seq_len`, TP + SP, bf16) the formula's bytes per layer with flash and with eager
    attention; and the extra compute of each (the planner's `recompute_fraction`)."""
    tokens = torch.randint(0, SMALL.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    small = []
    for mode in ("none", "selective", "full"):
        net = build_model(SMALL, 0, torch.float32)
        apply_recompute(net.layers, mode)
        with ActivationMeter(net.parameters()) as meter:
            loss_fn(net(tokens[:, :-1]), tokens[:, 1:]).backward()
        formula = (SMALL.n_layers * layer_activation_bytes(SMALL, b * s, s, recompute=mode, elem=4)
                   + head_activation_bytes(SMALL, b * s, s, elem=4))
        small.append({"mode": mode, "ledger": meter.peak_bytes, "formula": formula,
                      "extra": recompute_fraction(SMALL, mode, s)})
    cfg = CONFIGS[model]
    scale = []
    for mode in ("none", "selective", "full"):
        flash, eager = (memory_model.layer_activation_bytes(cfg, seq_len, seq_len, tp=tp,
                                                            sequence_parallel=True, recompute=mode,
                                                            elem=2, eager_attention=e)
                        for e in (False, True))
        scale.append({"mode": mode, "flash": flash, "eager": eager,
                      "extra": recompute_fraction(cfg, mode, seq_len)})
    return {"small": {"b": b, "s": s, "dim": SMALL.dim, "layers": SMALL.n_layers, "modes": small},
            "scale": {"model": model, "seq_len": seq_len, "tp": tp, "modes": scale}}


def recompute_draw(data: dict):
    fig, (a, b) = draw.figure(height=3.5, ncols=2)
    small, scale = data["small"], data["scale"]
    xs = range(len(small["modes"]))
    a.bar([x - 0.2 for x in xs], [m["ledger"] / 2**10 for m in small["modes"]], 0.4, color="#0072B2",
          label="measured (saved-tensor ledger)")
    a.bar([x + 0.2 for x in xs], [m["formula"] / 2**10 for m in small["modes"]], 0.4, color="#9ECAE9",
          label="formula (memory_model)")
    a.set_xticks(list(xs), [f"{m['mode']}\n+{m['extra']:.0%} compute" for m in small["modes"]])
    a.set(ylabel="saved activations, KiB",
          title=f"a {small['layers']}-layer LLaMA, h = {small['dim']}, {small['b']} × {small['s']} "
                "tokens, fp32")
    b.bar([x - 0.2 for x in xs], [m["flash"] / 2**20 for m in scale["modes"]], 0.4, color="#56B4E9",
          label="flash attention (SDPA: ours)")
    b.bar([x + 0.2 for x in xs], [m["eager"] / 2**20 for m in scale["modes"]], 0.4, color="#CCCCCC",
          label="eager attention (stores s × s)")
    b.set_xticks(list(xs), [f"{m['mode']}\n+{m['extra']:.0%} compute" for m in scale["modes"]])
    b.set(ylabel="MiB per layer and sequence",
          title=f"{scale['model']}, s = {scale['seq_len']}, TP {scale['tp']} + SP, bf16 (formula)")
    for ax in (a, b):
        ax.title.set_fontsize(8.5)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
        ax.legend(fontsize=draw.SMALL, loc="upper right")
    fig.suptitle("Recomputation trades compute for memory (extra compute: the planner's "
                 "recompute_fraction)", x=0.01, ha="left", fontsize=10, fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


# --- perturbations ------------------------------------------------------------------------------

def tp_outermost(lines: dict) -> dict:
    """TP and DP swapped: TP groups striding across the mesh (a wrong mesh order)."""
    return {**lines, "tp": lines["dp"], "dp": lines["tp"]}


def dp_and_tp_swapped(at):
    return at.replace(dp=at.tp, dp_shard=at.tp, tp=at.dp)


FIGURES = [
    Figure(name="mesh_groups", path="07_3d/figures/mesh_groups.svg", data=mesh_data, draw=mesh_draw,
           sizes={"dp": 2, "pp": 2, "tp": 2, "cp": 1},
           sources=(Source("common.kernel.mesh:group_ranks", tp_outermost),
                    Source("common.kernel.mesh:coordinates", dp_and_tp_swapped)),
           alt="the 3D mesh's TP, DP and PP groups, from group_ranks"),
    Figure(name="step_3d", path="07_3d/figures/step_3d.svg", data=step_data, draw=step_draw,
           sizes={"dp": 2, "pp": 2, "tp": 2, "cp": 1, "rank": 0, "schedule": "1f1b", "m": 4, "model": "tiny"},
           sources=(Source("common.kernel.mesh:group_ranks", tp_outermost),
                    Source("pipeline.schedules:make_schedule", lambda s: gpipe(s.p, s.m)),
                    Source("pipeline.p2p:exchanges", lambda ex: [p2p.Exchange((), e.recvs) for e in ex]),
                    Source("tensor_parallel.formulas:block_comm_bytes",
                           lambda d: {k: 2 * v for k, v in d.items()}),
                    Source("parallel3d.comm_formulas:fsdp_gathers", lambda n: 2 * n)),
           alt="what one rank of the 3D mesh does in one step: its pipeline actions, the collectives inside"),
    Figure(name="recompute_tradeoff", path="07_3d/figures/recompute_tradeoff.svg", data=recompute_data,
           draw=recompute_draw, sizes={"b": 2, "s": 64, "model": "llama2-70b", "seq_len": 4096, "tp": 8},
           sources=(Source("parallel3d.memory_model:layer_activation_bytes", lambda x: 1.1 * x),
                    Source("parallel3d.recompute:recomputed", lambda part: part.args[0]),
                    Source("parallel3d.recompute:Recomputed", lambda w: w._checkpoint_wrapped_module),
                    Source("parallel3d.planner.pricing:recompute_fraction", lambda f: f + 0.05)),
           alt="saved activations against extra compute for none, selective and full recomputation"),
]
