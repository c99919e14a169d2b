"""The planner prices an MoE's expert data-parallel ring where the mesh puts it: the experts'
gradients reduce over the dp·cp/ep ranks holding the same experts (the mesh's `expert_dp` line),
t·ep GPUs apart (ep is borrowed from the inner factors of dp_shard × cp), the dense units' over
dp·cp ranks t apart (`dp_cp`). `dp_groups` (planner/memory.py) must give each group's size and
stride as `common.kernel.mesh.group_ranks` builds it, and `price` must hand exactly those to
`Hardware.ring_bandwidth`: across nodes a stride of t·ep leaves a node 8/(t·ep) of the group's
NICs, not 8/t, so a wrong stride prices the experts' reduction up to ep× too fast.
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest

from common.kernel.mesh import MeshShape, group_ranks
from parallel3d.memory_model import Layout
from parallel3d.planner.hardware import GPUS, Hardware
from parallel3d.planner.memory import dp_groups
from parallel3d.planner.pricing import MOE_MODELS, price

# (tp, cp, dp, ep, pp): inside a node, across nodes with 8/t and fewer members per node, with CP
LAYOUTS = [(1, 1, 8, 2, 1), (2, 1, 8, 4, 2), (4, 2, 4, 2, 1), (8, 1, 16, 8, 1), (2, 2, 8, 8, 2),
           (1, 1, 64, 8, 1)]


def mesh_ring(line: list[int]) -> tuple[int, int]:
    """(ranks, GPUs between two neighbours) of a line of the mesh, its ranks evenly spaced."""
    strides = {b - a for a, b in itertools.pairwise(line)}
    assert len(strides) <= 1, f"{line} is not evenly spaced"
    return len(line), strides.pop() if strides else 1


def rings_of_the_mesh(t: int, cp: int, dp: int, ep: int, pp: int) -> list[tuple[int, int]]:
    lines = group_ranks(MeshShape(pp=pp, dp_shard=dp, cp=cp, tp=t, ep=ep), ["dp_cp", "expert_dp"])
    return [mesh_ring(lines["dp_cp"][0]), mesh_ring(lines["expert_dp"][0])]


@pytest.mark.parametrize("t, cp, dp, ep, pp", LAYOUTS)
def test_dp_groups_are_the_meshs_lines_size_and_stride(t, cp, dp, ep, pp):
    cfg, moe = MOE_MODELS["deepseek-v3"]
    groups = dp_groups(cfg, moe, Layout(tp=t, cp=cp, dp=dp, ep=ep, pp=pp, zero=3))
    assert [(n, stride) for _, n, stride in groups] == rings_of_the_mesh(t, cp, dp, ep, pp)
    assert groups[1][0] > 0  # the experts' parameters are there


@pytest.mark.parametrize("t, cp, dp, ep, pp", LAYOUTS)
def test_price_hands_ring_bandwidth_each_groups_stride(t, cp, dp, ep, pp):
    cfg, moe = MOE_MODELS["deepseek-v3"]
    layout = Layout(tp=t, cp=cp, dp=dp, ep=ep, pp=pp, zero=1, recompute="full")
    asked, real = [], Hardware.ring_bandwidth

    def recorded(self, n, stride):
        asked.append((n, stride))
        return real(self, n, stride)

    with mock.patch.object(Hardware, "ring_bandwidth", recorded):
        plan = price(cfg, layout, 4096, 8 * dp, 80, GPUS["H100"], moe=moe)
    assert sorted(set(asked)) == sorted(rings_of_the_mesh(t, cp, dp, ep, pp)), asked
    assert plan.step_s > 0

