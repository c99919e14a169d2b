"""What each GPU holds under a layout: the model states of the stages its pipeline rank holds
and the activations of the micro-batches it keeps in flight, for a dense model or a mixture of
experts, on the busiest rank. Pure arithmetic over `memory_model` (states), `saved` (what a block
keeps per token) and `pipeline` (which stages, how many micro-batches).

    states       a rank's units (one per block, the embedding and head roots; an MoE's E/ep
                 experts per block apart) under ZeRO (`memory_model.state_bytes`): the dense
                 units over the dp·cp ranks holding them, the experts over dp·cp/ep; DualPipe's
                 two copies of a stage (ranks r and p-1-r) are data-parallel replicas of each
                 other, so its ZeRO group is twice as large; ZeRO-3 keeps two gathered blocks
    activations  Σ over the rank's stages of (micro-batches in flight) × (that stage's blocks ×
                 tokens × `block_saved_terms`, + the head on the last stage), + one block's full
                 activations while a recomputation reruns it
"""

from __future__ import annotations

from dataclasses import fields
from functools import cache

from common.kernel.model import LlamaConfig
from parallel3d.memory_model import (
    ACT_BYTES,
    PRECISIONS,
    Layout,
    local_tokens,
    stage_layers,
    stage_units,
    state_bytes,
)
from parallel3d.planner.moe import ExpertFFN, MoEShape, check_ep, moe_stage_units
from parallel3d.planner.pipeline import check_schedule, in_flight, rank_stages
from parallel3d.planner.saved import block_saved_terms


