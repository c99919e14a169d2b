"""The bytes one rank of the 3D trainer puts on the wire per step, in closed form over its mesh
position and its schedule's action list (nccl-tests conventions: all-reduce 2(n-1)/n·S,
all-gather / reduce-scatter (n-1)/n·S, send S).

TP (t ranks), per block and micro-batch, activations a = b·s·h·e (s = the whole sequence):
    no SP   forward 2 all-reduces (after wo, w2), backward 2 (before wq|wk|wv, w1|w3)   4 · 2(t-1)/t · a
    SP      forward 2 all-gathers + 2 reduce-scatters, backward the same                8 · (t-1)/t · a
            + the two SP norms' weight gradients: 2 all-reduces of h·e (backward)
    recomputation reruns the forward collectives up to the last saved tensor: full +1 all-reduce
    (SP: +2 all-gathers +1 reduce-scatter), selective +0 (SP: +1 all-gather)
    embedding (first stage) g forward (SP: reduce-scatter, all-gather backward), head (last
    stage) f backward (SP: all-gather forward, reduce-scatter backward, + the final norm's
    weight gradient); the vocab-parallel loss: MAX of N and SUM of 2N numbers, N = b·s
PP: one message [b, s(/t under SP), h] per F of a stage < S-1 and per B of a stage > 0.
DP (FSDP, d ranks), per unit with P_u TP-local parameters padded to d·⌈P_u/d⌉:
    all-gather (d-1)/d·P_u·b_param at each unshard: FULL_SHARD blocks twice per micro-batch
    (forward, backward); a root unit and SHARD_GRAD_OP blocks once per stretch of forwards and
    once per backward that follows a backward (each backward frees every unit at its end);
    reduce-scatter (d-1)/d·P_u·b_reduce after each micro-batch's backward (NO_SHARD: all-reduce)
Clipping: one all-reduce of a scalar over the world.
"""

from __future__ import annotations

import math

import torch

# Forward collectives a recomputed block runs again, (all-gathers or f's, reduce-scatters or g's).
# Non-reentrant torch.utils.checkpoint stops recomputing once every saved tensor is back, so the
# region's last row-parallel reduction (its output is not saved) is not rerun.
RECOMPUTED = {"none": (0, 0), "selective": (1, 0), "full": (2, 1)}


def ring(n: int, factor: float = 1.0) -> float:
    return factor * (n - 1) / n if n > 1 else 0.0


def tp_bytes_per_microbatch(cfg, t: int, b: int, s: int, e: int, sp: bool, recompute: str,
                            n_blocks: int, first: bool, last: bool, logit_bytes: int) -> float:
    """Wire bytes of one micro-batch's forward + backward through a chunk's TP regions."""
    if t == 1:
        return 0.0
    a, h = b * s * cfg.dim * e, cfg.dim
    gathers, reductions = RECOMPUTED[recompute]
    if sp:  # all-gathers and reduce-scatters: 4 each, plus the recomputed ones
        block = ring(t, 4 + gathers) * a + ring(t, 4 + reductions) * a + 2 * ring(t, 2) * h * e
    else:  # the g's all-reduce forward, the f's backward
        block = (4 + reductions) * ring(t, 2) * a
    if cfg.n_kv_heads < t:  # replicated K/V heads: wk, wv gradients summed over their copies in
        # one all-reduce over the TP group of a buffer shaped like the full tensor
        block += 2 * ring(t, 2) * cfg.n_kv_heads * cfg.head_dim * h * e
    total = n_blocks * block
    if first:  # g, or SP's reduce-scatter forward + all-gather backward: the same bytes
        total += ring(t, 2) * a
    if last:  # f, or SP's all-gather forward + reduce-scatter backward + the norm's weight grad
        total += ring(t, 2) * a + (ring(t, 2) * h * e if sp else 0.0)
        total += ring(t, 2) * 3 * b * s * logit_bytes  # loss: MAX of N, SUM of 2N
    return total


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


def comm_bytes_per_step(strategy, steps: int) -> float:
    """Per rank over `steps` steps: TP + PP + FSDP + clipping (see the module doc)."""
    args, cfg, sched, mesh = strategy.args, strategy.cfg, strategy.schedule, strategy.mesh3d
    t, d, rank = mesh.tp, mesh.dp, mesh.pp_rank
    b, e = strategy.layout.micro_batch, strategy.compute_dtype.itemsize
    logit_bytes = max(e, 4)
    total = 0.0
    actions = sched.actions[rank]
    for c, chunk in enumerate(strategy.chunks):
        stage = sched.stage(rank, c)
        mine = [a for a in actions if a.chunk == c]
        n_blocks = len(chunk.module.layers)
        per_mb = tp_bytes_per_microbatch(cfg, t, b, args.seq_len, e, strategy.sp,
                                         args.activation_checkpointing, n_blocks, stage == 0,
                                         stage == sched.n_stages - 1, logit_bytes)
        total += sched.m * per_mb
        backwards = sum(a.kind == "B" for a in mine)  # = W's under ZB: one reduction each
        backward = "W" if sched.split_backward and stage == 0 else "B"
        ends = (("W",) if stage == 0 else ("B", "W")) if sched.split_backward else ("B",)
        for unit in chunk.units():
            h = unit._handle
            if h is None:
                continue
            full_shard = strategy.sharding.name == "FULL_SHARD"
            if h.shard_world > 1:
                gathers = fsdp_gathers(mine, unit is chunk, full_shard, backward, ends)
                total += gathers * ring(d) * h.padded * h.param_dtype.itemsize
                total += backwards * ring(d) * h.padded * h.reduce_dtype.itemsize
            elif d > 1:
                total += backwards * ring(d, 2) * h.padded * h.reduce_dtype.itemsize
    message = math.prod(strategy.activation_shape) * e
    total += message * sum(sched.send(rank, a) is not None for a in actions)
    if strategy.clip_grad is not None:
        world = mesh.dp * mesh.pp * mesh.tp
        sq_bytes = 8 if strategy.handles()[0].flat_param.dtype == torch.float64 else 4
        total += ring(world, 2) * sq_bytes
    return steps * total
