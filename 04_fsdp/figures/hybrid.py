"""Chapter 04's HSDP figure: the shard groups (a node) and the replicate groups from the mesh
(common.kernel.mesh), and the bytes that leave a node per step under FULL_SHARD and HYBRID_SHARD
(fsdp.formulas)."""

from __future__ import annotations

from common.figures import Figure, Source, draw
from common.kernel.mesh import MeshShape, group_ranks
from fsdp.formulas import UnitTraffic, network_bytes, unit_comm_bytes_by_group
from fsdp.wrap import ShardingStrategy


def hsdp_data(s: int = 8, r: int = 2, micro_batches: int = 1,
              nodes: tuple[int, ...] = (2, 4, 8, 16, 64)) -> dict:
    """HSDP's groups on r nodes of s GPUs, from the mesh (common.kernel.mesh: dp_shard lines shard,
    dp_replicate lines all-reduce), and per node and step, bytes over the network for FULL_SHARD
    (one ring over s·r ranks) and HYBRID_SHARD (shard in the node, all-reduce across), in units of
    P·b (`network_bytes`, one unit of P elements, b_p = b_r), for each number of nodes."""
    groups = group_ranks(MeshShape(dp_replicate=r, dp_shard=s), ("dp_shard", "dp_replicate"))
    P = 2**20
    unit = [UnitTraffic(P, P, 1, False)]
    rows = []
    for count in sorted({r, *nodes}):
        flat = network_bytes(unit, s, count, ShardingStrategy.FULL_SHARD, micro_batches, no_sync=True)
        hsdp = network_bytes(unit, s, count, ShardingStrategy.HYBRID_SHARD, micro_batches, no_sync=True)
        rows.append({"nodes": count, "flat": flat, "hsdp": hsdp})
    per_rank = unit_comm_bytes_by_group(unit[0], s, ShardingStrategy.HYBRID_SHARD, 2 * micro_batches, 1, r)
    scaled = lambda d: {k: v / P if k.startswith(("network", "nvlink")) else v for k, v in d.items()}  # noqa: E731
    return {"s": s, "r": r, "micro_batches": micro_batches, "shard": groups["dp_shard"],
            "replicate": groups["dp_replicate"],
            "rows": [{"nodes": x["nodes"], "flat": scaled(x["flat"]), "hsdp": scaled(x["hsdp"])}
                     for x in rows],
            "per_rank_intra": per_rank[0] / P, "per_rank_inter": per_rank[1] / P}


