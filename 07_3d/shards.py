"""Which elements of which reference tensor this rank holds: one description, computed once from
FSDP's shard layout (04), the TP specs (05) and the mesh, read by clipping (clip.py), checkpoints
(checkpoint/trainer.py) and `--check` (`gather_full`).

Per FSDP unit of its chunks a rank holds one flat shard:

    flat  = cat(TP-local tensor of each name in the unit) ++ padding            (FSDP, 04)
    shard = flat[r·S : (r+1)·S]                       r = rank in the unit's dp × cp group
    TP-local tensor of `name` = the box at offset i·local[dim] along dim of the full tensor,
                                i = tp_rank // copies                           (05's TPShard)

so each name's overlap with [r·S, (r+1)·S) is a flat range of a TP box: one `Region`
(checkpoint/reshard.py), a `HeldPiece`. Under expert parallelism an expert tensor's box also
starts at its EP slice along dim 0 (`EPSlice`: experts [e·E/ep, (e+1)·E/ep)), and its unit is
sharded over dp_shard_mod_ep, the ranks of one replica holding the same experts. A piece is
*counted* on exactly one of the ranks that hold the same elements, so a sum over the world (a
norm, a gather) meets every element once:

    FSDP-sharded unit       shards disjoint over its shard group:  counted on dp_replicate 0
    NO_SHARD unit           replicated over its group:  counted on its group's rank 0 (dp·cp index
                            j = s·C + c; an expert unit: j div ep, its place among the same experts)
    HSDP                    every shard again on each dp_replicate: counted on dp_replicate 0
    TP-replicated tensor    the same piece on `copies` ranks:  counted where tp_rank % copies = 0
    (pipeline stages hold disjoint layers, EP ranks disjoint experts: nothing to exclude)

Depends only on torch (and chapters 04, 05 by package name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.kernel.mesh import ParallelMesh
from fsdp.flat_param import UnitShard
from fsdp.fully_sharded import FullyShardedDataParallel
from parallel3d.checkpoint.reshard import Region, copy_overlap
from parallel3d.recompute import unwrapped_name
from tensor_parallel.sharding import TPShard


@dataclass(frozen=True)
class EPSlice:
    """An expert tensor under expert parallelism: this rank holds rows [start, start + rows) of
    its dim 0 (its experts) of the `full` rows (E)."""

    start: int
    full: int


@dataclass(frozen=True)
class HeldPiece:
    """Elements [start, start + region.numel) of unit `unit`'s flat shard hold `region` of the
    reference tensor `name`; `counted`: this rank's copy is the one a global sum takes."""

    name: str
    unit: int
    start: int
    region: Region
    counted: bool


@dataclass(frozen=True)
class ShardMap:
    """This rank's FSDP units (every chunk's, in order) and every piece of a reference tensor
    they hold."""

    units: tuple[UnitShard, ...]
    pieces: tuple[HeldPiece, ...]

    def piece_of(self, piece: HeldPiece, tensor_of: Callable[[UnitShard], torch.Tensor | None]
                 ) -> torch.Tensor | None:
        """`piece`'s elements of a flat-shard-shaped tensor (the shard, its gradient, an
        optimizer state), as a 1-d view."""
        flat = tensor_of(self.units[piece.unit])
        return None if flat is None else flat.detach()[piece.start : piece.start + piece.region.numel]


def shard_map(chunks: Sequence[FullyShardedDataParallel], tp_specs: dict[str, TPShard],
              mesh: ParallelMesh, ep_slices: dict[str, EPSlice] | None = None) -> ShardMap:
    """The ShardMap of this rank's FSDP-wrapped chunks (parallelize_3d's result; `ep_slices`: the
    expert tensors' EP slices, experts.expert_slices). No collective."""
    units = tuple(u for chunk in chunks for u in chunk.shard_layout())
    ep_slices = ep_slices or {}
    pieces = []
    for i, unit in enumerate(units):
        for p in unit.params:
            if not p.numel:
                continue
            name = unwrapped_name(p.name)
            spec, ep = tp_specs[name], ep_slices.get(name)
            counted = first_holder(unit, mesh, ep is not None) and mesh.tp_rank % spec.copies == 0
            region = tp_region(spec, tuple(p.shape), mesh.tp_rank, p.offset, p.numel, ep)
            pieces.append(HeldPiece(name, i, p.shard_offset, region, counted))
    return ShardMap(units, tuple(pieces))


