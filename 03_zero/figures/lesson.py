"""Chapter 03's figures: ZeRO's flat-buffer partition of a real model (zero.flat), what each rank
holds at each stage, the per-stage memory and bytes from zero.accounting, and the DeepSpeed
config's knobs as zero.config reads them. Single process, the model on the meta device."""

from __future__ import annotations

from common.figures import ROOT, Figure, Source, draw
from common.kernel.model import build_model, get_config
from zero.accounting import comm_formula, memory_formula
from zero.config import load_config, optimizer_arguments
from zero.flat import assign_buckets, make_groups, module_units

KINDS = ("params", "grads", "optimizer")
KIND_LABEL = {"params": "params", "grads": "grads", "optimizer": "optimizer state"}
TENSOR_COLORS = {"embedding": "#CC79A7", "attention": "#56B4E9", "feed_forward": "#009E73",
                 "norm": "#F0E442"}
STAGE_LABEL = ("stage 0: plain DP", "stage 1: + optimizer state sharded", "stage 2: + gradients sharded",
               "stage 3: + parameters sharded")


def tensor_kind(name: str) -> str:
    for kind in ("attention", "feed_forward"):
        if f".{kind}." in name:
            return kind
    return "norm" if "norm" in name else "embedding"


def named_parameters(model: str) -> list:
    return list(build_model(get_config(model), device="meta").named_parameters())


def flat_layout(group) -> list[list]:
    """[name, offset, numel, kind] of each tensor of a FlatGroup, in flat order."""
    return [[name, off, p.numel(), tensor_kind(name)]
            for name, p, off in zip(group.names, group.params, group.offsets, strict=True)]


# --- what each rank holds, stage by stage -------------------------------------------------------

def stages_data(n: int = 4, model: str = "tiny", b_param: int = 2, b_grad: int = 2, k: int = 12) -> dict:
    """The one flat buffer of `model` (DeepSpeed's default bucket of 5e8 elements holds it all) as
    `make_groups` lays it out for each of n ranks, and per stage which of params, grads and
    optimizer state a rank keeps whole or as its slice (`memory_formula`: sharded where the stage's
    bytes are below stage 0's); bytes per element: the paper's mixed precision, 2 + 2 + 12."""
    named = named_parameters(model)
    groups = [make_groups(assign_buckets(named, 500_000_000), n, r)[0] for r in range(n)]
    g = groups[0]
    per_element = {"params": b_param, "grads": b_grad, "optimizer": k}
    whole = memory_formula(0, g.numel, n, b_param, b_grad, k)
    stages = []
    for stage in range(4):
        formula = memory_formula(stage, g.numel, n, b_param, b_grad, k)
        sharded = {kind: formula[kind] < whole[kind] for kind in KINDS}
        held = [sum(per_element[kind] * (gr.shard_size if sharded[kind] else gr.padded) for kind in KINDS)
                for gr in groups]
        stages.append({"stage": stage, "sharded": sharded, "bytes_per_rank": held,
                       "formula_bytes": sum(formula.values())})
    return {"model": model, "n": n, "psi": g.numel, "padded": g.padded, "tensors": flat_layout(g),
            "ranks": [[gr.start, gr.shard_size] for gr in groups], "bytes": per_element, "stages": stages}


def flat_strip(ax, tensors: list, padded: int, y: float, h: float, scale: float, x0: float = 0.0) -> None:
    """A flat buffer drawn to scale: each tensor a segment coloured by kind, padding hatched."""
    for _, off, numel, kind in tensors:
        draw.box(ax, x0 + off * scale, y, numel * scale, h, color=TENSOR_COLORS[kind], edge="#FFFFFF")
    end = sum(t[2] for t in tensors)
    if padded > end:  # drawn at least 0.4% wide so that 2 elements of 123,426 can be seen
        draw.box(ax, x0 + end * scale, y, max((padded - end) * scale, 0.004 * padded * scale), h,
                 color="#FFFFFF", edge="#000000", hatch="xxxx")


