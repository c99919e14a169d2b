"""Chapter 07's EP and HSDP page: the mesh's groups of the page's two runs, from common.kernel.mesh's own
rank lists (group_ranks, coordinates): which ranks form each line of tp, ep, FSDP's shard group,
the experts' shard group, HSDP's replicas and the pipeline, and which experts each rank holds."""

from __future__ import annotations

from common.figures import Figure, Source, draw
from common.kernel.mesh import MeshShape, coordinates, group_ranks

# the page's two runs (07_3d/experts_and_hybrid.md), 8 ranks each
MESHES = {"--model tiny-moe --ep 2 --tp 2 --pp 2": {"pp": 2, "dp_shard": 2, "tp": 2, "ep": 2},
          "--model tiny-moe --dp-replicate 2 --dp-shard 4 --ep 2": {"dp_replicate": 2, "dp_shard": 4,
                                                                    "ep": 2}}
DIMS = {"tp": "TP: all-reduces of activations, every block",
        "ep": "EP: all-to-all of the routed tokens, every MoE layer",
        "dp_shard_cp": "FSDP (dense units): all-gathers, reduce-scatters",
        "dp_shard_mod_ep": "FSDP (experts): the ranks with the same experts",
        "dp_replicate": "HSDP: all-reduce of each reduced shard",
        "pp": "PP: activations and their gradients, stage to stage"}


def expert_mesh_data(n_experts: int = 8) -> list[dict]:
    """For each run's mesh: every rank's coordinates and experts, and for each dimension with
    lines of more than one rank, the line each rank is on (group_ranks' lists)."""
    out = []
    for command, sizes in MESHES.items():
        shape = MeshShape(**sizes)
        lines = group_ranks(shape, DIMS)
        at = [coordinates(r, shape) for r in range(shape.world)]
        per = n_experts // shape.ep
        rows, seen = [], {}
        for dim, what in DIMS.items():
            if len(lines[dim][0]) == 1:
                continue
            key = tuple(map(tuple, lines[dim]))
            same = f" (the lines of {seen[key]})" if key in seen else ""
            seen.setdefault(key, dim)
            rows.append({"dim": dim, "what": what + same,
                         "line_of": [next(i for i, line in enumerate(lines[dim]) if r in line)
                                     for r in range(shape.world)]})
        out.append({"command": command, "mesh": shape.as_dict(), "rows": rows,
                    "coords": [f"p{a.pp} r{a.dp_replicate}\ns{a.dp_shard} t{a.tp}" for a in at],
                    "experts": [f"{a.ep * per}-{(a.ep + 1) * per - 1}" for a in at]})
    return out


def expert_mesh_draw(data: list[dict]):
    n_rows = sum(len(m["rows"]) + 3 for m in data)
    fig, ax = draw.figure(height=0.36 * n_rows + 0.4)
    world = len(data[0]["coords"])
    draw.blank(ax, (-3.2, world + 6.2), (-0.2, n_rows))
    y = 0.0
    for mesh in data:
        sizes = " × ".join(f"{k} {v}" for k, v in mesh["mesh"].items())
        ax.text(-3.2, y + 0.35, f"{mesh['command']}   ({sizes})", fontsize=8.5, fontweight="bold",
                va="center")
        y += 0.8
        ax.text(-0.2, y + 0.4, "rank (pp, replica,\nshard, tp)", ha="right", va="center", fontsize=draw.SMALL)
        for r in range(world):
            draw.box(ax, r, y, 0.9, 0.8, f"{r}", color="#FFFFFF", fontsize=8)
            ax.text(r + 0.45, y + 1.05, mesh["coords"][r], ha="center", va="center", fontsize=draw.SMALL)
        y += 1.3
        ax.text(-0.2, y + 0.3, "experts held", ha="right", va="center", fontsize=draw.SMALL)
        for r in range(world):
            ax.text(r + 0.45, y + 0.3, mesh["experts"][r], ha="center", va="center", fontsize=draw.SMALL)
        y += 0.7
        for row in mesh["rows"]:
            ax.text(-0.2, y + 0.3, row["dim"], ha="right", va="center", fontsize=8)
            for r, line in enumerate(row["line_of"]):
                draw.box(ax, r, y, 0.9, 0.6, str(line), color=draw.rank_color(line), alpha=0.55,
                         fontsize=draw.SMALL)
            ax.text(world + 0.2, y + 0.3, row["what"], va="center", fontsize=draw.SMALL)
            y += 0.72
        y += 0.5
    ax.set_title("The mesh's lines (common.kernel.mesh.group_ranks): a box shows the line its rank is on, "
                 "the same number and colour the same process group", loc="left", fontsize=8.5)
    return fig


def strided_ep(lines: dict) -> dict:
    """A plausible bug for the test: EP groups strided across the replica instead of consecutive."""
    return {**lines, "ep": [sorted(members) for members in zip(*lines["ep"], strict=True)]} if "ep" in lines \
        else lines


FIGURES = [
    Figure(name="expert_mesh", path="07_3d/figures/expert_mesh.svg", data=expert_mesh_data,
           draw=expert_mesh_draw, sizes={"n_experts": 8},
           sources=(Source("common.kernel.mesh:group_ranks", perturb=strided_ep),
                    Source("common.kernel.mesh:coordinates", perturb=lambda at: at.replace(ep=0))),
           alt="the lines of tp, ep, FSDP's shard groups, HSDP's replicas and pp on the page's two "
               "8-rank meshes, from common.kernel.mesh.group_ranks"),
]