def hsdp_draw(data: dict):
    s, r, shard = data["s"], data["r"], data["shard"]
    where = {rank: (k, i) for k, line in enumerate(shard) for i, rank in enumerate(line)}
    fig, (top, ax) = draw.figure(height=6.2, nrows=2, ncols=1, gridspec_kw={"height_ratios": [1.3, 1],
                                                                            "hspace": 0.3})
    gpu, gap = 1.0, 1.6
    node_w = s * gpu
    draw.blank(top, (-0.6, r * node_w + (r - 1) * gap + 0.6), (-1.35, 4.1))
    for k in range(r):
        x0 = k * (node_w + gap)
        draw.box(top, x0 - 0.25, -0.55, node_w + 0.5, 2.45, color="#F7F7F7", edge="#555555")
        top.text(x0 + node_w / 2, -0.85, f"node {k}: shard group\n(all-gathers, reduce-scatters: NVLink)",
                 ha="center", fontsize=draw.SMALL)
        for i in range(s):
            draw.box(top, x0 + i * gpu + 0.1, 0, gpu - 0.2, 0.8, f"{shard[k][i]}", color=draw.rank_color(i),
                     alpha=0.85, fontsize=draw.SMALL, textcolor="#FFFFFF")
            if i < s - 1:
                draw.arrow(top, (x0 + i * gpu + 0.85, 1.15), (x0 + (i + 1) * gpu + 0.15, 1.15),
                           color="#777777")
        top.text(x0 + node_w / 2, 1.55, f"ring of {s}", ha="center", fontsize=draw.SMALL, color="#777777")
        if k < r - 1:
            draw.arrow(top, (x0 + node_w + 0.3, 0.4), (x0 + node_w + gap - 0.3, 0.4), color="#D55E00",
                       width=1.5)
    for j, line in enumerate(data["replicate"]):
        y = 2.25 + 0.12 * j
        xs = [where[rank][0] * (node_w + gap) + where[rank][1] * gpu + gpu / 2 for rank in line]
        top.plot([min(xs), max(xs)], [y, y], color=draw.rank_color(j), lw=1)
        for x in xs:
            top.plot([x, x], [0.8, y], color=draw.rank_color(j), lw=0.5, ls=":")
    top.text(0, 3.3, f"replicate groups: local rank i on every node all-reduces its 1/{s} of each gradient "
             f"across the {r} nodes (one NIC per GPU): {data['per_rank_inter']:.3g}·P·b per GPU",
             fontsize=draw.SMALL, va="center")
    top.text(r * node_w / 2 + (r - 1) * gap / 2, 0.15, "network", ha="center", va="bottom",
             fontsize=draw.SMALL,
             color="#D55E00")
    top.text(0, 3.8, f"FULL_SHARD instead: one ring 0 → 1 → … → {s * r - 1} → 0 over all {s * r} GPUs,\n"
             f"whose {r} hops between nodes use the network (NCCL runs {s} such rings, one per NIC)",
             fontsize=draw.SMALL, va="center", color="#555555")
    top.set_title(f"HSDP on {r} nodes of {s} GPUs: shard inside a node, replicate across nodes", loc="left")
    rows = data["rows"]
    xs = range(len(rows))
    flat_g = [x["flat"]["network_gather"] for x in rows]
    flat_r = [x["flat"]["network_reduce"] for x in rows]
    hsdp = [x["hsdp"]["network_reduce"] for x in rows]
    ax.bar([x - 0.2 for x in xs], flat_g, 0.38, color="#E69F00", label="FULL_SHARD: all-gathers")
    ax.bar([x - 0.2 for x in xs], flat_r, 0.38, bottom=flat_g, color="#D55E00",
           label="FULL_SHARD: reduce-scatter")
    ax.bar([x + 0.2 for x in xs], hsdp, 0.38, color="#0072B2", label="HSDP: all-reduce of the shards")
    for x, g, red, h in zip(xs, flat_g, flat_r, hsdp, strict=True):
        ax.text(x, g + red + 0.1, f"{(g + red) / h:.2f}×", ha="center", fontsize=draw.SMALL,
                fontweight="bold")
    ax.set_xticks(list(xs), [f"r = {x['nodes']} nodes" for x in rows])
    ax.set_ylabel("bytes leaving a node per step\n(units of P·b)")
    ax.set_ylim(0, max(g + red for g, red in zip(flat_g, flat_r, strict=True)) * 1.25)
    ax.legend(fontsize=draw.SMALL, loc="upper left", ncols=3)
    k = data["micro_batches"]
    ax.set_title(f"Bytes leaving a node per step, s = {s}, {k} micro-batch{'es' if k > 1 else ''} (no_sync), "
                 "FULL_SHARD ÷ HSDP above each pair:\nFULL_SHARD's flat ring sends one rank's "
                 "bytes out of each node; HSDP only the all-reduce of its shards", loc="left", fontsize=8.5)
    return fig


def shard_across_nodes(lines: dict) -> dict:
    """A plausible bug for the test: HSDP's two groups swapped (sharding over the network)."""
    return {**lines, "dp_shard": lines["dp_replicate"], "dp_replicate": lines["dp_shard"]}


FIGURES = [
    Figure(name="hsdp_network", path="04_fsdp/figures/hsdp_network.svg", data=hsdp_data, draw=hsdp_draw,
           sizes={"s": 8, "r": 2},
           sources=(Source("common.kernel.mesh:group_ranks", perturb=shard_across_nodes),
                    Source("fsdp.formulas:network_bytes",
                           perturb=lambda d: {**d, "network_reduce": 8 * d["network_reduce"]}),
                    Source("fsdp.formulas:unit_comm_bytes_by_group", perturb=lambda t: (t[0], 2 * t[1]))),
           alt="HSDP's shard groups (nodes) and replicate groups, and the bytes leaving a node per step"),
]