def legend(ax, x: float, y: float, step: float, h: float = 0.2) -> None:
    """The tensor kinds' colours and the padding's hatch, in a row from (x, y)."""
    for j, (kind, color) in enumerate([*TENSOR_COLORS.items(), ("padding", None)]):
        draw.box(ax, x + j * step, y, 0.12 * step, h, color=color or "#FFFFFF",
                 edge="#000000" if color is None else "#FFFFFF", hatch=None if color else "xxxx")
        ax.text(x + j * step + 0.16 * step, y + h / 2, kind.replace("_", " "), va="center",
                fontsize=draw.SMALL)


def stages_draw(data: dict):
    n, padded, ranks, stages = data["n"], data["padded"], data["ranks"], data["stages"]
    per_element = data["bytes"]
    unit = sum(per_element.values())
    fig, ax = draw.figure(height=1.5 + 1.2 * len(stages))
    cell, gap, row_h = 1.0, 0.12, 1.2  # a rank's cell spans the whole flat buffer, scaled to 1
    width = n * cell + (n - 1) * gap
    draw.blank(ax, (-0.75, width + 0.8), (-1.5, len(stages) * row_h - 0.15))
    scale = width / padded  # the strip on top spans every rank's cells
    flat_strip(ax, data["tensors"], padded, -1.4, 0.28, scale)
    for r, (start, size) in enumerate(ranks):
        draw.box(ax, start * scale, -1.08, size * scale, 0.22, f"r{r}: [{start:,}, {start + size:,})",
                 color=draw.rank_color(r), alpha=0.85, fontsize=draw.SMALL, textcolor="#FFFFFF",
                 edge="#FFFFFF")
    pad = padded - data["psi"]
    ax.text(-0.05, -1.15, f"flat buffer,\nΨ = {data['psi']:,}", ha="right", va="center", fontsize=draw.SMALL)
    ax.text(width + 0.05, -1.26, f"{pad} padding\nelement{'s' if pad != 1 else ''}" if pad else
            f"no padding:\n{n} divides Ψ", ha="left", va="center", fontsize=draw.SMALL)
    total0 = stages[0]["bytes_per_rank"][0]
    for row, st in enumerate(stages):
        y0 = row * row_h - 0.6
        ax.text(0, y0 + 0.02, STAGE_LABEL[st["stage"]], ha="left", va="bottom", fontsize=8.5,
                fontweight="bold")
        y = y0 + 0.08
        ax.text(-0.05, y + 0.85 * (per_element["params"] + per_element["grads"]) / unit / 2,
                f"params {per_element['params']} B,\ngrads {per_element['grads']} B", ha="right", va="center",
                fontsize=draw.SMALL, color="#555555")
        for kind in KINDS:
            h = 0.85 * per_element[kind] / unit
            if kind == "optimizer":
                ax.text(-0.05, y + h / 2, f"optimizer\n{per_element[kind]} B", ha="right", va="center",
                        fontsize=draw.SMALL, color="#555555")
            for r, (start, size) in enumerate(ranks):
                x = r * (cell + gap)
                draw.box(ax, x, y, cell, h, color="#FFFFFF", edge="#BBBBBB")
                lo, w = (start / padded, size / padded) if st["sharded"][kind] else (0.0, 1.0)
                draw.box(ax, x + lo * cell, y, w * cell, h, color=draw.rank_color(r), alpha=0.8,
                         edge="#333333")
            y += h
        held = st["bytes_per_rank"][0]
        ax.text(width + 0.05, y0 + 0.5, f"{held / 1e6:.2f} MB\nper rank,\n{held / total0:.2f}× stage 0",
                ha="left", va="center", fontsize=draw.SMALL)
    legend(ax, 0, len(stages) * row_h - 0.45, width / 5)
    ax.set_title(f"ZeRO on {data['model']}, N = {n}: each rank owns one slice of the flat buffer; what it "
                 "keeps at each stage (area = bytes)", loc="left")
    return fig


def next_rank(groups: list) -> list:
    """A plausible bug for the test: every rank takes its neighbour's slice."""
    for g in groups:
        g.rank = (g.rank + 1) % g.world
    return groups


