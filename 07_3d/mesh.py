"""The device mesh: world = pp × dp × cp × tp, TP innermost, then CP, DP, PP outermost.

    rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank

    world 8 = pp 2 × dp 2 × tp 2 (cp 1)   TP groups (NVLink, every layer):   {0,1} {2,3} {4,5} {6,7}
                                          DP groups (FSDP, once per unit):   {0,2} {1,3} {4,6} {5,7}
        pp 0: dp 0: [0 1]  dp 1: [2 3]    PP groups (send/recv, per micro-batch):  {0,4} {1,5} {2,6} {3,7}
        pp 1: dp 0: [4 5]  dp 1: [6 7]

    world 8 = pp 2 × cp 2 × tp 2 (dp 1)   TP groups: {0,1} {2,3} {4,5} {6,7}
        pp 0: cp 0: [0 1]  cp 1: [2 3]    CP groups (K/V ring, every attention): {0,2} {1,3} {4,6} {5,7}
        pp 1: cp 0: [4 5]  cp 1: [6 7]    DP×CP groups (FSDP shards over them): = the CP groups here
                                          PP groups: {0,4} {1,5} {2,6} {3,7}

TP is the chattiest dimension (an all-reduce per layer on the critical path), so its ranks are
neighbours (one node's NVLink domain); CP passes K/V blocks once per attention, overlapped with
the attention of the block before; DP traffic hides behind compute; PP sends only the activations
between stages and tolerates the slowest links (Megatron's and torchtitan's order). The CP ranks
of a replica hold the same parameters (each sees other tokens of the same rows), so FSDP shards
over the dp × cp ranks that share a (pp, tp) position: the `dp_cp` line.
`torch.distributed.new_group` is collective over the world and must be called in the same order
on every rank, so every rank creates every line of every dimension, TP, CP, DP, DP×CP, then PP
(a line whose members an earlier line already has reuses that group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch.distributed as dist


class MeshError(ValueError):
    """A mesh that does not fit the world: the message names the values and the fix."""


class Coordinates(NamedTuple):
    dp: int
    pp: int
    cp: int
    tp: int


def mesh_shape(world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1
               ) -> Coordinates:
    """(dp, pp, cp, tp) sizes with their product == world_size; dp = world / (pp·cp·tp) when omitted."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--cp", cp), ("--dp", dp)):
        if value is not None and value < 1:
            raise MeshError(f"{flag} {value}: must be >= 1")
    rest = pp * cp * tp
    named = f"--pp {pp} × --cp {cp} × --tp {tp}" if cp > 1 else f"--pp {pp} × --tp {tp}"
    if dp is None:
        if world_size % rest:
            raise MeshError(
                f"world size {world_size} is not divisible by {named} = {rest}: launch a multiple "
                f"of {rest} ranks, or choose sizes whose product divides {world_size}")
        dp = world_size // rest
    if dp * rest != world_size:
        raise MeshError(
            f"--dp {dp} × {named} = {dp * rest} != world size {world_size}: launch {dp * rest} "
            "ranks, or omit --dp to infer it"
            + (f" (it would be {world_size // rest})" if world_size % rest == 0 else ""))
    return Coordinates(dp, pp, cp, tp)


def coordinates(rank: int, dp: int, pp: int, tp: int, cp: int = 1) -> Coordinates:
    """(dp_rank, pp_rank, cp_rank, tp_rank) of a global rank."""
    return Coordinates((rank // (tp * cp)) % dp, rank // (tp * cp * dp), (rank // tp) % cp, rank % tp)


def global_rank(at: Coordinates, shape: Coordinates) -> int:
    """The rank at coordinates `at` of a mesh of sizes `shape`."""
    return ((at.pp * shape.dp + at.dp) * shape.cp + at.cp) * shape.tp + at.tp


def group_ranks(dp: int, pp: int, tp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """Every line of every dimension as lists of global ranks, in creation order (tp, cp, dp,
    dp_cp, pp); `dp_cp`: the dp × cp ranks of one (pp, tp) position, FSDP's group."""
    shape = Coordinates(dp, pp, cp, tp)
    everyone = [Coordinates(d, p, c, t) for p in range(pp) for d in range(dp) for c in range(cp)
                for t in range(tp)]

    def lines(varying: tuple[str, ...]) -> list[list[int]]:
        fixed = [f for f in ("pp", "dp", "cp", "tp") if f not in varying]  # outermost first
        out: dict[tuple[int, ...], list[int]] = {}
        for at in everyone:  # rank order, so each line's members come out sorted
            out.setdefault(tuple(getattr(at, f) for f in fixed), []).append(global_rank(at, shape))
        return [out[k] for k in sorted(out)]

    return {"tp": lines(("tp",)), "cp": lines(("cp",)), "dp": lines(("dp",)),
            "dp_cp": lines(("dp", "cp")), "pp": lines(("pp",))}


@dataclass
class ParallelMesh:
    """This rank's place on the mesh (pp × dp × cp × tp: the three dimensions of 3D parallelism
    and CP as a fourth) and the process group of each of its lines. Not torch's DeviceMesh: our
    own name, for our own layout."""

    dp: int
    pp: int
    tp: int
    rank: int
    cp: int = 1
    groups: dict[str, object] = field(default_factory=dict)   # "tp" | "cp" | "dp" | "dp_cp" | "pp"
    ranks: dict[str, list[int]] = field(default_factory=dict)  # the members of this rank's lines

    @property
    def coordinates(self) -> Coordinates:
        return coordinates(self.rank, self.dp, self.pp, self.tp, self.cp)

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def dp_rank(self) -> int:
        return self.coordinates.dp

    @property
    def pp_rank(self) -> int:
        return self.coordinates.pp

    @property
    def cp_rank(self) -> int:
        return self.coordinates.cp

    @property
    def tp_rank(self) -> int:
        return self.coordinates.tp

    @property
    def tp_group(self):
        return self.groups["tp"]

    @property
    def cp_group(self):
        return self.groups["cp"]

    @property
    def dp_group(self):
        return self.groups["dp"]

    @property
    def dp_cp_group(self):
        return self.groups["dp_cp"]

    @property
    def pp_group(self):
        return self.groups["pp"]

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, **({"cp": self.cp} if self.cp > 1 else {}), "tp": self.tp}


def build_mesh(tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1,
               backend: str | None = None) -> ParallelMesh:
    """Create every TP, CP, DP, DP×CP and PP group (collective: every rank calls it with the same
    sizes) and return this rank's mesh; dp = world / (pp·cp·tp) when omitted. (torch's
    `init_device_mesh(device_type, mesh_shape, mesh_dim_names=...)` builds a torch DeviceMesh;
    this builds ours, in the order above.)"""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, pp, cp, tp = mesh_shape(world, tp, pp, dp, cp)
    mesh = ParallelMesh(dp, pp, tp, rank, cp)
    created: dict[tuple[int, ...], object] = {}
    for dim, lines in group_ranks(dp, pp, tp, cp).items():
        for members in lines:
            key = tuple(members)
            if key not in created:
                created[key] = dist.new_group(members, backend=backend)
            if rank in members:
                mesh.groups[dim], mesh.ranks[dim] = created[key], members
    return mesh