def holder_index(mesh: ParallelMesh, expert: bool) -> int:
    """This rank's place among the ranks of one replica that hold the same (pp, tp) parameters:
    its dp_shard·cp index j = s·C + c, or for an expert unit j div ep (dp_shard_mod_ep)."""
    at = mesh.coordinates
    return at.dp_shard_mod_ep if expert else at.dp_shard_cp


def first_holder(unit: UnitShard, mesh: ParallelMesh, expert: bool) -> bool:
    """Whether this rank's copy of `unit`'s shard is the one a sum over the world counts: on the
    first replica (dp_replicate 0), and for an unsharded unit on the first rank of its group."""
    return mesh.coordinates.dp_replicate == 0 and (unit.shard_world > 1 or holder_index(mesh, expert) == 0)


def tp_region(spec: TPShard, local_shape: tuple[int, ...], tp_rank: int, flat_start: int,
              numel: int, ep: EPSlice | None = None) -> Region:
    """Elements [flat_start, flat_start + numel) of the TP-local tensor (shape `local_shape`)
    of TP rank `tp_rank`, placed in the full tensor: its box starts at piece tp_rank // copies
    along the split dim (the last box may reach into the padding), and at `ep.start` along dim 0
    for an expert tensor."""
    offsets, full = [0] * len(local_shape), list(local_shape)
    if not spec.replicated:
        offsets[spec.dim] = (tp_rank // spec.copies) * local_shape[spec.dim]
        full[spec.dim] = spec.full_size
    if ep is not None:
        offsets[0], full[0] = ep.start, ep.full
    return Region(tuple(full), tuple(offsets), local_shape, flat_start, numel)


def gather_full(shards: ShardMap, tensor_of: Callable[[UnitShard], torch.Tensor | None],
                dst: int = 0) -> dict[str, torch.Tensor] | None:
    """{reference name: full tensor} on global rank `dst` (None elsewhere) from every rank's
    counted pieces of `tensor_of(unit)` (the flat shard, or its `.grad`), on CPU. A collective
    over the world (`gather_object`): for `--check` and small models."""
    mine = [(p.name, p.region, piece.cpu()) for p in shards.pieces
            if p.counted and (piece := shards.piece_of(p, tensor_of)) is not None]
    rank = dist.get_rank()
    parts = [None] * dist.get_world_size() if rank == dst else None
    dist.gather_object(mine, parts, dst=dst)
    return assemble(piece for part in parts for piece in part) if rank == dst else None


def assemble(pieces: Iterable[tuple[str, Region, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from (name, region, values) pieces; raises unless every element of every
    tensor arrives exactly once (a piece missing, or counted on two ranks)."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[str, tuple[torch.Tensor, list[int]]] = {}
    for name, region, values in pieces:
        if name not in out:
            out[name] = values.new_zeros(region.global_shape)
            seen[name] = (torch.zeros(region.global_shape, dtype=torch.bool), [0])
        whole = Region.full(region.global_shape)
        hit, copied = seen[name]
        copied[0] += copy_overlap(out[name].view(-1), whole, values, region)
        copy_overlap(hit.view(-1), whole, torch.ones(region.numel, dtype=torch.bool), region)
    for name, (hit, (copied,)) in seen.items():
        if copied != hit.numel() or not hit.all():
            raise RuntimeError(f"{name}: the counted pieces cover {int(hit.sum())} of its {hit.numel()} "
                               f"elements with {copied} copies: each must be counted on one rank")
    return out