def registration_order(buckets: list) -> list:
    """A plausible bug for the test: parameters laid out in registration order, not backward's."""
    return [list(reversed(b)) for b in reversed(buckets)]


# --- buckets: each padded and cut N ways on its own ---------------------------------------------

def buckets_data(n: int = 3, bucket: int = 20_000, model: str = "tiny") -> dict:
    """`model`'s reduce buckets of `bucket` elements (`assign_buckets`), each laid out by
    `make_groups` on n ranks: its tensors, its padding, each rank's slice."""
    buckets = assign_buckets(named_parameters(model), bucket)
    ranks = [make_groups(buckets, n, r) for r in range(n)]
    return {"model": model, "n": n, "bucket": bucket,
            "buckets": [{"tensors": flat_layout(g), "numel": g.numel, "padded": g.padded,
                         "slices": [[gr[i].start, gr[i].shard_size] for gr in ranks]}
                        for i, g in enumerate(ranks[0])]}


def buckets_draw(data: dict):
    buckets, n = data["buckets"], data["n"]
    longest = max(b["padded"] for b in buckets)
    fig, ax = draw.figure(height=0.5 * len(buckets) + 1.0)
    draw.blank(ax, (-0.2, 1.3), (-0.6, len(buckets)))
    scale = 1.0 / longest
    for i, b in enumerate(buckets):
        flat_strip(ax, b["tensors"], b["padded"], i, 0.42, scale)
        for r, (start, size) in enumerate(b["slices"]):
            draw.box(ax, start * scale, i + 0.46, size * scale, 0.2, f"rank {r}",
                     color=draw.rank_color(r), alpha=0.85, fontsize=draw.SMALL, textcolor="#FFFFFF",
                     edge="#FFFFFF")
        ax.text(-0.01, i + 0.33, f"bucket {i}", ha="right", va="center", fontsize=draw.SMALL)
        pad = b["padded"] - b["numel"]
        ax.text(b["padded"] * scale + 0.012, i + 0.33,
                f"{len(b['tensors'])} tensors, {b['numel']:,} + {pad} padding", ha="left", va="center",
                fontsize=draw.SMALL)
    legend(ax, 0, -0.5, 0.2, h=0.25)
    ax.set_title(f"reduce_bucket_size = {data['bucket']:,} on {data['model']}, N = {n}: every bucket is "
                 f"its own flat buffer, padded to a multiple of {n} and cut into {n} slices",
                 loc="left", fontsize=9)
    return fig


# --- memory per rank against N (the paper's accounting) -----------------------------------------

def memory_data(psi: float = 7e9, max_n: int = 128, b_param: int = 2, b_grad: int = 2, k: int = 12) -> dict:
    """GB per rank of each stage for Ψ parameters, N = 1, 2, 4, … max_n (`memory_formula`), and
    the large-N limit of each (N = 10⁹)."""
    ns = [2**i for i in range(max_n.bit_length()) if 2**i <= max_n]
    gb = lambda stage, n: sum(memory_formula(stage, int(psi), n, b_param, b_grad, k).values()) / 1e9  # noqa: E731
    return {"psi": psi, "ns": ns, "per_element": b_param + b_grad + k,
            "stages": [{"stage": s, "gb": [gb(s, n) for n in ns], "limit_gb": gb(s, 10**9)}
                       for s in range(4)]}


def memory_draw(data: dict):
    fig, ax = draw.figure(height=3.6)
    ns = data["ns"]
    for st in data["stages"]:
        color = draw.rank_color(st["stage"])
        ax.plot(ns, st["gb"], "o-", color=color, label=STAGE_LABEL[st["stage"]], ms=4)
        if 0 < st["stage"] < 3:
            ax.axhline(st["limit_gb"], color=color, ls=":", lw=0.8)
            ax.text(ns[-1], st["limit_gb"] * 1.08, f"limit {st['limit_gb']:.0f} GB", ha="right",
                    fontsize=draw.SMALL,
                    color=color)
    ax.axhline(80, color="#555555", ls="--", lw=0.8)
    ax.text(ns[-1], 68, "one 80 GB GPU", ha="right", va="top", fontsize=draw.SMALL, color="#555555")
    ax.set(xscale="log", yscale="log", xlabel="GPUs (N)", ylabel="GB per GPU, before activations")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.legend(fontsize=draw.SMALL, loc="lower left")
    ax.set_title(f"Ψ = {data['psi'] / 1e9:g}B parameters at {data['per_element']} bytes each: only stage 3 "
                 "keeps falling as N grows", loc="left")
    return fig


