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
DP (FSDP over the dp·c ranks of a (pp, tp) position, d = dp·c), per unit with P_u TP-local
    parameters padded to d·⌈P_u/d⌉ (chapter 04's `fsdp.formulas.unit_comm_bytes`; the count of
    unshards per schedule is this file's):
    all-gather (d-1)/d·P_u·b_param at each unshard: FULL_SHARD blocks twice per micro-batch
    (forward, backward); a root unit and SHARD_GRAD_OP blocks once per stretch of forwards and
    once per backward that follows a backward (each backward frees every unit at its end);
    reduce-scatter (d-1)/d·P_u·b_reduce after each micro-batch's backward (NO_SHARD: all-reduce)
Clipping: one all-reduce of a scalar over the world.
"""

from __future__ import annotations

import math

import torch

from fsdp.formulas import unit_comm_bytes, unit_traffic
from fsdp.wrap import ShardingStrategy
from parallel3d.accounting import Rank3D
from parallel3d.memory_model import RECOMPUTED
from tensor_parallel.formulas import Shape, cp_comm_bytes, microbatch_comm_bytes


def ring(n: int, factor: float = 1.0) -> float:
    return factor * (n - 1) / n if n > 1 else 0.0


def tp_bytes_per_microbatch(cfg, t: int, b: int, s: int, e: int, sp: bool, recompute: str,
                            n_blocks: int, first: bool, last: bool) -> float:
    """Wire bytes of one micro-batch's forward + backward through a chunk's TP regions: chapter
    05's count for its blocks, embedding (first stage) and head (last), + the recomputed ones."""
    x = Shape(b=b, s=s, h=cfg.dim, a=cfg.n_heads, kv=cfg.n_kv_heads, F=cfg.hidden_dim, L=n_blocks,
              V=cfg.vocab_size, head_dim=cfg.head_dim, t=t, sequence_parallel=sp, e=e)
    gathers, reductions = RECOMPUTED[recompute]
    a = b * s * cfg.dim * e
    rerun = (ring(t, gathers) + ring(t, reductions)) * a if sp else reductions * ring(t, 2) * a
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


def comm_bytes_per_step(r: Rank3D, steps: int) -> float:
    """Per rank over `steps` steps: TP + CP + PP + FSDP + clipping (see the module doc)."""
    cfg, sched, par = r.cfg, r.schedule, r.parallel
    t, d, rank = r.sizes.tp, r.sizes.dp * r.sizes.cp, r.at.pp
    s, b, e = r.seq_len // r.sizes.cp, r.micro_batch, r.elem
    total = 0.0
    actions = sched.actions[rank]
    sharding = ShardingStrategy[par.sharding_strategy]
    full_shard = sharding == ShardingStrategy.FULL_SHARD
    for c, units in enumerate(r.chunk_units):
        stage = sched.stage(rank, c)
        mine = [a for a in actions if a.chunk == c]
        per_mb = tp_bytes_per_microbatch(cfg, t, b, s, e, par.sequence_parallel,
                                         par.activation_checkpointing, r.chunk_blocks[c], stage == 0,
                                         stage == sched.n_stages - 1)
        total += sched.m * per_mb
        backwards = sum(a.kind == "B" for a in mine)  # = W's under ZB: one reduction each
        backward = "W" if sched.split_backward and stage == 0 else "B"
        ends = (("W",) if stage == 0 else ("B", "W")) if sched.split_backward else ("B",)
        for unit in unit_traffic(units):  # chapter 04's per-unit formula
            gathers = fsdp_gathers(mine, unit.is_root, full_shard, backward, ends)
            total += unit_comm_bytes(unit, d, sharding, gathers, backwards)
    total += cp_bytes_per_step(r, 1)
    message = math.prod(r.activation_shape) * e
    total += message * sum(sched.send(rank, a) is not None for a in actions)
    if r.clip:
        sq_bytes = 8 if r.units[0].flat_param.dtype == torch.float64 else 4
        total += ring(r.sizes.world, 2) * sq_bytes
    return steps * total
