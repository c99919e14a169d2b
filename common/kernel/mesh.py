"""One mesh for every chapter: a parallel layout's frozen shape, the rank lists of its groups
(pure functions of the shape), and the one builder of its process groups.

    world = pp × dp_replicate × dp_shard × cp × tp            dp = dp_replicate × dp_shard
    rank  = (((p·R + r)·S + s)·C + c)·T + t                    TP innermost, then CP, the shard
                                                               half of DP, its replicate half, PP

    world 8 = dp_replicate 2 × dp_shard 2 × tp 2 (pp 1, cp 1)
        tp            {0,1} {2,3} {4,5} {6,7}       an all-reduce per layer: one node's NVLink
        dp_shard      {0,2} {1,3} {4,6} {5,7}       FSDP's gathers and reduce-scatters, in a node
        dp_replicate  {0,4} {1,5} {2,6} {3,7}       HSDP's all-reduce of each shard, across nodes
        dp            {0,2,4,6} {1,3,5,7}           every data-parallel rank: the gradient average

TP is the chattiest dimension, so its ranks are neighbours; CP passes K/V once per attention;
FSDP's traffic hides behind compute; HSDP sends only each shard's all-reduce across nodes; PP
sends activations between stages and tolerates the slowest links (Megatron's and torchtitan's
order). CP ranks hold the same parameters (each sees other tokens of the same rows), so FSDP
shards over `dp_shard_cp` and gradients are averaged over `dp_cp`.

Expert parallelism borrows its ranks from dp_shard × cp (as torchtitan and Megatron do): a rank's
index j = s·C + c is cut into consecutive blocks of ep, e = j mod ep its expert slice, k = j div ep
its block. An EP group is ep neighbours at stride T (one node whenever ep·T divides it), so the
all-to-alls of every MoE layer stay inside a node; never ranks strided across the replica, where
the numbers are the same and every all-to-all crosses the network.

    world 8 = dp_shard 4 × tp 2, ep 2:   ep {0,2} {1,3} {4,6} {5,7}   expert_dp {0,4} {1,5} {2,6} {3,7}

`torch.distributed.new_group` is collective over the world and must be called in the same order
on every rank: `build_mesh` creates every line of every dimension asked for, in LINES' order, on
every rank (a line whose members an earlier line has reuses that group). `mesh_shape` refuses a
bad layout before any of it, from the world size alone, so every rank refuses it alike. Not
torch's DeviceMesh (`init_device_mesh`): our own names, for our own layout. Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch.distributed as dist


class MeshError(ValueError):
    """A layout that does not fit: the message names the values and the fix."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class MeshShape:
    """The sizes of every dimension, outermost first (the order of the rank formula above)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # borrowed from dp_shard × cp: not a factor of the world

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise MeshError(f"{f.name} {getattr(self, f.name)}: every mesh size must be >= 1")
        if (self.dp_shard * self.cp) % self.ep:
            raise MeshError(f"ep {self.ep} does not divide dp_shard × cp = {self.dp_shard * self.cp} (expert "
                            f"parallelism borrows those ranks): use one of ep "
                            f"{', '.join(map(str, _divisors(self.dp_shard * self.cp)))}")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def as_dict(self) -> dict[str, int]:
        """The report's "mesh": dp (or its two halves under HSDP), pp, tp; cp and ep where > 1."""
        dp = ({"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard} if self.dp_replicate > 1
              else {"dp": self.dp})
        return {**dp, "pp": self.pp, **({"cp": self.cp} if self.cp > 1 else {}), "tp": self.tp,
                **({"ep": self.ep} if self.ep > 1 else {})}


def mesh_shape(world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1, *,
               dp_replicate: int | None = None, dp_shard: int | None = None, ep: int = 1,
               n_experts: int | None = None) -> MeshShape:
    """The shape of a world of `world_size` ranks, every bad combination refused (MeshError naming
    the flags, the values and the fix) from the sizes alone: call it on every rank before any
    collective. dp = world / (pp·cp·tp) when omitted; dp_replicate = 1 and dp_shard = dp unless
    given; ep must divide dp_shard·cp and, given `n_experts`, the experts."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--cp", cp), ("--dp", dp), ("--ep", ep),
                        ("--dp-replicate", dp_replicate), ("--dp-shard", dp_shard)):
        if value is not None and value < 1:
            raise MeshError(f"{flag} {value}: must be >= 1")
    rest = pp * cp * tp
    named = f"--pp {pp} × --cp {cp} × --tp {tp}" if cp > 1 else f"--pp {pp} × --tp {tp}"
    halves = dp is None and dp_replicate is not None and dp_shard is not None
    if halves:
        dp = dp_replicate * dp_shard
    if dp is None:
        if world_size % rest:
            raise MeshError(
                f"world size {world_size} is not divisible by {named} = {rest}: launch a multiple "
                f"of {rest} ranks, or choose sizes whose product divides {world_size}")
        dp = world_size // rest
    if dp * rest != world_size:
        given = f"--dp-replicate {dp_replicate} × --dp-shard {dp_shard}" if halves else f"--dp {dp}"
        raise MeshError(
            f"{given} × {named} = {dp * rest} != world size {world_size}: launch {dp * rest} "
            f"ranks, or omit {'one of the two' if halves else '--dp'} to infer it"
            + (f" (dp would be {world_size // rest})" if world_size % rest == 0 else ""))
    replicate = dp_replicate or (dp // dp_shard if dp_shard else 1)
    shard = dp_shard or dp // replicate
    if replicate * shard != dp:
        pairs = " or ".join(f"--dp-replicate {d} --dp-shard {dp // d}" for d in _divisors(dp)[:4])
        raise MeshError(f"--dp-replicate {replicate} × --dp-shard {shard} = {replicate * shard} != "
                        f"dp {dp}: the two halves of data parallelism multiply to dp; use {pairs}")
    borrowed = shard * cp
    fits = [d for d in _divisors(borrowed) if n_experts is None or n_experts % d == 0]
    fix = f"use one of --ep {', '.join(map(str, fits))}"
    if borrowed % ep:
        raise MeshError(f"--ep {ep} does not divide the {borrowed} ranks it borrows (dp_shard {shard} × "
                        f"cp {cp}: EP groups are consecutive ranks of one replica): {fix}")
    if n_experts is not None and n_experts % ep:
        raise MeshError(f"--ep {ep} does not divide the {n_experts} experts (each rank holds "
                        f"n_experts/ep of them): {fix}")
    return MeshShape(pp, replicate, shard, cp, tp, ep)


class Coordinates(NamedTuple):
    """A rank's index along every dimension; dp = r·S + s (its data shard), ep = j mod ep and
    dp_shard_mod_ep = j div ep for j = s·C + c (its expert slice and its block of EP ranks)."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    dp: int
    ep: int
    dp_shard_mod_ep: int


def coordinates(rank: int, shape: MeshShape) -> Coordinates:
    """Where global rank `rank` sits on the mesh."""
    t, rest = rank % shape.tp, rank // shape.tp
    c, rest = rest % shape.cp, rest // shape.cp
    s, rest = rest % shape.dp_shard, rest // shape.dp_shard
    r, p = rest % shape.dp_replicate, rest // shape.dp_replicate
    j = s * shape.cp + c
    return Coordinates(p, r, s, c, t, r * shape.dp_shard + s, j % shape.ep, j // shape.ep)


def global_rank(at: Coordinates, shape: MeshShape) -> int:
    """The rank at `at` (read from pp, dp_replicate, dp_shard, cp, tp)."""
    return (((at.pp * shape.dp_replicate + at.dp_replicate) * shape.dp_shard + at.dp_shard) * shape.cp
            + at.cp) * shape.tp + at.tp


# every dimension, in creation order: the coordinates its lines hold fixed (its members vary the rest)
LINES: dict[str, tuple[str, ...]] = {
    "tp": ("pp", "dp_replicate", "dp_shard", "cp"),
    "cp": ("pp", "dp_replicate", "dp_shard", "tp"),
    "ep": ("pp", "dp_replicate", "dp_shard_mod_ep", "tp"),  # the all-to-all's ranks
    "dp_shard": ("pp", "dp_replicate", "cp", "tp"),
    "dp_shard_cp": ("pp", "dp_replicate", "tp"),  # what FSDP shards over (HSDP's shard group)
    "dp_replicate": ("pp", "dp_shard", "cp", "tp"),  # HSDP's replicate group
    "dp": ("pp", "cp", "tp"),
    "dp_cp": ("pp", "tp"),  # every rank holding the same parameters: the gradient average
    "dp_shard_mod_ep": ("pp", "dp_replicate", "ep", "tp"),  # the same experts in one replica
    "expert_dp": ("pp", "ep", "tp"),  # every rank holding the same experts
    "pp": ("dp_replicate", "dp_shard", "cp", "tp"),
}


def group_ranks(shape: MeshShape, dims: Iterable[str] | None = None) -> dict[str, list[list[int]]]:
    """Every line of every dimension (or of `dims`) as sorted lists of global ranks, in creation
    order; each rank is on exactly one line of each dimension."""
    everyone = [coordinates(rank, shape) for rank in range(shape.world)]
    out = {}
    for dim in _dims(dims):
        lines: dict[tuple[int, ...], list[int]] = {}
        for rank, at in enumerate(everyone):  # rank order: each line comes out sorted
            lines.setdefault(tuple(getattr(at, f) for f in LINES[dim]), []).append(rank)
        out[dim] = [lines[key] for key in sorted(lines)]
    return out


def _dims(dims: Iterable[str] | None) -> list[str]:
    if dims is None:
        return list(LINES)
    wanted = set(dims)
    if unknown := wanted - set(LINES):
        raise MeshError(f"unknown mesh dimension(s) {sorted(unknown)}: use {', '.join(LINES)}")
    return [d for d in LINES if d in wanted]  # LINES' order, whatever order they were asked in


@dataclass(frozen=True)
class ParallelMesh:
    """This rank's place on the mesh and the process group of each of its lines."""

    shape: MeshShape
    rank: int
    groups: dict[str, object] = field(default_factory=dict)  # dim → this rank's ProcessGroup
    ranks: dict[str, list[int]] = field(default_factory=dict)  # dim → the members of its line

    @property
    def coordinates(self) -> Coordinates:
        return coordinates(self.rank, self.shape)

    def group(self, dim: str):
        if dim not in self.groups:
            raise MeshError(f"the mesh was built without its {dim!r} groups: pass it in build_mesh's dims")
        return self.groups[dim]

    # sizes and this rank's coordinates, by name
    size = property(lambda self: self.shape.world)
    dp = property(lambda self: self.shape.dp)
    pp = property(lambda self: self.shape.pp)
    cp = property(lambda self: self.shape.cp)
    tp = property(lambda self: self.shape.tp)
    ep = property(lambda self: self.shape.ep)
    dp_rank = property(lambda self: self.coordinates.dp)
    pp_rank = property(lambda self: self.coordinates.pp)
    cp_rank = property(lambda self: self.coordinates.cp)
    tp_rank = property(lambda self: self.coordinates.tp)
    ep_rank = property(lambda self: self.coordinates.ep)
    # the groups the chapters use most
    tp_group = property(lambda self: self.group("tp"))
    cp_group = property(lambda self: self.group("cp"))
    ep_group = property(lambda self: self.group("ep"))
    dp_group = property(lambda self: self.group("dp"))
    dp_cp_group = property(lambda self: self.group("dp_cp"))
    pp_group = property(lambda self: self.group("pp"))

    def as_dict(self) -> dict[str, int]:
        return self.shape.as_dict()


def build_mesh(shape: MeshShape, dims: Iterable[str] | None = None, backend: str | None = None
               ) -> ParallelMesh:
    """Create the groups of every dimension (or of `dims`) on every rank, in LINES' order, and
    return this rank's mesh. A collective: every rank calls it with the same shape and dims. The
    world must be the shape's (refused, on every rank alike, before the first group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if shape.world != world:
        raise MeshError(f"the mesh {shape.as_dict()} has {shape.world} ranks, the world {world}: "
                        "build its shape with mesh_shape(world_size, ...)")
    mesh, created = ParallelMesh(shape, rank), {}
    for dim, lines in group_ranks(shape, dims).items():
        for members in lines:
            key = tuple(members)
            if key not in created:
                created[key] = dist.new_group(members, backend=backend)
            if rank in members:
                mesh.groups[dim], mesh.ranks[dim] = created[key], members
    return mesh
