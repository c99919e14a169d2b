"""The kernel's mesh (common/kernel/mesh.py): the rank layout, the lines of every dimension, the refusals,
and the groups it builds. The builders it replaced are kept here as the oracle: on drawn shapes the
mesh's lines equal theirs (04's HSDP node split, 05's TP/CP/gradient groups, 05's expert groups,
07's 3D mesh, and the mesh's own earlier table of lines named by what they hold fixed). EP groups
are consecutive ranks: the numbers of a strided EP layout are exact, only its all-to-alls cross
nodes, so only a check of the rank lists sees it. A new dimension is two edits of mesh.py: the
Ulysses × ring split of cp is made here in exactly those two, and its lines checked."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

from common.kernel.mesh import (
    LINES,
    MeshError,
    MeshShape,
    borrowed,
    build_mesh,
    coordinates,
    global_rank,
    group_ranks,
    mesh_shape,
)

# --- the old hand builders, as pure rank lists: the oracle -----------------------------------------


def node_groups_ranks(world: int, per_node: int) -> dict[str, list[list[int]]]:
    """04_fsdp/wrap.py's node_groups: node k's ranks shard, local rank i's replicate."""
    return {"dp_shard": [list(range(k, k + per_node)) for k in range(0, world, per_node)],
            "dp_replicate": [list(range(i, world, per_node)) for i in range(per_node)]}


def mesh_groups_ranks(world: int, tp: int, cp: int) -> dict[str, list[list[int]]]:
    """05_tensor_parallel/train.py's mesh_groups: TP, CP, gradients over dp × cp."""
    return {"tp": [list(range(start, start + tp)) for start in range(0, world, tp)],
            "cp": [[(d * cp + c) * tp + i for c in range(cp)] for d in range(world // (tp * cp))
                   for i in range(tp)],
            "dp_cp": [list(range(i, world, tp)) for i in range(tp)]}


def expert_groups_ranks(world: int, ep: int) -> dict[str, list[list[int]]]:
    """05_tensor_parallel/train_expert.py's expert_groups: EP consecutive, replicas strided."""
    return {"ep": [list(range(start, start + ep)) for start in range(0, world, ep)],
            "expert_dp": [list(range(i, world, ep)) for i in range(ep)]}


def mesh_3d_ranks(dp: int, pp: int, tp: int, cp: int) -> dict[str, list[list[int]]]:
    """07_3d/mesh.py's group_ranks: rank = ((p·dp + d)·cp + c)·tp + t."""
    everyone = [(d, p, c, t) for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)]
    rank = lambda d, p, c, t: ((p * dp + d) * cp + c) * tp + t  # noqa: E731
    index = {"dp": 0, "pp": 1, "cp": 2, "tp": 3}

    def lines(varying: tuple[str, ...]) -> list[list[int]]:
        fixed = [f for f in ("pp", "dp", "cp", "tp") if f not in varying]
        out: dict[tuple[int, ...], list[int]] = {}
        for at in everyone:
            out.setdefault(tuple(at[index[f]] for f in fixed), []).append(rank(*at))
        return [out[k] for k in sorted(out)]

    return {"tp": lines(("tp",)), "cp": lines(("cp",)), "dp": lines(("dp",)),
            "dp_cp": lines(("dp", "cp")), "pp": lines(("pp",))}


def held_fixed_ranks(shape: MeshShape) -> dict[str, list[list[int]]]:
    """The mesh's own earlier table: each dimension's lines listed by the coordinates they hold
    fixed, a rank's coordinates read off the rank formula by hand."""
    held = {"tp": ("pp", "dp_replicate", "dp_shard", "cp"), "cp": ("pp", "dp_replicate", "dp_shard", "tp"),
            "ep": ("pp", "dp_replicate", "dp_shard_mod_ep", "tp"),
            "dp_shard": ("pp", "dp_replicate", "cp", "tp"), "dp_shard_cp": ("pp", "dp_replicate", "tp"),
            "dp_replicate": ("pp", "dp_shard", "cp", "tp"), "dp": ("pp", "cp", "tp"), "dp_cp": ("pp", "tp"),
            "dp_shard_mod_ep": ("pp", "dp_replicate", "ep", "tp"), "expert_dp": ("pp", "ep", "tp"),
            "pp": ("dp_replicate", "dp_shard", "cp", "tp")}
    out = {}
    for dim, fixed in held.items():
        lines: dict[tuple[int, ...], list[int]] = {}
        for rank in range(shape.world):
            t, rest = rank % shape.tp, rank // shape.tp
            c, rest = rest % shape.cp, rest // shape.cp
            s, rest = rest % shape.dp_shard, rest // shape.dp_shard
            r, p = rest % shape.dp_replicate, rest // shape.dp_replicate
            j = s * shape.cp + c
            at = {"pp": p, "dp_replicate": r, "dp_shard": s, "cp": c, "tp": t, "ep": j % shape.ep,
                  "dp_shard_mod_ep": j // shape.ep}
            lines.setdefault(tuple(at[f] for f in fixed), []).append(rank)
        out[dim] = [lines[key] for key in sorted(lines)]
    return out


def same_lines(new: dict[str, list[list[int]]], old: dict[str, list[list[int]]]) -> None:
    for dim, lines in old.items():
        assert sorted(new[dim]) == sorted(lines), (dim, new[dim], lines)


@st.composite
def shapes(draw) -> MeshShape:
    shard, cp = draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from([1, 2]))
    ep = draw(st.sampled_from([d for d in range(1, shard * cp + 1) if shard * cp % d == 0]))
    return MeshShape(pp=draw(st.sampled_from([1, 2])), dp_replicate=draw(st.sampled_from([1, 2])),
                     dp_shard=shard, cp=cp, tp=draw(st.sampled_from([1, 2, 4])), ep=ep)


