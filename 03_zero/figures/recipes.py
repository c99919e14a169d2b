"""What each precision recipe costs per parameter: memory per rank and bytes on the wire per step,
for plain DP (ZeRO's stage 0, chapter 01's DDP) and ZeRO's stages 1-3 (stage 3: FSDP's FULL_SHARD),
from zero.accounting with the itemsizes of common.numerics.RECIPES. Shown on 01's numerics page."""

from __future__ import annotations

from common.figures import Figure, Source, draw
from common.numerics import RECIPES
from zero.accounting import comm_formula, memory_formula, optimizer_bytes_per_param

STRATEGY = ("DP (01), stage 0", "ZeRO-1", "ZeRO-2", "ZeRO-3, FSDP (04)")
PSI = 10**9  # per parameter: any Ψ divides out


def recipe_bytes_data(n: int = 8, recipes: tuple[str, ...] = ("fp32", "bf16", "fp16")) -> dict:
    """Per recipe and stage: memory per rank (params, grads, optimizer = master + m + v) and wire
    bytes per step, both per parameter: memory_formula / comm_formula with b_param the compute
    (and gather) itemsize, b_grad the reduction's, K = optimizer_bytes_per_param."""
    out = {}
    for name in recipes:
        r = RECIPES[name]
        b = r.bytes()
        mixed = r.compute != r.master
        k = optimizer_bytes_per_param("adamw", mixed, b["state"])
        out[name] = {
            "bytes": b,
            "memory": [{kind: v / PSI for kind, v in
                        memory_formula(s, PSI, n, b["gather"], b["reduce"], k).items()} for s in range(4)],
            "wire": [comm_formula(s, PSI, n, b["gather"], b["reduce"]) / PSI for s in range(4)],
        }
    return {"n": n, "recipes": out}


KIND_COLORS = {"params": "#0072B2", "grads": "#E69F00", "optimizer": "#CC79A7"}


def recipe_bytes_draw(data: dict):
    fig, (left, right) = draw.figure(height=3.6, ncols=2, nrows=1, gridspec_kw={"width_ratios": [1.5, 1]})
    names = list(data["recipes"])
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        rec = data["recipes"][name]
        xs = [s + (j - (len(names) - 1) / 2) * width for s in range(4)]
        bottom = [0.0] * 4
        for kind, color in KIND_COLORS.items():
            values = [m[kind] for m in rec["memory"]]
            left.bar(xs, values, width * 0.92, bottom=bottom, color=color, alpha=0.45 + 0.25 * j,
                     label=kind if j == 0 else None, edgecolor="#333333", linewidth=0.4)
            bottom = [a + v for a, v in zip(bottom, values, strict=True)]
        for x, total in zip(xs, bottom, strict=True):
            left.text(x, total + 0.3, f"{name}\n{total:.3g}", ha="center", fontsize=draw.SMALL)
        bars = right.bar(xs, rec["wire"], width * 0.92, color=draw.rank_color(j), label=name)
        right.bar_label(bars, [f"{v:.3g}" for v in rec["wire"]], fontsize=draw.SMALL, padding=1)
    for ax in (left, right):
        ax.set_xticks(range(4), [s.replace(", ", ",\n") for s in STRATEGY], fontsize=draw.SMALL)
    left.set_ylabel("bytes per parameter per rank")
    left.set_ylim(0, 22)
    left.legend(fontsize=draw.SMALL, loc="upper right")
    left.set_title(f"Memory (n = {data['n']}): params in the compute dtype, grads in the reduction's,\n"
                   "optimizer = fp32 master (mixed) + m + v", loc="left", fontsize=8.5)
    right.set_ylabel("bytes per parameter per step (accounted)")
    right.legend(fontsize=draw.SMALL, loc="upper left")
    right.set_title("Wire: fp32 reductions, gathers in the compute dtype", loc="left", fontsize=8.5)
    fig.tight_layout()
    return fig


FIGURES = [
    Figure(name="recipe_bytes", path="03_zero/figures/recipe_bytes.svg", data=recipe_bytes_data,
           draw=recipe_bytes_draw, sizes={"n": 8},
           sources=(Source("zero.accounting:memory_formula",
                           perturb=lambda m: {**m, "grads": 2 * m["grads"]}),
                    Source("zero.accounting:comm_formula", perturb=lambda c: 1.1 * c),
                    Source("zero.accounting:optimizer_bytes_per_param", perturb=lambda k: k + 4)),
           alt="bytes per parameter of memory per rank and on the wire per step, per recipe and ZeRO stage"),
]
