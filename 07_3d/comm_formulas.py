"""The bytes one rank of the 3D trainer puts on the wire per step, in closed form over its mesh
position and its schedule's action list (nccl-tests conventions: all-reduce 2(n-1)/n·S,
all-gather / reduce-scatter (n-1)/n·S, send S).

TP (t ranks), per micro-batch: chapter 05's `microbatch_comm_bytes` for the chunk's blocks, its
    embedding (first stage) and head + vocab-parallel loss (last stage), on the s/c tokens of a
    CP rank, plus what recomputation reruns: the forward collectives up to the last saved tensor,
    per block, a = b·(s/c)·h·e:
    full +1 all-reduce (SP: +2 all-gathers +1 reduce-scatter), selective (core attention) +0
CP (c ranks), per block per micro-batch: chapter 05's `cp_comm_bytes` of the ring with this
    rank's K/V heads (n_kv/t, at least 1): (c-1) K/V blocks [2, b, kv, s/c, head_dim] forward,
    (c-1) K/V and (c-1) dK/dV blocks backward, + the forward's again when recomputation reruns
    the attention (full or selective)
PP: one message [b, s/c (/t under SP), h] per F of a stage < S-1 and per B of a stage > 0.
DP (FSDP over the d = dp_shard·c ranks of a (pp, tp) position and replica), per unit with P_u
    TP-local parameters padded to d·⌈P_u/d⌉ (chapter 04's `fsdp.formulas.unit_comm_bytes_by_group`;
    the count of unshards per schedule is this file's):
    all-gather (d-1)/d·P_u·b_param at each unshard: FULL_SHARD (HYBRID_SHARD) blocks twice per
    micro-batch (forward, backward); a root unit and SHARD_GRAD_OP blocks once per stretch of
    forwards and once per backward that follows a backward (each backward frees every unit);
    reduce-scatter (d-1)/d·P_u·b_reduce after each micro-batch's backward (NO_SHARD: all-reduce);
    HSDP: + the all-reduce of each reduced shard over the r = dp_replicate replicas, 2(r-1)/r·P_u/d·b
Experts (MoE, experts.py): each MoE layer's experts are a unit of their own over dp_shard_mod_ep
    (d/ep ranks), the same terms with d/ep; under full recomputation, gathered once more per
    backward (the block's recomputed forward runs their unit again). The block's TP regions as a
    dense block's, + the router's weight-gradient all-reduce per micro-batch, less SP's backward
    re-gather before the SwiGLU (05's moe_block_extra_bytes). EP's all-to-alls depend on the
    routing: experts.all_to_all_formula.
Clipping: one all-reduce of a scalar over the world.

`comm_bytes_by_dim` splits the total by the mesh dimension whose group carries each term (tp, cp,
pp, dp_shard: FSDP's dp_shard × cp, dp_shard_mod_ep, dp_replicate, world): the report prints each
beside the meter's bytes over that group.
"""

from __future__ import annotations

import math

import torch

from common.kernel.comm_bytes import ring_fraction
from fsdp.formulas import unit_comm_bytes_by_group, unit_traffic
from fsdp.wrap import ShardingStrategy, reshards_after_forward
from parallel3d.accounting import Rank3D, is_expert_unit
from parallel3d.memory_model import RECOMPUTED
from pipeline.stage import layer_partition
from tensor_parallel.formulas import Shape, cp_comm_bytes, microbatch_comm_bytes
from tensor_parallel.moe_tensor_parallel import moe_block_extra_bytes

DIMS = ("tp", "cp", "pp", "dp_shard", "dp_shard_mod_ep", "dp_replicate", "world")


def tp_bytes_per_microbatch(cfg, t: int, b: int, s: int, e: int, sp: bool, recompute: str,
                            n_blocks: int, first: bool, last: bool) -> float:
    """Wire bytes of one micro-batch's forward + backward through a chunk's TP regions: chapter
    05's count for its blocks, embedding (first stage) and head (last), + the recomputed ones."""
    x = Shape(b=b, s=s, h=cfg.dim, a=cfg.n_heads, kv=cfg.n_kv_heads, F=cfg.hidden_dim, L=n_blocks,
              V=cfg.vocab_size, head_dim=cfg.head_dim, t=t, sequence_parallel=sp, e=e)
    gathers, reductions = RECOMPUTED[recompute]
    a = b * s * cfg.dim * e
    if sp:
        rerun = (ring_fraction(t, gathers) + ring_fraction(t, reductions)) * a
    else:
        rerun = reductions * ring_fraction(t, 2) * a
    return microbatch_comm_bytes(x, embedding=first, head=last) + n_blocks * rerun


