"""Chapter 07: clipping by the true global norm of a model split over TP × PP × DP on the kernel's
mesh (its layout and groups: tests/test_mesh.py), against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from common.kernel.clip import clip_grads_by_global_norm_
from common.kernel.mesh import MeshShape, coordinates
from common.kernel.model import build_model, get_config
from parallel3d.memory_model import stage_layers

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
    at = coordinates(dist.get_rank(), MeshShape(pp=pp, dp_shard=dp, tp=tp))
    dp_rank, pp_rank, tp_rank = at.dp, at.pp, at.tp
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