# --- bytes per step against DP, with gradient accumulation --------------------------------------

def comm_data(n: int = 8, ks: tuple[int, ...] = (1, 2, 4, 8), psi: int = 7_000_000_000) -> dict:
    """Each stage's wire bytes per rank and step over plain DP's (`comm_formula`, b_p = b_g = 2),
    for k micro-batches per step (stages 0-1 reduce once: they keep full gradients)."""
    dp = comm_formula(0, psi, n, 2, 2)
    return {"n": n, "ks": list(ks), "psi": psi, "dp_gb": dp / 1e9,
            "stages": [[comm_formula(s, psi, n, 2, 2, k) / dp for k in ks] for s in range(4)]}


def comm_draw(data: dict):
    fig, ax = draw.figure(height=3.2)
    ks, width = data["ks"], 0.2
    for s, ratios in enumerate(data["stages"]):
        xs = [i + (s - 1.5) * width for i in range(len(ks))]
        bars = ax.bar(xs, ratios, width * 0.92, color=draw.rank_color(s), label=STAGE_LABEL[s])
        ax.bar_label(bars, [f"{v:g}" for v in ratios], fontsize=draw.SMALL, padding=1)
    ax.set_xticks(range(len(ks)), [f"k = {k} micro-batch{'es' if k > 1 else ''}" for k in ks])
    ax.set_ylabel(f"bytes per step / plain DP's\n(Ψ = {data['psi'] / 1e9:g}B: DP = {data['dp_gb']:.1f} GB)")
    ax.legend(fontsize=draw.SMALL, loc="upper left")
    ax.set_title(f"Bytes per rank and step over plain DP's (N = {data['n']}, accounted): stages 1-2 send "
                 "DP's, stage 3 1.5×;\nwith k micro-batches, stages 2-3 reduce-scatter in every one "
                 "(stages 0-1 keep full gradients and reduce once)", loc="left", fontsize=9)
    return fig


# --- the DeepSpeed config's knobs ----------------------------------------------------------------

CONFIGS = ("stage2.json", "stage3.json")
KNOBS = {  # key → what it is about (rows grouped by it)
    "stage": "memory", "bf16": "memory", "offload_optimizer": "memory", "offload_param": "memory",
    "param_persistence_threshold": "memory", "reduce_bucket_size": "communication",
    "allgather_bucket_size": "communication", "overlap_comm": "communication",
    "contiguous_gradients": "communication", "gradient_accumulation_steps": "the step",
    "gradient_clipping": "the step", "train_micro_batch_size_per_gpu": "the step"}
NOT_OPTIMIZER = {"param_persistence_threshold": "ZeroEngine", "gradient_accumulation_steps": "ZeroEngine",
                 "gradient_clipping": "ZeroEngine", "train_micro_batch_size_per_gpu": "train.py"}


def json_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "(absent)"
    if isinstance(value, (int, float)) and value >= 1e5:
        return f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
    return str(value)


