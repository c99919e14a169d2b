"""Which region of each LLaMA tensor a rank of a dp × pp × tp mesh holds (Megatron TP, FSDP flat
shards over DP, a pipeline stage's layers): the picture behind loading mesh A's checkpoint on
mesh B, and the layouts the checkpoint tests and benchmark save and load.

    rank = (pp_rank · dp + dp_rank) · tp + tp_rank          TP innermost, then DP, PP outermost
    stage s holds layers [s·L/pp, (s+1)·L/pp), the embedding (s = 0), norm and output (s = pp−1)
    TP:   column-parallel (rows split): wq wk wv w1 w3, tok_embeddings (vocab), output (vocab)
          row-parallel (columns split): wo w2          replicated: the RMSNorm weights
          a size that t does not divide is padded: the last box reaches past the end;
          K/V with n_kv_heads < t: each head is held by t / n_kv_heads consecutive ranks
    FSDP: per unit (each block; the stage's other tensors), the TP-local tensors flattened and
          concatenated, padded to a multiple of dp; dp rank r keeps [r·S, (r+1)·S), S = ⌈P_u/dp⌉

        wq [o, i] at tp=2, dp=2:  tp rank 0: rows [0, o/2)     ─ flattened into the unit's flat ─┐
                                  tp rank 1: rows [o/2, o)                                        │
        dp rank 0 of tp rank 0 keeps the first half of that flat: some of wq's rows, maybe a part row

Depends only on torch (and on a config with LLaMA's fields: dim, n_layers, n_heads, n_kv_heads,
vocab_size, hidden_dim).
"""

from __future__ import annotations

from .reshard import Region

COLUMN = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
          "feed_forward.w1.weight", "feed_forward.w3.weight")
ROW = ("attention.wo.weight", "feed_forward.w2.weight")


def llama_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The reference model's parameter names and shapes (common.kernel.model.Llama), in module order."""
    hd = cfg.dim // cfg.n_heads
    block = {"attention_norm.weight": (cfg.dim,),
             "attention.wq.weight": (cfg.n_heads * hd, cfg.dim),
             "attention.wk.weight": (cfg.n_kv_heads * hd, cfg.dim),
             "attention.wv.weight": (cfg.n_kv_heads * hd, cfg.dim),
             "attention.wo.weight": (cfg.dim, cfg.n_heads * hd),
             "ffn_norm.weight": (cfg.dim,),
             "feed_forward.w1.weight": (cfg.hidden_dim, cfg.dim),
             "feed_forward.w2.weight": (cfg.dim, cfg.hidden_dim),
             "feed_forward.w3.weight": (cfg.hidden_dim, cfg.dim)}
    shapes = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim)}
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in block.items()})
    shapes.update({"norm.weight": (cfg.dim,), "output.weight": (cfg.vocab_size, cfg.dim)})
    return shapes


def tp_box(name: str, shape: tuple[int, ...], cfg, tp: int, tp_rank: int) -> Region:
    """The (possibly padded) box of `name` that TP rank `tp_rank` of `tp` holds."""
    suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if suffix in ROW:
        dim, shards = 1, tp
    elif suffix in COLUMN or suffix in ("tok_embeddings.weight", "output.weight"):
        dim, shards = 0, tp
        if suffix in ("attention.wk.weight", "attention.wv.weight"):
            shards = min(tp, cfg.n_kv_heads)  # fewer K/V heads than ranks: replicate each head
    else:
        return Region.full(shape)
    index = tp_rank // (tp // shards)
    size = -(-shape[dim] // shards)
    offsets, box = [0] * len(shape), list(shape)
    offsets[dim], box[dim] = index * size, size
    return Region.box(shape, offsets, box)


def stage_names(cfg, pp: int, stage: int) -> list[list[str]]:
    """The FSDP units of pipeline stage `stage`: one per block, then the rest (the root unit)."""
    shapes = llama_shapes(cfg)
    per = cfg.n_layers // pp
    layers = range(stage * per, (stage + 1) * per)
    units = [[n for n in shapes if n.startswith(f"layers.{i}.")] for i in layers]
    root = (["tok_embeddings.weight"] if stage == 0 else []) + \
           (["norm.weight", "output.weight"] if stage == pp - 1 else [])
    return units + ([root] if root else [])


def check_mesh(cfg, dp: int, pp: int, tp: int) -> str | None:
    """Why this layout cannot split `cfg` on the mesh, or None."""
    if cfg.n_layers % pp:
        return f"n_layers {cfg.n_layers} is not divisible by pp {pp}"
    if cfg.n_heads % tp:
        return f"n_heads {cfg.n_heads} is not divisible by tp {tp}"
    kv = cfg.n_kv_heads
    if (kv % tp if kv >= tp else tp % kv):
        return f"n_kv_heads {kv} and tp {tp}: one must divide the other"
    return None


def llama_3d_layout(cfg, dp: int, pp: int, tp: int, rank: int) -> dict[str, Region]:
    """{name: region} this rank holds (names of tensors it holds nothing of are absent)."""
    if (problem := check_mesh(cfg, dp, pp, tp)) is not None:
        raise ValueError(f"mesh dp={dp} pp={pp} tp={tp}: {problem}")
    tp_rank, dp_rank, stage = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    shapes = llama_shapes(cfg)
    out: dict[str, Region] = {}
    for unit in stage_names(cfg, pp, stage):
        boxes = {n: tp_box(n, shapes[n], cfg, tp, tp_rank) for n in unit}
        flat = sum(b.numel for b in boxes.values())
        shard = -(-flat // dp)
        lo, hi = dp_rank * shard, (dp_rank + 1) * shard
        start = 0
        for name, box in boxes.items():
            a, b = max(lo, start), min(hi, start + box.numel)
            if a < b:
                out[name] = Region(box.global_shape, box.offsets, box.box_shape, a - start, b - a)
            start += box.numel
    return out


def mesh_regions(cfg, dp: int, pp: int, tp: int) -> list[dict[str, Region]]:
    """Every rank's layout, rank order."""
    return [llama_3d_layout(cfg, dp, pp, tp, r) for r in range(dp * pp * tp)]