# --- the layout -----------------------------------------------------------------------------------


def test_rank_layout_tp_innermost_then_cp_then_dp_then_pp():
    lines = group_ranks(MeshShape(pp=2, dp_shard=2, tp=2))
    assert lines["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lines["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lines["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    lines = group_ranks(MeshShape(dp_shard=2, cp=2, tp=2))
    assert lines["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lines["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    hsdp = group_ranks(MeshShape(dp_replicate=2, dp_shard=2, tp=2))
    assert hsdp["dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert hsdp["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert coordinates(5, MeshShape(pp=2, dp_shard=2, tp=2)) == {
        "pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1, "ep": 0, "dp_shard_mod_ep": 0,
        "dp_shard_cp": 0, "dp": 0, "dp_cp": 0, "expert_dp": 0}
    at = coordinates(13, MeshShape(dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=2))  # r 1, s 1, c 0, t 1
    assert (at.dp, at.dp_cp, at.dp_shard_cp, at.ep, at.dp_shard_mod_ep, at.expert_dp) == (3, 6, 2, 0, 1, 3)


@given(shapes())
def test_every_rank_is_on_one_line_of_each_dimension_and_round_trips(shape):
    sizes = {"tp": shape.tp, "cp": shape.cp, "ep": shape.ep, "dp_shard": shape.dp_shard,
             "dp_shard_cp": shape.dp_shard * shape.cp, "dp_replicate": shape.dp_replicate,
             "dp": shape.dp, "dp_cp": shape.dp * shape.cp,
             "dp_shard_mod_ep": shape.dp_shard * shape.cp // shape.ep,
             "expert_dp": shape.dp * shape.cp // shape.ep, "pp": shape.pp}
    lines = group_ranks(shape)
    assert list(lines) == list(LINES)  # creation order
    for dim, dim_lines in lines.items():
        assert sorted(r for line in dim_lines for r in line) == list(range(shape.world)), dim
        assert all(len(line) == sizes[dim] for line in dim_lines), dim
    assert all(global_rank(coordinates(r, shape), shape) == r for r in range(shape.world))
    for r in range(shape.world):  # a rank's index within each line is its place in the line's list
        at = coordinates(r, shape)
        assert all(next(line for line in lines[d] if r in line).index(r) == at[d] for d in LINES), r
        assert all(shape.size(d) == sizes[d] for d in LINES)


@given(shapes())
@example(MeshShape(pp=2, dp_shard=4, tp=2, ep=2))  # an EP group inside a replica of 4
@example(MeshShape(dp_shard=2, cp=2, tp=1, ep=2))  # EP over the CP ranks
def test_ep_groups_are_consecutive_ranks_within_a_node(shape):
    """Each EP line is ep ranks at stride tp (consecutive when tp = 1): within one node whenever
    ep·tp ranks divide it; the ranks holding the same experts (expert_dp) are the strided ones."""
    node = shape.ep * shape.tp  # the smallest node an EP line can live in
    for line in group_ranks(shape, ["ep"])["ep"]:
        assert [b - a for a, b in pairwise(line)] == [shape.tp] * (shape.ep - 1), (shape, line)
        assert len({r // node for r in line}) == 1, (shape, line)


# --- the property: the mesh's lines equal the hand builders' ---------------------------------------


@given(shapes())
@example(MeshShape(pp=2, dp_shard=2, cp=2, tp=2))
def test_mesh_lines_equal_the_3d_meshs(shape):
    shape = MeshShape(pp=shape.pp, dp_shard=shape.dp_shard, cp=shape.cp, tp=shape.tp)
    same_lines(group_ranks(shape), mesh_3d_ranks(shape.dp, shape.pp, shape.tp, shape.cp))


@given(shapes())
@example(MeshShape(pp=2, dp_replicate=2, dp_shard=3, cp=2, tp=2, ep=3))  # ep cuts across s and c
def test_mesh_lines_named_by_what_varies_equal_the_table_of_what_they_hold_fixed(shape):
    """Every line of every dimension, in the same order (build_mesh's new_group order)."""
    assert group_ranks(shape) == held_fixed_ranks(shape)


@given(shapes())
@example(MeshShape(dp_shard=2, cp=2, tp=2))
def test_mesh_lines_equal_tensor_parallels(shape):
    shape = MeshShape(dp_shard=shape.dp_shard, cp=shape.cp, tp=shape.tp)
    same_lines(group_ranks(shape), mesh_groups_ranks(shape.world, shape.tp, shape.cp))


@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3, 4]))
@example(2, 3)
def test_mesh_lines_equal_hsdps_node_split(nodes, per_node):
    same_lines(group_ranks(MeshShape(dp_replicate=nodes, dp_shard=per_node)),
               node_groups_ranks(nodes * per_node, per_node))


@given(st.sampled_from([1, 2, 3, 4, 6, 8]), st.data())
def test_mesh_lines_equal_expert_parallels(world, data):
    ep = data.draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    same_lines(group_ranks(MeshShape(dp_shard=world, ep=ep)), expert_groups_ranks(world, ep))


# --- a new dimension: two edits -------------------------------------------------------------------


@dataclass(frozen=True)
class UlyssesShape(MeshShape):
    """Edit 1 of 2: cp cut into a ring of Ulysses groups, cp = r × u (u consecutive CP ranks)."""

    cp_ulysses: int = borrowed("cp", rest="cp_ring")


@pytest.mark.parametrize("shape", [UlyssesShape(dp_shard=2, cp=4, tp=2, cp_ulysses=2),
                                   UlyssesShape(pp=2, cp=6, tp=1, ep=3, cp_ulysses=3),
                                   UlyssesShape(dp_replicate=2, cp=4, tp=2, cp_ulysses=4)])
def test_a_new_dimension_is_a_field_and_its_lines(shape, monkeypatch):
    """Edit 2 of 2: its lines, named by what varies. Then the Ulysses groups are u neighbouring CP
    ranks (stride tp), the ring joins the ranks of the same Ulysses index (stride tp·u), each
    rank's (cp_ring, cp_ulysses) is its cp = r·u + u_i, and every other line is as before."""
    before = group_ranks(MeshShape(**{n: v for n, v in shape.sizes().items() if n != "cp_ulysses"}))
    monkeypatch.setitem(LINES, "cp_ulysses", ("cp_ulysses",))
    monkeypatch.setitem(LINES, "cp_ring", ("cp_ring",))
    u, lines = shape.cp_ulysses, group_ranks(shape)
    assert all(lines[d] == before[d] for d in before)
    assert all([b - a for a, b in pairwise(line)] == [shape.tp] * (u - 1) for line in lines["cp_ulysses"])
    assert all([b - a for a, b in pairwise(line)] == [shape.tp * u] * (shape.cp // u - 1)
               for line in lines["cp_ring"])
    for rank in range(shape.world):
        at = coordinates(rank, shape)
        assert at.cp == at.cp_ring * u + at.cp_ulysses and global_rank(at, shape) == rank
    assert shape.size("cp_ring") == shape.cp // u and shape.as_dict()["cp_ulysses"] == u
    with pytest.raises(MeshError, match=r"cp_ulysses 3 does not divide cp = 4 \(it borrows those ranks\)"):
        UlyssesShape(cp=4, cp_ulysses=3)


# --- the refusals ---------------------------------------------------------------------------------


def test_mesh_shape_infers_dp_and_the_halves():
    assert mesh_shape(8, tp=2, pp=2) == MeshShape(pp=2, dp_shard=2, tp=2)
    assert mesh_shape(8, tp=2, cp=2) == MeshShape(dp_shard=2, cp=2, tp=2)
    assert mesh_shape(8, dp_replicate=2) == MeshShape(dp_replicate=2, dp_shard=4)
    assert mesh_shape(8, dp_shard=2) == MeshShape(dp_replicate=4, dp_shard=2)
    assert mesh_shape(8, dp_replicate=2, dp_shard=2, tp=2) == MeshShape(dp_replicate=2, dp_shard=2, tp=2)
    assert mesh_shape(8, tp=2, ep=4, n_experts=8) == MeshShape(dp_shard=4, tp=2, ep=4)


@pytest.mark.parametrize("world, sizes, message", [
    (8, {"tp": 4, "dp": 2, "cp": 2}, r"--dp 2 × --cp 2 × --tp 4 = 16 != world size 8"),
    (8, {"tp": 4, "pp": 2, "dp": 2}, r"--dp 2 × --pp 2 × --tp 4 = 16 != world size 8.*omit --dp"),
    (6, {"tp": 2, "pp": 2}, r"world size 6 is not divisible by --pp 2 × --tp 2 = 4"),
    (8, {"cp": 0}, r"--cp 0: must be >= 1"),
    (8, {"tp": 0}, r"--tp 0: must be >= 1"),
    (8, {"ep": 0}, r"--ep 0: must be >= 1"),
    (8, {"dp_replicate": 3}, r"--dp-replicate 3 × --dp-shard 2 = 6 != dp 8: .* use --dp-replicate 1 "
                             r"--dp-shard 8 or --dp-replicate 2 --dp-shard 4"),
    (8, {"dp": 4, "tp": 2, "dp_replicate": 2, "dp_shard": 4}, r"--dp-replicate 2 × --dp-shard 4 = 8 != dp 4"),
    (8, {"dp_replicate": 2, "dp_shard": 2}, r"--dp-replicate 2 × --dp-shard 2 = 4 != "
                                           r"world size 8: .* omit one of the two to infer it"),
    (6, {"tp": 4}, r"world size 6 is not divisible by --tp 4: launch a multiple of 4 ranks"),
    (8, {"tp_size": 2}, r"unknown mesh dimension\(s\) \['tp_size'\]"),
    (8, {"tp": 2, "ep": 3}, r"--ep 3 does not divide the 4 ranks it borrows \(dp_shard 4 × cp 1.*use one of "
                            r"--ep 1, 2, 4$"),
    (8, {"dp_replicate": 2, "ep": 8}, r"--ep 8 does not divide the 4 ranks it borrows"),
    (8, {"ep": 4, "n_experts": 6}, r"--ep 4 does not divide the 6 experts .*: use one of --ep 1, 2$"),
])
def test_mesh_shape_refuses_every_bad_layout_naming_the_values_and_the_fix(world, sizes, message):
    with pytest.raises(MeshError, match=message):
        mesh_shape(world, **sizes)


def test_a_shape_refuses_itself():
    with pytest.raises(MeshError, match=r"tp 0: every mesh size must be >= 1"):
        MeshShape(tp=0)
    with pytest.raises(MeshError, match=r"ep 3 does not divide dp_shard × cp = 4 .*use one of ep 1, 2, 4"):
        MeshShape(dp_shard=2, cp=2, ep=3)
    with pytest.raises(MeshError, match=r"unknown mesh dimension\(s\) \['dp_pp'\]"):
        group_ranks(MeshShape(), ["dp_pp"])
    with pytest.raises(MeshError, match=r"unknown mesh dimension 'dp_pp'"):
        MeshShape().size("dp_pp")


# --- the builder, on the rank pool ------------------------------------------------------------------


def build_and_probe(shape: MeshShape) -> dict:
    """Each rank: build every group, then all-reduce its global rank over each of them."""
    mesh = build_mesh(shape)
    sums = {}
    for dim in LINES:
        x = torch.tensor([float(mesh.rank)])
        dist.all_reduce(x, group=mesh.group(dim))
        sums[dim] = x.item()
    members = {dim: dist.get_process_group_ranks(mesh.group(dim)) for dim in LINES}
    return {"coords": mesh.coordinates, "ranks": mesh.ranks, "members": members, "sums": sums}


@pytest.mark.parametrize("shape", [MeshShape(pp=2, dp_shard=2, tp=2),
                                   MeshShape(dp_replicate=2, dp_shard=2, tp=2, ep=2),
                                   MeshShape(dp_shard=2, cp=2, tp=2, ep=4)])
def test_built_groups_connect_the_lines_ranks(pools, shape):
    lines = group_ranks(shape)
    for rank, r in enumerate(pools.run(8, build_and_probe, shape)):
        assert r["coords"] == coordinates(rank, shape)
        for dim in LINES:
            mine = next(line for line in lines[dim] if rank in line)
            assert r["ranks"][dim] == mine == r["members"][dim], (rank, dim)
            assert r["sums"][dim] == sum(mine), (rank, dim)


def build_on_the_wrong_world(shape: MeshShape) -> str:
    try:
        build_mesh(shape)
    except MeshError as error:
        return str(error)
    return "built"


def test_a_shape_of_another_world_is_refused_on_every_rank_before_any_group(pools):
    """Every rank refuses alike (no rank waits in new_group for one that already raised)."""
    results = pools.run(2, build_on_the_wrong_world, MeshShape(dp_shard=2, tp=2))
    assert all("has 4 ranks, the world 2" in r for r in results), results
