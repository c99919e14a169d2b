"""Chapter 07's planner page: the planner against published runs, each run priced at its own
layout and recipe (`parallel3d.planner.published.price_published`): predicted over published
figure, and the memory priced per GPU over the GPU's (measured, where the source measured it)."""

from __future__ import annotations

from dataclasses import replace

from common.figures import Figure, Source, draw
from parallel3d.planner import published

SOURCE_COLORS = {"Narayanan": 0, "NVIDIA": 1, "Llama": 2, "TorchTitan": 3, "DeepSeek-AI": 5}


def published_ratio_data() -> dict:
    """Every published run: its name, source, predicted / published figure, whether FP8, and the
    step's priced overheads over its work (bubble, TP, PP, DP, CP, EP)."""
    runs = []
    for c in published.compare():
        work = c.plan.times["compute"] - c.plan.times["bubble"]
        over = {"bubble": c.plan.times["bubble"], "TP": c.plan.times["tp"], "PP": c.plan.times["pp"],
                "DP": c.plan.times["dp_exposed"], "CP": c.plan.times["cp_exposed"],
                "EP": c.plan.times["ep"]}
        measured = c.run.memory_gib * 2**30 / 1e9 if c.run.memory_gib else None
        runs.append({"name": c.run.name, "source": c.run.source.title.split()[0].rstrip(","),
                     "ratio": c.ratio, "fp8": c.run.fp8,
                     "overheads": {k: v / work for k, v in over.items()},
                     "memory": published.memory_gb(c) / c.run.gpu_mem_gb,
                     "measured": measured / c.run.gpu_mem_gb if measured else None})
    return {"band": published.BAND, "runs": runs}


def published_ratio_draw(data: dict):
    runs, band = data["runs"], data["band"]
    fig, (ax, mem) = draw.figure(height=0.2 * len(runs) + 1.2, ncols=2, sharey=True,
                                 gridspec_kw={"width_ratios": [3, 2]})
    ax.axvspan(1 - band, 1 + band, color="#EEEEEE", zorder=0)
    for a in (ax, mem):
        a.axvline(1.0, color="#333333", linewidth=0.8)
    for i, r in enumerate(runs):
        color = draw.rank_color(SOURCE_COLORS.get(r["source"], 7))
        ax.barh(i, r["ratio"], left=0, height=0.7, color=color, hatch="///" if r["fp8"] else None,
                edgecolor="#333333", linewidth=0.4)
        ax.text(r["ratio"] + 0.01, i, f"{r['ratio']:.2f}", va="center", fontsize=draw.SMALL)
        mem.barh(i, r["memory"], height=0.7, color=color, edgecolor="#333333", linewidth=0.4)
        if r["measured"]:
            mem.plot([r["measured"]], [i], marker="D", color="#333333", markersize=3.5)
    ax.set_yticks(range(len(runs)), [r["name"] + (" (FP8)" if r["fp8"] else "") for r in runs],
                  fontsize=draw.SMALL)
    ax.set_ylim(len(runs) - 0.5, -0.5)
    ax.set_xlim(0, 1.6)
    mem.set_xlim(0, 1.2)
    ax.set_xlabel("predicted / published\n(tokens/s or the source's TFLOP/s per GPU)")
    mem.set_xlabel("memory priced / the GPU's\n(◆ measured)")
    ax.set_title(f"Each published run at its own layout and recipe: the grey band is ±{band:.0%}; "
                 f"hatched: FP8 (bf16 peak)", loc="left", fontsize=9)
    mem.set_title("and what it holds per GPU", loc="left", fontsize=9)
    return fig


def doubled_prediction(c: published.Comparison) -> published.Comparison:
    """A plausible bug for the test: the predicted figure twice what the step time gives."""
    return replace(c, predicted=2 * c.predicted)


FIGURES = [
    Figure(name="planner_published", path="07_3d/planner/figures/published.svg",
           data=published_ratio_data, draw=published_ratio_draw,
           sources=(Source("parallel3d.planner.published:price_published", perturb=doubled_prediction),
                    Source("parallel3d.planner.published:memory_gb", perturb=lambda gb: 1.1 * gb)),
           alt="predicted over published throughput, and memory per GPU over the GPU's, for every "
               "published run, priced at its layout"),
]
