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
its block (`dp_shard_mod_ep`). An EP group is ep neighbours at stride T (one node whenever ep·T
divides it), so the all-to-alls of every MoE layer stay inside a node; never ranks strided across
the replica, where the numbers are the same and every all-to-all crosses the network.

    world 8 = dp_shard 4 × tp 2, ep 2:   ep {0,2} {1,3} {4,6} {5,7}   expert_dp {0,4} {1,5} {2,6} {3,7}

The registry. MeshShape's fields are the dimensions, in the rank formula's order: a plain field
is a factor of the world, a `borrowed` one cuts consecutive factors (ep: dp_shard × cp into
dp_shard_mod_ep × ep). LINES names each group by the coordinates that vary along it; its members
share every other coordinate of the same factorization. Everything else (coordinates, the lines'
rank lists, the refusals, the report's sizes, build_mesh) is derived from those two, so a new
dimension is two edits here. Ulysses inside the ring (cp = r × u, u consecutive CP ranks):

    cp_ulysses: int = borrowed("cp", rest="cp_ring")          in MeshShape
    "cp_ulysses": ("cp_ulysses",), "cp_ring": ("cp_ring",)    in LINES (the all-to-all's, the ring's)

(tests/test_mesh.py makes exactly these two edits and checks the lines they give.)

`torch.distributed.new_group` is collective over the world and must be called in the same order
on every rank: `build_mesh` creates every line of every dimension asked for, in LINES' order, on
every rank (a line whose members an earlier line has reuses that group). `mesh_shape` refuses a
bad layout before any of it, from the world size alone, so every rank refuses it alike. Not
torch's DeviceMesh (`init_device_mesh`): our own names, for our own layout. Depends only on torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any

import torch.distributed as dist


class MeshError(ValueError):
    """A layout that does not fit: the message names the values and the fix."""


def borrowed(*span: str, rest: str) -> Any:
    """A MeshShape field that is not a factor of the world: it cuts the consecutive factors
    `span`, flattened to j, into its own coordinate j mod size and `rest` = j div size."""
    return field(default=1, metadata={"span": span, "rest": rest})


@dataclass(frozen=True)
class MeshShape:
    """The sizes of every dimension, outermost first (the order of the rank formula above)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = borrowed("dp_shard", "cp", rest="dp_shard_mod_ep")

    def __post_init__(self) -> None:
        for name, size in self.sizes().items():
            if size < 1:
                raise MeshError(f"{name} {size}: every mesh size must be >= 1")
        for name, (span, _) in _registry(type(self)).borrowed.items():
            if self.size(*span) % getattr(self, name):
                raise MeshError(f"{name} {getattr(self, name)} does not divide {' × '.join(span)} = "
                                f"{self.size(*span)} (it borrows those ranks): use one of {name} "
                                f"{', '.join(map(str, _divisors(self.size(*span))))}")

    def sizes(self) -> dict[str, int]:
        """Every dimension's size, in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def size(self, *names: str) -> int:
        """The product of the sizes of `names`: factors, borrowed dimensions, their rests, lines."""
        registry, out = _registry(type(self)), 1
        for name in names:
            if name in registry.fields:
                out *= getattr(self, name)
            elif name in registry.rests:
                span, dim = registry.rests[name]
                out *= self.size(*span) // getattr(self, dim)
            elif name in LINES:
                out *= self.size(*LINES[name])
            else:
                raise MeshError(f"unknown mesh dimension {name!r}: use one of {', '.join(registry.names)}")
        return out

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.size(*_registry(type(self)).factors)

    def as_dict(self) -> dict[str, int]:
        """The report's "mesh": dp (its two halves under HSDP), then every other dimension of more
        than one rank, in field order."""
        dp = ({"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard} if self.dp_replicate > 1
              else {"dp": self.dp})
        return {**dp, **{n: v for n, v in self.sizes().items() if n not in _HALVES and v > 1}}


@dataclass(frozen=True)
class _Registry:
    """What a shape class's fields declare: the world's factors (outermost first), each borrowed
    dimension's span and rest, and every coordinate's name."""

    fields: frozenset[str]
    factors: tuple[str, ...]
    borrowed: dict[str, tuple[tuple[str, ...], str]]  # dimension → (the factors it cuts, its rest)
    rests: dict[str, tuple[tuple[str, ...], str]]  # rest → (the factors, the dimension)

    @property
    def names(self) -> list[str]:
        return [*self.factors, *self.borrowed, *self.rests]


@cache
def _registry(cls: type) -> _Registry:
    borrowed = {f.name: (f.metadata["span"], f.metadata["rest"]) for f in fields(cls) if "span" in f.metadata}
    return _Registry(frozenset(f.name for f in fields(cls)),
                     tuple(f.name for f in fields(cls) if "span" not in f.metadata), borrowed,
                     {rest: (span, dim) for dim, (span, rest) in borrowed.items()})


_HALVES = ("dp_replicate", "dp_shard")  # dp's two halves: mesh_shape infers them, the report joins them


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def mesh_shape(world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1, *,
               dp_replicate: int | None = None, dp_shard: int | None = None, n_experts: int | None = None,
               **sizes: int) -> MeshShape:
    """The shape of a world of `world_size` ranks, every bad combination refused (MeshError naming
    the flags, the values and the fix) from the sizes alone: call it on every rank before any
    collective. dp = world / (the other factors) when omitted; dp_replicate = 1 and dp_shard = dp
    unless given; `sizes` names any other dimension (ep=N: a borrowed one must divide the ranks it
    borrows and, given `n_experts`, ep the experts)."""
    known = {f.name for f in fields(MeshShape)}
    if unknown := set(sizes) - known:
        raise MeshError(f"unknown mesh dimension(s) {sorted(unknown)}: use {', '.join(sorted(known))}")
    given = {"tp": tp, "pp": pp, "cp": cp, **sizes}
    for name, value in {**given, "dp": dp, "dp_replicate": dp_replicate, "dp_shard": dp_shard}.items():
        if value is not None and value < 1:
            raise MeshError(f"{_flag(name)} {value}: must be >= 1")
    others = [n for n in _registry(MeshShape).factors if n not in _HALVES]
    rest = math.prod(given.get(n, 1) for n in others)
    named = [f"{_flag(n)} {given.get(n, 1)}" for n in others if given.get(n, 1) > 1]
    halves = dp is None and dp_replicate is not None and dp_shard is not None
    if halves:
        dp = dp_replicate * dp_shard
    if dp is None:
        if world_size % rest:
            raise MeshError(
                f"world size {world_size} is not divisible by {' × '.join(named)}"
                + (f" = {rest}" if len(named) > 1 else "") + f": launch a multiple of {rest} ranks, or "
                f"choose sizes whose product divides {world_size}")
        dp = world_size // rest
    if dp * rest != world_size:
        dp_named = f"--dp-replicate {dp_replicate} × --dp-shard {dp_shard}" if halves else f"--dp {dp}"
        raise MeshError(
            f"{' × '.join([dp_named, *named])} = {dp * rest} != world size {world_size}: launch "
            f"{dp * rest} ranks, or omit {'one of the two' if halves else '--dp'} to infer it"
            + (f" (dp would be {world_size // rest})" if world_size % rest == 0 else ""))
    replicate = dp_replicate or (dp // dp_shard if dp_shard else 1)
    shard = dp_shard or dp // replicate
    if replicate * shard != dp:
        pairs = " or ".join(f"--dp-replicate {d} --dp-shard {dp // d}" for d in _divisors(dp)[:4])
        raise MeshError(f"--dp-replicate {replicate} × --dp-shard {shard} = {replicate * shard} != "
                        f"dp {dp}: the two halves of data parallelism multiply to dp; use {pairs}")
    resolved = {**given, "dp_replicate": replicate, "dp_shard": shard}
    for name, (span, _) in _registry(MeshShape).borrowed.items():
        size, ranks = given.get(name, 1), math.prod(resolved[n] for n in span)
        whole = n_experts if name == "ep" else None  # each rank holds n_experts/ep of the experts
        fix = (f"use one of {_flag(name)} "
               f"{', '.join(str(d) for d in _divisors(ranks) if whole is None or whole % d == 0)}")
        if ranks % size:
            raise MeshError(f"{_flag(name)} {size} does not divide the {ranks} ranks it borrows ("
                            f"{' × '.join(f'{n} {resolved[n]}' for n in span)}: its groups are consecutive "
                            f"ranks of one replica): {fix}")
        if whole is not None and whole % size:
            raise MeshError(f"{_flag(name)} {size} does not divide the {whole} experts (each rank holds "
                            f"n_experts/{name} of them): {fix}")
    return MeshShape(**resolved)


# every group, in creation order, named by the coordinates that vary along it (its members share
# every other coordinate of the world's factors, or of the factorization a borrowed dimension makes)
LINES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "ep": ("ep",),  # the all-to-all's ranks
    "dp_shard": ("dp_shard",),
    "dp_shard_cp": ("dp_shard", "cp"),  # what FSDP shards over (HSDP's shard group)
    "dp_replicate": ("dp_replicate",),  # HSDP's replicate group
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # every rank holding the same parameters: the average
    "dp_shard_mod_ep": ("dp_shard_mod_ep",),  # the same experts in one replica
    "expert_dp": ("dp_replicate", "dp_shard_mod_ep"),  # every rank holding the same experts
    "pp": ("pp",),
}


class Coordinates(dict):
    """A rank's index along every factor, borrowed dimension and rest, and within every line
    (at.dp = r·S + s, its data shard; at.ep = j mod ep, its expert slice), by name or attribute."""

    def __getattr__(self, name: str) -> int:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def replace(self, **changes: int) -> Coordinates:
        return Coordinates({**self, **changes})


@cache
def _factorization(cls: type, varying: tuple[str, ...]) -> tuple[str, ...]:
    """The factors of the world, outermost first, that a line varying `varying` lives in: the
    world's own, with the span of each borrowed dimension it names cut into (rest, dimension)."""
    view = list(_registry(cls).factors)
    for dim, (span, rest) in _registry(cls).borrowed.items():
        if {dim, rest} & set(varying):
            at = view.index(span[0]) if span[0] in view else None
            if at is None or tuple(view[at:at + len(span)]) != span:
                raise MeshError(f"a line varying {varying} cuts {span} twice")
            view[at:at + len(span)] = [rest, dim]
    if missing := set(varying) - set(view):
        raise MeshError(f"a line varying {varying}: {sorted(missing)} not in one factorization {view}")
    return tuple(view)


def coordinates(rank: int, shape: MeshShape) -> Coordinates:
    """Where global rank `rank` sits on the mesh."""
    cls, digits = type(shape), {}
    for name in reversed(_registry(cls).factors):  # the rank formula, read from the inside out
        digits[name], rank = rank % getattr(shape, name), rank // getattr(shape, name)
    at = Coordinates({name: digits[name] for name in _registry(cls).factors})
    for dim, (span, rest) in _registry(cls).borrowed.items():
        j = _index(at, span, shape)
        at[dim], at[rest] = j % getattr(shape, dim), j // getattr(shape, dim)
    for line, varying in LINES.items():
        at[line] = _index(at, [n for n in _factorization(cls, varying) if n in varying], shape)
    return at


def _index(at: dict[str, int], names: Iterable[str], shape: MeshShape) -> int:
    """The mixed-radix index of `at` over `names`, outermost first."""
    j = 0
    for name in names:
        j = j * shape.size(name) + at[name]
    return j


def global_rank(at: dict[str, int], shape: MeshShape) -> int:
    """The rank at `at` (read from the world's factors)."""
    return _index(at, _registry(type(shape)).factors, shape)


def group_ranks(shape: MeshShape, dims: Iterable[str] | None = None) -> dict[str, list[list[int]]]:
    """Every line of every dimension (or of `dims`) as sorted lists of global ranks, in creation
    order; each rank is on exactly one line of each dimension."""
    everyone = [coordinates(rank, shape) for rank in range(shape.world)]
    out = {}
    for dim in _dims(dims):
        varying = LINES[dim]
        fixed = [n for n in _factorization(type(shape), varying) if n not in varying]
        lines: dict[tuple[int, ...], list[int]] = {}
        for rank, at in enumerate(everyone):  # rank order: each line comes out sorted
            lines.setdefault(tuple(at[n] for n in fixed), []).append(rank)
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

    # sizes and this rank's coordinates, by name (any other: shape.size(dim), coordinates[dim])
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
