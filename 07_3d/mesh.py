"""The 3D device mesh: world = pp × dp × tp, TP innermost, then DP, PP outermost.

    rank = (pp_rank · dp + dp_rank) · tp + tp_rank

    world 8 = pp 2 × dp 2 × tp 2          TP groups (NVLink, every layer):   {0,1} {2,3} {4,5} {6,7}
                                          DP groups (FSDP, once per unit):   {0,2} {1,3} {4,6} {5,7}
        pp 0: dp 0: [0 1]  dp 1: [2 3]    PP groups (send/recv, per micro-batch):  {0,4} {1,5} {2,6} {3,7}
        pp 1: dp 0: [4 5]  dp 1: [6 7]

TP is the chattiest dimension (an all-reduce per layer on the critical path), so its ranks are
neighbours (one node's NVLink domain); DP traffic hides behind compute; PP sends only the
activations between stages and tolerates the slowest links (Megatron's and torchtitan's order).
`torch.distributed.new_group` is collective over the world and must be called in the same order
on every rank, so every rank creates every line of every dimension, TP first, then DP, then PP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


class MeshError(ValueError):
    """A mesh that does not fit the world: the message names the values and the fix."""


def mesh_shape(world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None) -> tuple[int, int, int]:
    """(dp, pp, tp) with dp · pp · tp == world_size; dp = world / (pp · tp) when omitted."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--dp", dp)):
        if value is not None and value < 1:
            raise MeshError(f"{flag} {value}: must be >= 1")
    if dp is None:
        if world_size % (pp * tp):
            raise MeshError(
                f"world size {world_size} is not divisible by --pp {pp} × --tp {tp} = {pp * tp}: "
                f"launch a multiple of {pp * tp} ranks, or choose --pp/--tp whose product divides "
                f"{world_size}")
        dp = world_size // (pp * tp)
    if dp * pp * tp != world_size:
        raise MeshError(
            f"--dp {dp} × --pp {pp} × --tp {tp} = {dp * pp * tp} != world size {world_size}: "
            f"launch {dp * pp * tp} ranks, or omit --dp to infer it"
            + (f" (it would be {world_size // (pp * tp)})" if world_size % (pp * tp) == 0 else ""))
    return dp, pp, tp


def coordinates(rank: int, dp: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(dp_rank, pp_rank, tp_rank) of a global rank."""
    return (rank // tp) % dp, rank // (tp * dp), rank % tp


def global_rank(dp_rank: int, pp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def group_ranks(dp: int, pp: int, tp: int) -> dict[str, list[list[int]]]:
    """Every line of every dimension as lists of global ranks, in creation order."""
    return {
        "tp": [[global_rank(d, p, t, dp, tp) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[global_rank(d, p, t, dp, tp) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[global_rank(d, p, t, dp, tp) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }


@dataclass
class DeviceMesh3D:
    """This rank's place on the mesh and the process group of each of its lines."""

    dp: int
    pp: int
    tp: int
    rank: int
    groups: dict[str, object] = field(default_factory=dict)   # "tp" | "dp" | "pp" -> ProcessGroup
    ranks: dict[str, list[int]] = field(default_factory=dict)  # the members of this rank's lines

    @property
    def dp_rank(self) -> int:
        return coordinates(self.rank, self.dp, self.pp, self.tp)[0]

    @property
    def pp_rank(self) -> int:
        return coordinates(self.rank, self.dp, self.pp, self.tp)[1]

    @property
    def tp_rank(self) -> int:
        return coordinates(self.rank, self.dp, self.pp, self.tp)[2]

    @property
    def tp_group(self):
        return self.groups["tp"]

    @property
    def dp_group(self):
        return self.groups["dp"]

    @property
    def pp_group(self):
        return self.groups["pp"]

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}


def init_device_mesh(tp: int = 1, pp: int = 1, dp: int | None = None, backend: str | None = None
                     ) -> DeviceMesh3D:
    """Create every TP, DP and PP group (collective: every rank calls it with the same sizes) and
    return this rank's mesh."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, pp, tp = mesh_shape(world, tp, pp, dp)
    mesh = DeviceMesh3D(dp, pp, tp, rank)
    for dim, lines in group_ranks(dp, pp, tp).items():
        for members in lines:
            group = dist.new_group(members, backend=backend)
            if rank in members:
                mesh.groups[dim], mesh.ranks[dim] = group, members
    return mesh
