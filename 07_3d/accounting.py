"""What one rank of the 3D trainer should hold and send, in closed form, from data alone: the
mesh, FSDP's shard layout of each chunk, the schedule and the model config (`Rank3D`). The
trainer prints each beside what it measured (its `formulas` and `report_extras` hooks).

    model states   Σ_units ⌈P_u/d⌉ params and grads (P_u: the unit's TP-local parameters,
                   d = dp·cp, 1 under NO_SHARD); AdamW's m and v (2×) + a step counter per unit
    activations    the peak over the schedule's actions of Σ chunk_activation_bytes over the
                   live (micro-batch, chunk) pairs: forwards whose backward has not run yet
    communication  comm_formulas.comm_bytes_per_step (TP, CP, PP, FSDP, clipping)

Depends only on torch (and chapters 04–06 by package name).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.kernel.mesh import Coordinates, MeshShape, ParallelMesh
from common.kernel.model import LlamaConfig
from common.kernel.optimizer_bytes import optimizer_state_bytes
from fsdp.flat_param import UnitShard
from fsdp.fully_sharded import FullyShardedDataParallel
from parallel3d.memory_model import head_activation_bytes, layer_activation_bytes
from parallel3d.parallelize import Parallel3DConfig
from pipeline.schedules import Schedule
from pipeline.simulator import closed_form_bubble
from tensor_parallel.context_layout import load_balance
from tensor_parallel.expert_parallel import is_expert


@dataclass(frozen=True)
class Rank3D:
    """One rank of the 3D trainer as data: what every closed form below reads."""

    cfg: LlamaConfig
    sizes: MeshShape
    at: Coordinates  # this rank's coordinates
    schedule: Schedule
    chunk_units: tuple[tuple[UnitShard, ...], ...]  # FSDP's units of each chunk (root first)
    chunk_blocks: tuple[int, ...]  # transformer blocks in each chunk
    parallel: Parallel3DConfig
    micro_batch: int
    seq_len: int
    elem: int  # bytes per element of the compute dtype
    clip: bool  # a clipping all-reduce per step
    optimizer: str  # adamw | sgd

    @property
    def units(self) -> tuple[UnitShard, ...]:
        return tuple(u for units in self.chunk_units for u in units)

    @property
    def activation_shape(self) -> tuple[int, int, int]:
        """The [b, s/cp (/tp under SP), h] message between pipeline stages."""
        split = self.sizes.tp if self.parallel.sequence_parallel else 1
        return self.micro_batch, self.seq_len // self.sizes.cp // split, self.cfg.dim


def describe_rank(cfg: LlamaConfig, mesh: ParallelMesh, schedule: Schedule,
                  chunks: list[FullyShardedDataParallel], parallel: Parallel3DConfig, micro_batch: int,
                  seq_len: int, compute_dtype: torch.dtype, clip: bool, optimizer: str) -> Rank3D:
    """The Rank3D of this rank's built chunks."""
    return Rank3D(cfg, mesh.shape, mesh.coordinates, schedule,
                  tuple(tuple(c.shard_layout()) for c in chunks),
                  tuple(len(c.module.layers) for c in chunks), parallel, micro_batch, seq_len,
                  compute_dtype.itemsize, clip, optimizer)


def is_expert_unit(unit: UnitShard) -> bool:
    """A unit of a MoE layer's routed experts (experts.py wraps each GroupedExperts alone)."""
    return bool(unit.params) and all(is_expert(p.name) for p in unit.params)


def state_bytes_formula(units: tuple[UnitShard, ...], optimizer: str) -> dict[str, float]:
    """Params and grads: this rank's flat shards; optimizer: AdamW's m and v (2×) + a step
    counter per unit."""
    shard = sum(u.shard_numel for u in units)
    b = units[0].flat_param.element_size()
    opt = optimizer_state_bytes(optimizer, shard, b, len(units))
    return {"params": shard * b, "grads": shard * b, "optimizer": opt}


def chunk_activation_bytes(r: Rank3D, chunk: int) -> float:
    """One micro-batch's saved activations in chunk `chunk` (memory_model's per-block and head
    counts, chapter 05's terms, on the s/cp tokens of this CP rank; the first stage adds token
    ids, each stage its RoPE tables)."""
    cfg, t, cp, sp = r.cfg, r.sizes.tp, r.sizes.cp, r.parallel.sequence_parallel
    b, seq, e = r.micro_batch, r.seq_len, r.elem
    s = seq // cp
    stage = r.schedule.stage(r.at.pp, chunk)
    total = r.chunk_blocks[chunk] * layer_activation_bytes(
        cfg, b * s, seq, t, sp, r.parallel.activation_checkpointing, e, cp=cp)
    total += s * cfg.head_dim * e  # cos, sin
    if stage == 0:
        total += b * s * (8 + (1 if t > 1 else 0))  # token ids (+ the out-of-range mask)
    if stage == r.schedule.n_stages - 1:
        total += head_activation_bytes(cfg, b * s, seq, t, sp, e, cp=cp)
    return total


def activation_formula(r: Rank3D) -> float:
    """The peak over the schedule of Σ chunk_activation_bytes over the live (micro-batch,
    chunk) pairs: forwards whose backward has not run yet."""
    live, peak = set(), 0.0
    release = "W" if r.schedule.split_backward else "B"  # ZB-H1: the graph lives until W
    for a in r.schedule.actions[r.at.pp]:
        if a.kind in ("F", release):
            (live.add if a.kind == "F" else live.discard)((a.microbatch, a.chunk))
        peak = max(peak, sum(chunk_activation_bytes(r, c) for _, c in live))
    return peak


def memory_formula(r: Rank3D) -> dict[str, float | None]:
    """{params, grads, optimizer, activations_peak} bytes this rank should hold (a MoE model's
    activations depend on its routing: no closed form, None)."""
    activations = None if r.cfg.n_experts else activation_formula(r)
    return {**state_bytes_formula(r.units, r.optimizer), "activations_peak": activations}


def schedule_extras(r: Rank3D) -> dict:
    """The report's description of the layout, with the pipeline's closed-form bubble and, under
    CP, the zig-zag layout's load balance."""
    s = r.schedule
    return {"schedule": s.name, "microbatches": s.m, "virtual_stages": s.v,
            "sequence_parallel": r.parallel.sequence_parallel,
            "sharding_strategy": r.parallel.sharding_strategy,
            "activation_checkpointing": r.parallel.activation_checkpointing,
            "bubble_formula": float(closed_form_bubble(s.name, s.p, s.m, s.v)),
            **({"cp_load_balance": load_balance(r.seq_len, r.sizes.cp)} if r.sizes.cp > 1 else {})}


def memory_per_rank(mesh: ParallelMesh, memory: dict[str, int]) -> list[dict]:
    """Every rank's coordinates and measured params / optimizer bytes, on every rank (a
    collective over the world: `all_gather_object`)."""
    at = mesh.coordinates
    mine = {"rank": mesh.rank, "dp": at.dp, "pp": at.pp, "cp": at.cp, "tp": at.tp, "ep": at.ep,
            "params": memory["params"], "optimizer": memory["optimizer"]}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out