def cp_bytes_per_microbatch(cfg, t: int, c: int, b: int, s: int, e: int, recompute: str,
                            n_blocks: int) -> float:
    """Wire bytes of one micro-batch's forward + backward through a chunk's ring attentions."""
    if c == 1:
        return 0.0
    terms = cp_comm_bytes(b, s, max(1, cfg.n_kv_heads // t), cfg.head_dim, c, e)
    rerun = terms["forward K/V"] if recompute in ("full", "selective") else 0.0
    return n_blocks * (sum(terms.values()) + rerun)


def cp_bytes_per_step(r: Rank3D, steps: int) -> float:
    """Per rank over `steps` steps: the CP ring's point-to-point sends, every micro-batch through
    every block of this rank's chunks."""
    return steps * r.schedule.m * cp_bytes_per_microbatch(
        r.cfg, r.sizes.tp, r.sizes.cp, r.micro_batch, r.seq_len, r.elem,
        r.parallel.activation_checkpointing, sum(r.chunk_blocks))


def fsdp_gathers(actions, root: bool, full_shard: bool, backward: str = "B",
                 ends: tuple[str, ...] = ("B",)) -> int:
    """Unshards of one unit of a chunk over the step's actions (F/B/W of that chunk, in order).
    `backward`: the action whose backward call gathers the weights (ZB-H1: B, but W on stage 0,
    where B computes nothing; W from the caught dY's needs no weights); `ends`: the actions that
    end with a backward call, which frees every unit (ZB-H1 stages > 0: B and W)."""
    if full_shard and not root:
        return sum(a.kind in ("F", backward) for a in actions)
    count, gathered = 0, False
    for a in actions:
        if not gathered and a.kind in ("F", backward):
            count, gathered = count + 1, True
        if a.kind in ends:
            gathered = False  # the end of a backward call frees every unit
    return count


def comm_bytes_by_dim(r: Rank3D, steps: int) -> dict[str, float]:
    """Per rank over `steps` steps, by the dimension whose group carries it (see the module doc)."""
    cfg, sched, par, sizes = r.cfg, r.schedule, r.parallel, r.sizes
    t, d, rank = sizes.tp, sizes.dp_shard * sizes.cp, r.at.pp
    s, b, e = r.seq_len // sizes.cp, r.micro_batch, r.elem
    out = dict.fromkeys(DIMS, 0.0)
    actions = sched.actions[rank]
    sharding = ShardingStrategy[par.sharding_strategy]
    full_shard = reshards_after_forward(sharding)
    rerun = full_shard and par.activation_checkpointing == "full"  # experts gathered again
    layers = layer_partition(cfg.n_layers, sched.n_stages)
    for c, units in enumerate(r.chunk_units):
        stage = sched.stage(rank, c)
        mine = [a for a in actions if a.chunk == c]
        per_mb = tp_bytes_per_microbatch(cfg, t, b, s, e, par.sequence_parallel,
                                         par.activation_checkpointing, r.chunk_blocks[c], stage == 0,
                                         stage == sched.n_stages - 1)
        moe_blocks = sum(cfg.is_moe_layer(i) for i in layers[stage])
        x = Shape(b=b, s=s, h=cfg.dim, a=cfg.n_heads, kv=cfg.n_kv_heads, F=cfg.hidden_dim, L=1,
                  V=cfg.vocab_size, head_dim=cfg.head_dim, t=t, sequence_parallel=par.sequence_parallel, e=e)
        out["tp"] += sched.m * (per_mb + moe_blocks * moe_block_extra_bytes(x, cfg.n_experts))
        backwards = sum(a.kind == "B" for a in mine)  # = W's under ZB: one reduction each
        backward = "W" if sched.split_backward and stage == 0 else "B"
        ends = (("W",) if stage == 0 else ("B", "W")) if sched.split_backward else ("B",)
        for unit, traffic in zip(units, unit_traffic(units), strict=True):  # chapter 04's per-unit formula
            expert = is_expert_unit(unit)
            gathers = fsdp_gathers(mine, traffic.is_root, full_shard, backward, ends)
            gathers += backwards if expert and rerun else 0
            intra, inter = unit_comm_bytes_by_group(traffic, d // sizes.ep if expert else d, sharding,
                                                    gathers, backwards, sizes.dp_replicate)
            out["dp_shard_mod_ep" if expert else "dp_shard"] += intra
            out["dp_replicate"] += inter
    out["cp"] += cp_bytes_per_step(r, 1)
    message = math.prod(r.activation_shape) * e
    out["pp"] += message * sum(sched.send(rank, a) is not None for a in actions)
    if r.clip:
        sq_bytes = 8 if r.units[0].flat_param.dtype == torch.float64 else 4
        out["world"] += ring_fraction(sizes.world, 2) * sq_bytes
    return {k: steps * v for k, v in out.items()}


def comm_bytes_per_step(r: Rank3D, steps: int) -> float:
    """Per rank over `steps` steps: TP + CP + PP + FSDP (HSDP, experts) + clipping (see the module
    doc), without EP's all-to-alls."""
    return sum(comm_bytes_by_dim(r, steps).values())


# each term's dimension → the mesh line whose process group carries it (dp_shard: FSDP's dp_shard × cp)
GROUP_OF = {"tp": "tp", "cp": "cp", "pp": "pp", "dp_shard": "dp_shard_cp",
            "dp_shard_mod_ep": "dp_shard_mod_ep", "dp_replicate": "dp_replicate", "ep": "ep"}


def group_labels(ranks: dict[str, list[int]], experts: bool) -> dict[str, str]:
    """{label: mesh line} for this rank's lines of more than one rank (ep and dp_shard_mod_ep only
    with `experts`), one label per distinct group: dimensions whose lines coincide (ep = dp_shard
    when ep takes all of it) share one, "dp_shard/ep"."""
    out: dict[tuple[int, ...], tuple[list[str], str]] = {}
    for dim, line in GROUP_OF.items():
        if len(ranks[line]) > 1 and (experts or dim not in ("ep", "dp_shard_mod_ep")):
            out.setdefault(tuple(ranks[line]), ([], line))[0].append(dim)
    return {"/".join(dims): line for dims, line in out.values()}


def formulas_by_group(by_dim: dict[str, float], ranks: dict[str, list[int]], world: int,
                      experts: bool) -> dict[str, float]:
    """{label: formula} for each of `group_labels`: the sum of the terms whose group has its ranks
    (the meter counts a group by its ranks; the world's clipping lands on a line that spans it)."""
    members = {dim: tuple(range(world)) if dim == "world" else tuple(ranks[GROUP_OF[dim]]) for dim in by_dim}
    return {label: sum(v for dim, v in by_dim.items() if members[dim] == tuple(ranks[line]))
            for label, line in group_labels(ranks, experts).items()}
