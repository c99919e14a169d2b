"""Chapter 07: the 3D mesh (rank layout, one group per line, validation) and clipping by the true
global norm of a model split over TP × PP × DP, against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from common.clip import clip_grads_by_global_norm_
from common.model import build_model, get_config
from parallel3d.memory_model import stage_layers
from parallel3d.mesh import MeshError, build_mesh, coordinates, group_ranks, mesh_shape


def test_rank_layout_tp_innermost_then_dp_then_pp():
    lines = group_ranks(dp=2, pp=2, tp=2)
    assert lines["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lines["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lines["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [coordinates(r, 2, 2, 2) for r in (0, 1, 2, 5, 7)] == [  # (dp, pp, cp, tp)
        (0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (0, 1, 0, 1), (1, 1, 0, 1)]


def test_rank_layout_with_cp_between_tp_and_dp():
    """rank = ((pp·dp + dp_rank)·cp + cp_rank)·tp + tp_rank; FSDP's dp×cp line spans both."""
    lines = group_ranks(dp=2, pp=1, tp=2, cp=2)
    assert lines["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lines["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lines["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lines["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [coordinates(r, 2, 1, 2, cp=2) for r in (0, 3, 6)] == [(0, 0, 0, 0), (0, 0, 1, 1), (1, 0, 1, 0)]


@pytest.mark.parametrize("dp, pp, cp, tp", [(1, 1, 1, 8), (8, 1, 1, 1), (1, 8, 1, 1), (2, 2, 1, 2),
                                            (4, 1, 1, 2), (1, 2, 1, 4), (1, 2, 2, 2), (2, 1, 4, 1)])
def test_every_rank_is_on_exactly_one_line_of_each_dimension(dp, pp, cp, tp):
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp, "dp_cp": dp * cp}
    for dim, lines in group_ranks(dp, pp, tp, cp).items():
        assert sorted(r for line in lines for r in line) == list(range(dp * pp * cp * tp)), dim
        assert all(len(line) == sizes[dim] for line in lines)


def test_mesh_shape_infers_dp_and_rejects_bad_products():
    assert mesh_shape(8, tp=2, pp=2) == (2, 2, 1, 2)
    assert mesh_shape(8, tp=2) == (4, 1, 1, 2)
    assert mesh_shape(8, tp=2, pp=2, dp=2) == (2, 2, 1, 2)
    assert mesh_shape(8, tp=2, cp=2) == (2, 1, 2, 2)
    with pytest.raises(MeshError, match=r"--dp 2 × --pp 1 × --cp 2 × --tp 4 = 16 != world size 8"):
        mesh_shape(8, tp=4, dp=2, cp=2)
    with pytest.raises(MeshError, match=r"--cp 0: must be >= 1"):
        mesh_shape(8, cp=0)
    with pytest.raises(MeshError, match=r"--dp 2 × --pp 2 × --tp 4 = 16 != world size 8.*omit --dp"):
        mesh_shape(8, tp=4, pp=2, dp=2)
    with pytest.raises(MeshError, match=r"world size 6 is not divisible by --pp 2 × --tp 2 = 4"):
        mesh_shape(6, tp=2, pp=2)
    with pytest.raises(MeshError, match=r"--tp 0: must be >= 1"):
        mesh_shape(8, tp=0)


DIMS = ("tp", "cp", "dp", "dp_cp", "pp")


def build_and_probe(tp: int, pp: int, cp: int = 1) -> dict:
    """Each rank: build the mesh, then all-reduce its global rank over each of its groups."""
    mesh = build_mesh(tp=tp, pp=pp, cp=cp)
    sums = {}
    for dim in DIMS:
        x = torch.tensor([float(mesh.rank)])
        dist.all_reduce(x, group=mesh.groups[dim])
        sums[dim] = x.item()
    return {"coords": mesh.coordinates, "ranks": mesh.ranks, "sums": sums}


@pytest.mark.parametrize("tp, pp, cp", [(2, 2, 1), (2, 1, 2)])
def test_mesh_groups_connect_the_right_ranks(pools, tp, pp, cp):
    results = pools.run(8, build_and_probe, tp, pp, cp)
    for rank, r in enumerate(results):
        assert r["coords"] == coordinates(rank, 8 // (tp * pp * cp), pp, tp, cp)
        for dim in DIMS:
            assert rank in r["ranks"][dim]
            assert r["sums"][dim] == sum(r["ranks"][dim]), (rank, dim)


# --- clipping --------------------------------------------------------------------------------

def full_grads(seed: int = 0) -> dict[str, torch.Tensor]:
    model = build_model(get_config("tiny", n_layers=4), seed, torch.float64)
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, dtype=torch.float64, generator=gen) for n, p in model.named_parameters()}


