"""Chapter 07's checkpoint page: which saved pieces a rank of another mesh reads.

The regions are `shard_layout.llama_3d_layout` (the region of each LLaMA tensor a rank of a
dp × pp × tp mesh holds: TP boxes, FSDP's flat ranges, a stage's layers), cut into their
contiguous boxes by `Region.runs`; what a rank of the new mesh reads is every saved piece whose
`reshard.overlap_numel` with its region is not zero, the test `load_checkpoint` makes per piece.
"""

from __future__ import annotations

from common.figures import Figure, Source, draw
from common.kernel.model import CONFIGS
from parallel3d.checkpoint.reshard import overlap_numel
from parallel3d.checkpoint.shard_layout import llama_shapes, mesh_regions


def boxes(region) -> list[list[int]]:
    """The region's contiguous runs as [row, col, rows, cols] boxes inside the tensor."""
    out = []
    for run in region.runs():
        box = region.valid_box((run.offsets, run.shape))
        if box is not None:
            (r, c), (h, w) = box
            out.append([r, c, h, w])
    return out


def reshard_data(saved: tuple[int, int, int] = (2, 2, 2), load: tuple[int, int, int] = (1, 1, 8),
                 model: str = "small", tensor: str = "layers.0.feed_forward.w1.weight") -> dict:
    """For one 2-d tensor: the boxes each rank of the saved mesh (dp, pp, tp) wrote, and for each
    rank of the new mesh its boxes and the saved ranks' files it reads (elements from each)."""
    cfg = CONFIGS[model]
    saved_regions = [r.get(tensor) for r in mesh_regions(cfg, *saved)]
    load_regions = [r.get(tensor) for r in mesh_regions(cfg, *load)]
    shape = llama_shapes(cfg)[tensor]
    written = [[rank, boxes(r)] for rank, r in enumerate(saved_regions) if r is not None]
    reads = []
    for rank, region in enumerate(load_regions):
        if region is None:
            continue
        src = [[s, overlap_numel(region, sr)] for s, sr in enumerate(saved_regions) if sr is not None]
        reads.append([rank, boxes(region), [[s, n] for s, n in src if n]])
    return {"model": model, "tensor": tensor, "shape": list(shape), "saved": list(saved),
            "load": list(load), "written": written, "reads": reads}


def reshard_draw(data: dict):
    rows, cols = data["shape"]
    fig, ax = draw.figure(height=5.2)
    h = 4.4  # the tensor's height on the page; its width follows the shape, at most 2.2
    scale = h / rows
    w = min(2.2, cols * scale * 2.5)
    sx = w / cols
    left, right = 0.2, 4.9
    draw.blank(ax, (0, 10.4), (-0.6, h + 0.2))
    color_of = {rank: draw.rank_color(k) for k, (rank, _) in enumerate(data["written"])}
    for rank, bx in data["written"]:
        if not bx:
            continue
        for r, c, hh, ww in bx:
            draw.box(ax, left + c * sx, r * scale, ww * sx, hh * scale, color=color_of[rank], alpha=0.8,
                     edge="none")
        r, c, hh, ww = max(bx, key=lambda b: b[2] * b[3])
        ax.text(left + w + 0.08, (r + hh / 2) * scale, f"rank-{rank:05d}.bin  rows {r}–{r + hh - 1}",
                va="center", fontsize=draw.SMALL, color=color_of[rank])
    draw.box(ax, left, 0, w, h, color="none")
    for rank, bx, src in data["reads"]:
        if not bx:
            continue
        for r, c, hh, ww in bx:
            draw.box(ax, right + c * sx, r * scale, ww * sx, hh * scale, color="#F7F7F7")
        r0 = min(b[0] for b in bx)
        r1 = max(b[0] + b[2] for b in bx)
        y = (r0 + r1) / 2 * scale
        ax.text(right + w / 2, y, f"rank {rank}", ha="center", va="center", fontsize=draw.SMALL)
        reads = ",  ".join(f"{n:,} from rank-{s:05d}.bin" for s, n in src)
        ax.text(right + w + 0.1, y, f"rows {r0}–{r1 - 1}: {reads}", va="center", fontsize=draw.SMALL,
                color="#000000" if len(src) == 1 else "#D55E00")
    dp, pp, tp = data["saved"]
    ndp, npp, ntp = data["load"]
    ax.text(left, -0.3, f"saved on dp {dp} × pp {pp} × tp {tp}", fontsize=8.5, fontweight="bold")
    ax.text(right, -0.3, f"loaded on dp {ndp} × pp {npp} × tp {ntp}: what each rank reads", fontsize=8.5,
            fontweight="bold")
    ax.set_title(f"Resharding {data['tensor']} {data['shape']} ({data['model']}): each rank reads the "
                 "saved pieces\nits region overlaps, and only those (red: from two files)", loc="left",
                 fontsize=9)
    fig.tight_layout()
    return fig


FIGURES = [
    Figure(name="checkpoint_reshard", path="07_3d/figures/checkpoint_reshard.svg", data=reshard_data,
           draw=reshard_draw,
           sizes={"saved": (2, 2, 2), "load": (1, 1, 8), "model": "small",
                  "tensor": "layers.0.feed_forward.w1.weight"},
           sources=(Source("parallel3d.checkpoint.shard_layout:llama_3d_layout",
                           lambda regions: {k: v for k, v in regions.items() if "feed_forward.w1" not in k}),
                    Source("parallel3d.checkpoint.reshard:overlap_numel", lambda n: n + 1)),
           alt="which saved files each rank of another mesh reads, from the shard layout's regions"),
]