def knob_effect(key: str, config, arg: dict, named: list, module, n: int) -> str:
    """What `key` does on this model and N, computed where the code can say it."""
    psi = sum(p.numel() for _, p in named)
    b_p, b_g, k = (2, 4, 12) if config.bf16 else (4, 4, 8)
    memory = memory_formula(config.stage, psi, n, b_p, b_g, k)
    if key == "stage":
        return f"{sum(memory.values()) / 2**20:.1f} MiB of state per rank"
    if key == "bf16":
        return f"{b_p} + {b_g} + {k} bytes per parameter"
    if key == "offload_optimizer":
        moved = memory["optimizer"] / 2**20
        return f"{moved:.1f} MiB (master, m, v) on the CPU" if arg.get(key) else "on the GPU"
    if key == "offload_param":
        return f"{memory['params'] / 2**20:.1f} MiB of shards on the CPU" if arg.get(key) else "on the GPU"
    if key == "param_persistence_threshold":
        units = module_units(module, config.param_persistence_threshold)
        whole = sum(p.numel() for _, members, persistent in units if persistent for _, p in members)
        return f"{whole:,} elements stay whole" if config.stage == 3 else "only read at stage 3"
    if key == "reduce_bucket_size":
        buckets = len(assign_buckets(named, config.reduce_bucket_size))
        return f"{buckets} reduce bucket{'s' if buckets > 1 else ''}"
    if key == "allgather_bucket_size":
        return "elements all-gathered at once, at most"
    if key == "overlap_comm":
        return "reduce-scatter while backward runs" if arg.get(key) else "reduce-scatter after backward"
    if key == "contiguous_gradients":
        return "reduced shards in one buffer" if arg.get(key) else "a buffer per bucket"
    if key == "gradient_accumulation_steps":
        steps = config.gradient_accumulation_steps or 1
        sent = comm_formula(config.stage, psi, n, b_p, b_g, steps) / 2**20
        return f"{steps} backward{'s' if steps > 1 else ''} per step: {sent:.0f} MiB sent"
    if key == "gradient_clipping":
        return "one scalar all-reduce (the norm)" if config.clip else "no clipping"
    return f"{config.train_micro_batch_size_per_gpu} sequences per micro-batch" \
        if config.train_micro_batch_size_per_gpu else "from --micro-batch"


def config_data(model: str = "small", n: int = 4) -> dict:
    """The article's two DeepSpeed files as `load_config` reads them: each key's value in both,
    who takes it (`optimizer_arguments`: a ZeroOptimizer keyword of the same name, else the
    engine or train.py), and what it changes on `model` over n ranks (buckets from
    `assign_buckets`, stage 3's whole units from `module_units`, bytes from `memory_formula` and
    `comm_formula`)."""
    named = named_parameters(model)
    module = build_model(get_config(model), device="meta")
    configs = [load_config(ROOT / "03_zero" / "configs" / name) for name in CONFIGS]
    args = [optimizer_arguments(c) for c in configs]
    rows = []
    for key, about in KNOBS.items():
        takes = "ZeroOptimizer" if key in args[0] else NOT_OPTIMIZER.get(key, "(nobody)")
        rows.append({"key": key, "about": about, "takes": takes,
                     "values": [json_value(getattr(c, key)) for c in configs],
                     "effects": [knob_effect(key, c, a, named, module, n)
                                 for c, a in zip(configs, args, strict=True)]})
    return {"model": model, "n": n, "configs": list(CONFIGS), "rows": rows}