def stage_of(name: str, n_layers: int, pp: int) -> int:
    if name.startswith("tok_embeddings"):
        return 0
    if not name.startswith("layers."):
        return pp - 1
    layer, bounds = int(name.split(".")[1]), 0
    for stage, n in enumerate(stage_layers(n_layers, pp)):
        bounds += n
        if layer < bounds:
            return stage
    raise AssertionError


def local_pieces(grads: dict[str, torch.Tensor], dp: int, pp: int, tp: int, dp_sharded: bool):
    """This rank's pieces of the full gradients as a 3D trainer holds them: its stage's tensors,
    TP-split along dim 0 (norm weights whole on every TP rank), each flattened and cut into dp
    shards (or whole on every DP rank). Returns {name: (piece, counted, slice of the flat tensor)}."""
    dp_rank, pp_rank, _, tp_rank = coordinates(dist.get_rank(), dp, pp, tp)
    out = {}
    for name, g in grads.items():
        if stage_of(name, 4, pp) != pp_rank:
            continue
        replicated_tp = g.dim() == 1
        piece = g if replicated_tp else g.chunk(tp, dim=0)[tp_rank]
        flat = piece.reshape(-1).clone()
        if dp_sharded:
            size = -(-flat.numel() // dp)
            padded = torch.nn.functional.pad(flat, (0, size * dp - flat.numel()))
            flat = padded[dp_rank * size : (dp_rank + 1) * size].clone()
        counted = (not replicated_tp or tp_rank == 0) and (dp_sharded or dp_rank == 0)
        out[name] = (flat, counted)
    return out


def clip_on_mesh(dp: int, pp: int, tp: int, max_norm: float, dp_sharded: bool, broken: str | None):
    grads = full_grads()
    reference = {n: g.clone() for n, g in grads.items()}
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in reference.values()]
    for p, g in zip(params, reference.values(), strict=True):
        p.grad = g
    ref_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    pieces = local_pieces(grads, dp, pp, tp, dp_sharded)
    local = [piece for piece, _ in pieces.values()]
    counted = [piece for piece, c in pieces.values() if c or broken == "replicas-counted-twice"]
    if broken == "local-norm":  # each rank clips by the norm of what it holds
        holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in local]
        for p, g in zip(holders, local, strict=True):
            p.grad = g
        norm = torch.nn.utils.clip_grad_norm_(holders, max_norm, foreach=False)
    else:
        norm = clip_grads_by_global_norm_(local, max_norm, counted, groups=(dist.group.WORLD,))
    expected = local_pieces(reference, dp, pp, tp, dp_sharded)
    worst = max((piece - expected[n][0]).abs().max().item() / expected[n][0].abs().max().item()
                for n, (piece, _) in pieces.items())
    return {"norm": norm.item(), "ref_norm": ref_norm.item(), "worst": worst}


MESHES = [(2, 2, 2), (1, 2, 4), (4, 1, 2), (2, 4, 1)]


@pytest.mark.parametrize("dp_sharded", [True, False])
@pytest.mark.parametrize("dp, pp, tp", MESHES)
def test_clipping_by_the_global_norm_equals_torch_on_the_full_model(pools, dp, pp, tp, dp_sharded):
    for max_norm in (1.0, 1e6):  # clipping, and not clipping
        for r in pools.run(8, clip_on_mesh, dp, pp, tp, max_norm, dp_sharded, None):
            assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-12)
            assert r["worst"] <= 1e-12


@pytest.mark.parametrize("broken", ["replicas-counted-twice", "local-norm"])
def test_clipping_with_a_wrong_norm_is_rejected(pools, broken):
    """The two classic bugs: replicated tensors counted on every replica, or each rank clipping
    by its own local norm. Both scale the gradients by a wrong coefficient."""
    results = pools.run(8, clip_on_mesh, 2, 2, 2, 1.0, False, broken)
    assert max(r["worst"] for r in results) > 1e-3