@cache
def units_by_stage(cfg: LlamaConfig, moe: MoEShape | None, tp: int, pp: int, ep: int
                   ) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Per stage, (the units sharded over dp·cp, the expert units sharded over dp·cp/ep)."""
    if moe is None:
        return tuple((units, ()) for units in stage_units(cfg, tp, pp))
    return moe_stage_units(cfg, moe, tp, pp, ep)


def copies(layout: Layout) -> int:
    """Ranks of one pipeline that hold each stage: 2 under DualPipe, else 1."""
    return 2 if layout.schedule == "dualpipe" else 1


def ffn_view(cfg: LlamaConfig, width: int) -> LlamaConfig:
    """`cfg` with a SwiGLU `width` wide: an MoE block as one token sees it (k + S experts)."""
    return ExpertFFN(**{f.name: getattr(cfg, f.name) for f in fields(LlamaConfig)}, ffn=width)


def block_bytes(cfg: LlamaConfig, moe: MoEShape | None, layout: Layout, seq_len: int, elem: float,
                act_bytes: float | None, eager_attention: bool, recompute: str
                ) -> tuple[float, float]:
    """(a dense block's, an MoE block's) saved bytes for one micro-batch on one rank."""
    tokens = local_tokens(layout, seq_len)
    args = dict(seq_len=seq_len, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                recompute=recompute, elem=elem, act_bytes=act_bytes, eager_attention=eager_attention)
    dense = tokens * sum(block_saved_terms(cfg, **args).values())
    if moe is None:
        return dense, dense
    view = ffn_view(cfg, (moe.top_k + moe.n_shared_experts) * moe.moe_hidden_dim)
    return dense, tokens * sum(block_saved_terms(view, routed=moe.top_k, **args).values())


def head_bytes(cfg: LlamaConfig, layout: Layout, seq_len: int, elem: float, act_bytes: float | None
               ) -> float:
    """The last stage's final norm (input, 1/rms), the head's input (cached like a linear
    input) and the loss's softmax over the local vocabulary (float32 or wider), per micro-batch."""
    t, c = layout.tp, elem if act_bytes is None else act_bytes
    local = 1 / t if layout.sequence_parallel else 1
    rows = -(-cfg.vocab_size // t)
    per_token = (cfg.dim * elem + elem) * local + cfg.dim * local * c + rows * max(elem, 4) + 9
    return local_tokens(layout, seq_len) * per_token


def memory_per_gpu(cfg: LlamaConfig, layout: Layout, seq_len: int, microbatches: int,
                   precision: str = "mixed", eager_attention: bool = False,
                   moe: MoEShape | None = None, act_bytes: float | None = None) -> dict[str, float]:
    """{weights, grads, optimizer, activations, total} bytes on the busiest pipeline rank's GPU
    (the module docstring); `act_bytes`: the element size the linear layers cache their inputs
    in (None: the compute dtype's)."""
    if moe is not None:
        check_ep(moe, layout)
    check_schedule(layout.schedule, layout.pp, microbatches, layout.virtual_stages)
    elem, w = ACT_BYTES[precision], PRECISIONS[precision][0]
    stages = units_by_stage(cfg, moe, layout.tp, layout.pp, layout.ep)
    layers = stage_layers(cfg.n_layers, layout.pp)
    first_moe = cfg.n_layers if moe is None else moe.first_dense_layers
    dense, expert = block_bytes(cfg, moe, layout, seq_len, elem, act_bytes, eager_attention,
                                layout.recompute)
    transient = 0.0 if layout.recompute == "none" else max(block_bytes(
        cfg, moe, layout, seq_len, elem, act_bytes, eager_attention, "none"))
    head = head_bytes(cfg, layout, seq_len, elem, act_bytes)

    def stage_activations(i: int) -> float:
        start = sum(layers[:i])
        blocks = range(start, start + layers[i])
        one = sum(expert if b >= first_moe else dense for b in blocks)
        return one + (head if i == layout.pp - 1 else 0.0)

    group, best, previous = layout.shards * copies(layout), None, None
    for rank in range(layout.pp):
        held = in_flight(layout.schedule, layout.pp, microbatches, layout.virtual_stages, rank)
        signature = tuple((stages[i], layers[i]) for i in sorted(held))
        if rank == layout.pp - layout.pp // 2 and layout.schedule == "dualpipe":
            break  # ranks p-1-r mirror ranks r: the same stages, the same counts
        if signature == previous and rank != layout.pp - 1:
            continue  # an earlier rank holds the same stages and at least as many micro-batches
        previous = signature
        blocks = tuple(u for i in held for u in stages[i][0][:layers[i]])
        units = tuple(u for i in held for u in stages[i][0])
        experts = tuple(u for i in held for u in stages[i][1])
        out = state_bytes(units, group, layout.zero, precision)
        for k, v in state_bytes(experts, group // layout.ep, layout.zero, precision).items():
            out[k] += v
        if layout.zero >= 3 and group > 1:  # two gathered blocks: the one computing, the prefetched
            out["weights"] += 2 * (max(blocks, default=0) + max(experts, default=0)) * w
        out["activations"] = sum(n * stage_activations(i) for i, n in held.items()) + transient
        out["total"] = sum(out.values())
        best = out if best is None or out["total"] > best["total"] else best
    return best


def dp_groups(cfg: LlamaConfig, moe: MoEShape | None, layout: Layout) -> list[tuple[int, int, int]]:
    """(parameters per GPU, ranks they are sharded and reduced over, the GPUs between two of
    those ranks) on the rank holding the most: its dense units over dp·cp (× 2 under DualPipe:
    the mirror copy), stride t; its experts over that / ep, stride t·ep."""
    stages = units_by_stage(cfg, moe, layout.tp, layout.pp, layout.ep)
    n = layout.shards * copies(layout)
    held = [rank_stages(layout.schedule, layout.pp, r) for r in range(layout.pp)]
    units, experts = max(((sum(sum(stages[i][0]) for i in h), sum(sum(stages[i][1]) for i in h))
                          for h in held), key=sum)
    groups = [(units, n, layout.tp)]
    return groups + ([(experts, n // layout.ep, layout.tp * layout.ep)] if experts else [])