def config_draw(data: dict):
    rows = data["rows"]
    effects = [a if a == b else f"{a} /\n{b}" if len(a) + len(b) > 40 else f"{a} / {b}"
               for a, b in (row["effects"] for row in rows)]
    tops = [0.0]
    for text in effects:
        tops.append(tops[-1] + (1.6 if "\n" in text else 1.0))
    fig, ax = draw.figure(height=0.27 * tops[-1] + 0.8)
    draw.blank(ax, (0, 10), (-1.0, tops[-1]))
    about_color = {"memory": "#CC79A7", "communication": "#E69F00", "the step": "#56B4E9"}
    cols = (0.0, 2.8, 3.9, 5.0, 6.25)
    heads = ("key", data["configs"][0], data["configs"][1], "taken by",
             f"what it changes on {data['model']}, N = {data['n']}:\n"
             f"{data['configs'][0]} / {data['configs'][1]}")
    for x, head in zip(cols, heads, strict=True):
        ax.text(x, -0.5, head, fontsize=draw.SMALL, fontweight="bold", va="center")
    for i, row in enumerate(rows):
        top, mid = tops[i], (tops[i] + tops[i + 1]) / 2
        color = about_color[row["about"]]
        draw.box(ax, -0.12, top + 0.05, 0.08, tops[i + 1] - top - 0.1, color=color, edge=color)
        if i == 0 or rows[i - 1]["about"] != row["about"]:
            ax.text(-0.2, top + 0.5, row["about"], ha="right", va="top", fontsize=draw.SMALL, color=color,
                    fontweight="bold")
        ax.text(cols[0], mid, row["key"], fontsize=draw.SMALL, va="center", family="monospace")
        for x, value in zip(cols[1:3], row["values"], strict=True):
            ax.text(x, mid, value, fontsize=draw.SMALL, va="center")
        ax.text(cols[3], mid, row["takes"], fontsize=draw.SMALL, va="center", color="#0072B2")
        ax.text(cols[4], mid, effects[i], fontsize=draw.SMALL, va="center")
        ax.plot([-0.12, 10], [tops[i + 1], tops[i + 1]], color="#E5E5E5", lw=0.5)
    fig.subplots_adjust(left=0.13, right=0.99)
    ax.set_title("The article's DeepSpeed configs, read by config.py: every key means what it means in "
                 "DeepSpeed", loc="left")
    return fig


def grads_doubled(memory: dict) -> dict:
    """A plausible bug for the test: gradients counted in fp32 where the formula says bf16."""
    return {**memory, "grads": 2 * memory["grads"]}


def first_tensor_apart(buckets: list) -> list:
    """A plausible bug for the test: each bucket's first tensor in a bucket of its own."""
    return [part for b in buckets for part in ([b[:1], b[1:]] if len(b) > 1 else [b])]


def stage_one(config):
    """A plausible bug for the test: the stage read as 1 whatever the file says."""
    from dataclasses import replace

    return replace(config, stage=1)


FIGURES = [
    Figure(name="zero_stages", path="03_zero/figures/zero_stages.svg", data=stages_data, draw=stages_draw,
           sizes={"n": 4},
           sources=(Source("zero.flat:make_groups", perturb=next_rank),
                    Source("zero.flat:assign_buckets", perturb=registration_order),
                    Source("zero.accounting:memory_formula", perturb=grads_doubled)),
           alt="the flat buffer of tiny cut into 4 owner slices, and what each rank keeps at stages 0-3"),
    Figure(name="zero_buckets", path="03_zero/figures/zero_buckets.svg", data=buckets_data, draw=buckets_draw,
           sizes={"n": 3, "bucket": 20_000},
           sources=(Source("zero.flat:make_groups", perturb=next_rank),
                    Source("zero.flat:assign_buckets", perturb=registration_order)),
           alt="tiny's reduce buckets of 20,000 elements, each padded and cut into 3 slices"),
    Figure(name="zero_memory", path="03_zero/figures/zero_memory.svg", data=memory_data, draw=memory_draw,
           sizes={"psi": 7e9},
           sources=(Source("zero.accounting:memory_formula",
                           perturb=lambda m: {**m, "optimizer": 2 * m["optimizer"]}),),
           alt="memory per GPU of a 7B model against the number of GPUs, per ZeRO stage"),
    Figure(name="zero_comm", path="03_zero/figures/zero_comm.svg", data=comm_data, draw=comm_draw,
           sizes={"n": 8},
           sources=(Source("zero.accounting:comm_formula", perturb=lambda c: 1.1 * c),),
           alt="bytes per step over plain DP's, per stage, for 1 to 8 micro-batches"),
    Figure(name="zero_config", path="03_zero/figures/zero_config.svg", data=config_data, draw=config_draw,
           sources=(Source("zero.config:load_config", perturb=stage_one),
                    Source("zero.config:optimizer_arguments",
                           perturb=lambda a: {k: v for k, v in a.items() if k != "overlap_comm"}),
                    Source("zero.flat:module_units", perturb=lambda units: units[:-1]),
                    Source("zero.flat:assign_buckets", perturb=first_tensor_apart)),
           alt="the article's DeepSpeed config keys, their values, what they become and what they change"),
]

