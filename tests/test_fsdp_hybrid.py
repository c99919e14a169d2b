"""Chapter 04's HSDP (HYBRID_SHARD, _HYBRID_SHARD_ZERO2): each unit sharded within a node (the
shard group, s ranks), each reduced shard all-reduced across nodes (the replicate group, r ranks).
It trains the same numbers as one device for every s × r of 2-4 ranks, sends what the formula
says over each group, and each planted bug is caught: by the equivalence check, or (where the
numbers stay right) by the bytes per group."""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from common.cli import ConfigError
from common.comm import CommMeter
from common.dist import init_distributed
from common.kernel.clip import clip_grads_by_global_norm_
from common.kernel.collectives import reduce_scatter_single
from common.kernel.mesh import MeshShape, build_mesh
from common.kernel.model import get_config
from fsdp import (
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    ShardingStrategy,
    UnitTraffic,
    fsdp_comm_bytes,
    fsdp_comm_bytes_by_group,
    unit_traffic,
)
from fsdp import train as fsdp_train
from fsdp.formulas import network_bytes
from fsdp.train import FSDPStrategy
from tests.conftest import PROFILE
from tests.equivalence import (
    TrainSpec,
    check_strategy,
    check_strategy_rejected,
    data_parallel_specs,
    spec_run,
    with_spec,
)
from tests.harness import RankError

HYBRID = ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
MESHES = [(1, 2), (2, 1), (3, 1), (1, 3), (2, 2), (4, 1), (1, 4)]  # (shard s, replicate r): world s·r
THOROUGH = PROFILE == "thorough"  # ci: one 4-rank pool, 2×2, the fewest examples that show each claim


def hsdp_strategy(spec: TrainSpec, sharding: str, shard_size: int, no_sync: bool = False,
                  cls: type[FSDPStrategy] = FSDPStrategy) -> FSDPStrategy:
    """Built as train.py builds it for `--nodes world/s`: nodes of s consecutive ranks."""
    run = spec_run(spec, fsdp_train.validate, sharding_strategy=sharding, no_sync=no_sync, no_prefetch=False,
                   impl="ours", nodes=spec.world_size // shard_size)
    return cls(run, init_distributed())


# --- the same numbers as one device -----------------------------------------------------------------

@st.composite
def hsdp_specs(draw) -> tuple[TrainSpec, int]:
    s, r = draw(st.sampled_from(MESHES if THOROUGH else [(2, 2)]))
    return draw(data_parallel_specs(world_sizes=(s * r,))), s


SPEC_2X2 = TrainSpec(cfg=get_config("tiny", n_layers=2, dim=24, n_heads=4, n_kv_heads=2), world_size=4,
                     global_batch=8, micro_batch=1, seq_len=5, steps=2, optimizer="sgd", clip_grad=1e-2)


@settings(max_examples=settings.default.max_examples if THOROUGH else 1)  # + the 2×2 example
@example(drawn=(SPEC_2X2, 2), sharding="HYBRID_SHARD", clip=1e-2, no_sync=True)
@given(drawn=hsdp_specs(), sharding=st.sampled_from(HYBRID), clip=st.sampled_from([None, 1e-3, 1e3]),
       no_sync=st.booleans())
def test_hsdp_equals_single_device_float64(pools, drawn, sharding, clip, no_sync):
    """Every s × r of 2-4 ranks (4 = 2×2, 4×1, 1×4; 3 = 3×1, 1×3; 2 = 1×2, 2×1), AdamW or SGD,
    grad-accum with and without no_sync, clipping by the norm of the shard group: float64 1e-10."""
    spec, shard_size = drawn
    check_strategy(pools, with_spec(spec, clip_grad=clip), hsdp_strategy, sharding, shard_size, no_sync)


def test_hsdp_mixed_precision_equals_mixed_precision_reference(pools):
    spec = with_spec(SPEC_2X2, cfg=get_config("tiny", n_layers=1), dtype="float32", mixed_precision="bf16",
                     optimizer="adamw", clip_grad=1.0)
    check_strategy(pools, spec, hsdp_strategy, "_HYBRID_SHARD_ZERO2", 2, True)


# --- negative controls: the same check rejects each planted bug ------------------------------------

class ReplicasCountedInClipping(FSDPStrategy):
    """Sums the squared norm over the replicate group too: each element counted r times."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        model = self.model
        grads = [h.flat_param.grad for h in model._handles()]
        return clip_grads_by_global_norm_(grads, max_norm,
                                         groups=(model.process_group, model.replicate_group))


def broken_hsdp(spec: TrainSpec, broken: str) -> FSDPStrategy:
    strategy = hsdp_strategy(spec, "HYBRID_SHARD", 2, cls=ReplicasCountedInClipping
                             if broken == "replicas-counted-in-clipping" else FSDPStrategy)
    for h in strategy.model._handles():
        if broken == "divide-by-shard-size-only":  # gradients r× too large
            h.dp_size = h.group_size
        elif broken == "no-replicate-all-reduce":  # each node steps with its own nodes' gradient
            h.start_replicate = lambda: None
    return strategy


NEGATIVE = with_spec(SPEC_2X2, cfg=get_config("tiny", n_layers=1), global_batch=4, steps=1, clip_grad=1e-3)


@pytest.mark.parametrize("broken", ["divide-by-shard-size-only", "no-replicate-all-reduce",
                                    "replicas-counted-in-clipping"])
def test_broken_hsdp_is_rejected(pools, broken):
    """Gradients are compared after backward, so SGD sees what AdamW's update would hide."""
    print(broken, check_strategy_rejected(pools, NEGATIVE, broken_hsdp, broken))


# --- the order: each unit's cross-node all-reduce overlaps the later units' backward ------------------

def hsdp_backward_order(defer: bool) -> list[tuple[str, str]]:
    """4 linear units on 2 × 2 (torch's default groups, LOCAL_WORLD_SIZE=2), one backward: each
    unit's reduce-scatter (within the node) and cross-node all-reduce, and the end-of-backward
    callback, in the order they are posted. `defer` plants the bug the numbers and the bytes cannot
    see: every all-reduce deferred to the end of backward (no overlap)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 5), nn.Linear(5, 3), nn.Linear(3, 5)).double()
    previous, os.environ["LOCAL_WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"], "2"
    try:
        fsdp = FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                                        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = previous
    log: list[tuple[str, str]] = []
    for h in fsdp._handles():
        def reduce(grad, sync, h=h, posted=h.reduce_grad):
            posted(grad, sync)
            log.append(("reduce-scatter", h.name))

        def replicate(h=h, posted=h.start_replicate):
            if defer and fsdp._state.in_backward:  # planted: only the end-of-backward callback posts
                return
            before = h._replicating
            posted()
            if h._replicating and not before:
                log.append(("all-reduce", h.name))

        h.reduce_grad, h.start_replicate = reduce, replicate
    finish = fsdp._finish_backward
    fsdp._finish_backward = lambda: (log.append(("end of backward", "")), finish())[1]
    fsdp(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    return log


@pytest.mark.parametrize("defer", [False, True])
def test_hsdp_posts_each_cross_node_all_reduce_during_backward(pools, defer):
    """Unit u's all-reduce is posted after its own reduce-scatter and before the reduce-scatter of
    the unit two places later in backward (it overlaps that unit's backward: torch issues it right
    after u's reduce-scatter); only the last unit's waits for the end-of-backward callback. The
    planted deferral trains the same numbers over the same bytes, and this order check rejects it."""
    order = [f"{i}" for i in (3, 2, 1, 0)]  # backward order of the units
    for log in pools.run(4, hsdp_backward_order, defer):
        at = {event: i for i, event in enumerate(log)}
        checks = [at[("reduce-scatter", u)] < at[("all-reduce", u)] for u in order]
        checks += [at[("all-reduce", u)] < at[("reduce-scatter", later)]
                   for u, later in zip(order, order[2:], strict=False)]
        checks += [at[("all-reduce", u)] < at[("end of backward", "")] for u in order[:-1]]
        assert all(checks) != defer, log


# --- bytes per group: the formula equals the meter --------------------------------------------------

def _all_reduce_then_reduce_scatter(self, grad: torch.Tensor, sync: bool) -> None:
    """The planted order: all-reduce the whole unsharded gradient across nodes, then reduce-scatter
    within the node. The same numbers; s× the inter-node bytes."""
    grad = grad.to(self.reduce_dtype)
    if self._accumulated is not None:
        grad, self._accumulated = self._accumulated.add_(grad), None
    if not sync:
        self._accumulated = grad
        return
    dist.all_reduce(grad, group=self.replicate_group)
    out = grad.new_empty(self.shard_numel)
    reduce_scatter_single(out, grad, group=self.group)
    self._reduce, self._replicating = (None, out, grad), True


def metered_hsdp(cases: list[tuple[int, str, bool]]) -> list[dict]:
    return [metered_step(*case) for case in cases]


def metered_step(shard_size: int, sharding: str, broken: bool) -> dict:
    """4 linears of 18 and 20 parameters (padded to s), each a unit; 2 micro-batches under
    no_sync, then clipping; the meter's bytes over each group, and the formula's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 5), nn.Linear(5, 3), nn.Linear(3, 5)).double()
    fsdp = FullyShardedDataParallel(model, process_group=node_groups(shard_size),
                                    sharding_strategy=ShardingStrategy[sharding],
                                    auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    if broken:
        for h in fsdp._handles():
            h.reduce_grad = types.MethodType(_all_reduce_then_reduce_scatter, h)
    gen = torch.Generator().manual_seed(dist.get_rank())
    with CommMeter() as meter:
        with fsdp.no_sync():
            fsdp(torch.randn(2, 5, dtype=torch.float64, generator=gen)).sum().backward()
        fsdp(torch.randn(2, 5, dtype=torch.float64, generator=gen)).sum().backward()
        fsdp.clip_grad_norm_(1e-3)
    shard, replicate = fsdp.process_group, fsdp.replicate_group
    formula = fsdp_comm_bytes_by_group(unit_traffic(fsdp.shard_layout()), dist.get_world_size(shard),
                                       fsdp.sharding_strategy, micro_batches=2, no_sync=True, clip=True,
                                       replicate_size=dist.get_world_size(replicate))
    return {"intra": meter.bytes_over(shard), "inter": meter.bytes_over(replicate),
            "total": meter.bytes_sent, "formula": formula}


METERED = [(2, "HYBRID_SHARD", False), (1, "HYBRID_SHARD", False), (4, "HYBRID_SHARD", False),
           (2, "_HYBRID_SHARD_ZERO2", False), (2, "HYBRID_SHARD", True)]  # (s, strategy, planted order)


def test_hsdp_bytes_per_group_equal_the_formula_and_the_planted_order_is_caught(pools):
    """4 = 2×2, 1×4, 4×1. Intra-node (shard group): gathers, reduce-scatters, the clip scalar;
    inter-node (replicate group): the all-reduce of each reduced shard, P_u/s elements; nothing
    else on the wire. The planted order (all-reduce the whole unit across nodes, then
    reduce-scatter) trains the same numbers, which the equivalence check cannot see, but sends
    s× the formula's inter-node bytes."""
    for rank, results in enumerate(pools.run(4, metered_hsdp, METERED)):
        for (s, sharding, broken), result in zip(METERED, results, strict=True):
            formula, where = result["formula"], (rank, s, sharding, broken)
            assert result["intra"] == pytest.approx(formula["intra"], rel=1e-12), where
            if broken:
                print("inter-node bytes / formula", result["inter"] / formula["inter"])
                assert result["inter"] > 1.5 * formula["inter"], where  # 2× here: s = 2
                continue
            assert result["inter"] == pytest.approx(formula["inter"], rel=1e-12), where
            assert result["total"] == pytest.approx(formula["intra"] + formula["inter"], rel=1e-12), where
            assert (result["inter"] > 0) == (s < 4) and (result["intra"] > 0) == (s > 1), where


def test_hsdp_comm_bytes_in_closed_form():
    """4 blocks of 1,000 fp32 elements on s = 4 × r = 2: intra (s-1)/s·(2·P·b + P·b) per step,
    inter 2(r-1)/r·P/s·b per rank."""
    blocks, P, b = [UnitTraffic(1000, 4000, 4, False)] * 4, 4000, 4
    split = fsdp_comm_bytes_by_group(blocks, 4, ShardingStrategy.HYBRID_SHARD, replicate_size=2)
    assert split["intra"] == pytest.approx(3 / 4 * 3 * P * b, rel=1e-15)
    assert split["inter"] == pytest.approx(2 * 1 / 2 * P / 4 * b, rel=1e-15)
    zero2 = fsdp_comm_bytes_by_group(blocks, 4, ShardingStrategy._HYBRID_SHARD_ZERO2, replicate_size=2)
    assert zero2 == {"intra": pytest.approx(3 / 4 * 2 * P * b, rel=1e-15), "inter": split["inter"]}
    assert fsdp_comm_bytes(blocks, 8, ShardingStrategy.FULL_SHARD) == pytest.approx(7 / 8 * 3 * P * b,
                                                                                   rel=1e-15)


def network_cut(s: int, r: int, micro_batches: int = 1, b_p: int = 4, b_r: int = 4) -> float:
    """FULL_SHARD's network bytes per node over HYBRID_SHARD's: 4 blocks of 4,096 elements."""
    blocks = [UnitTraffic(4096, 4096 * b_p, b_r, False)] * 4
    flat, hsdp = (network_bytes(blocks, s, r, ShardingStrategy[name], micro_batches, no_sync=True)
                  for name in ("FULL_SHARD", "HYBRID_SHARD"))
    return (flat["network_gather"] + flat["network_reduce"]) / hsdp["network_reduce"]


def test_hsdp_network_bytes_per_node_and_per_nic():
    """A flat ring over n = s·r ranks with each node's GPUs adjacent: only its r hops between nodes
    use the network, one channel per NIC, so per node FULL_SHARD sends one rank's (n-1)/n·3P·b,
    1/s of it per NIC; HSDP sends 2(r-1)/r·P·b per node (each GPU all-reduces its P/s across the
    r nodes). The cut is 1.5·(n-1)/n·r/(r-1): 2.8125× at s = 8, r = 2 and ≈1.5× as r grows, not
    the 1.5·s× (12× at s = 8) once claimed; the all-gathers (2/3 of FULL_SHARD's network bytes,
    repeated every micro-batch) are what HSDP keeps in the node."""
    P, b = 4 * 4096, 4
    blocks = [UnitTraffic(4096, 4096 * b, b, False)] * 4
    flat = network_bytes(blocks, 8, 2, ShardingStrategy.FULL_SHARD)
    assert flat["network_gather"] == pytest.approx(15 / 16 * 2 * P * b, rel=1e-15)
    assert flat["network_reduce"] == pytest.approx(15 / 16 * P * b, rel=1e-15)
    assert flat["network_per_nic"] == pytest.approx(15 / 16 * 3 * P * b / 8, rel=1e-15)
    assert flat["nvlink_per_gpu"] == pytest.approx(15 / 16 * 3 * P * b * 7 / 8, rel=1e-15)
    assert (flat["shard_ring"], flat["replicate_ring"]) == (16, 1)
    hsdp = network_bytes(blocks, 8, 2, ShardingStrategy.HYBRID_SHARD)
    assert hsdp["network_gather"] == 0
    assert hsdp["network_reduce"] == pytest.approx(2 * 1 / 2 * P * b, rel=1e-15)
    per_rank = fsdp_comm_bytes_by_group(blocks, 8, ShardingStrategy.HYBRID_SHARD, replicate_size=2)
    assert hsdp["network_per_nic"] == pytest.approx(per_rank["inter"], rel=1e-15)
    assert hsdp["nvlink_per_gpu"] == pytest.approx(7 / 8 * 3 * P * b, rel=1e-15)
    assert (hsdp["shard_ring"], hsdp["replicate_ring"]) == (8, 2)
    assert network_cut(8, 2) == pytest.approx(2.8125, rel=1e-15)  # 1.5 · 15/16 · 2
    assert network_cut(8, 64) == pytest.approx(1.5 * 511 / 512 * 64 / 63, rel=1e-15)  # → 1.5
    assert network_cut(8, 2, micro_batches=4) == pytest.approx(15 / 16 * (8 + 1) / 1, rel=1e-15)
    assert network_cut(8, 2, b_p=2) == pytest.approx(15 / 16 * (4 + 4) / 4, rel=1e-15)  # bf16 gathers


# --- train.py: flags validated before any collective; --check and the report per group ---------------

def train_cli(argv: list[str]) -> dict:
    from common.training import train
    args = fsdp_train.parse_args(argv)
    run = fsdp_train.validate(args, dist.get_world_size())
    ctx = init_distributed()
    return train(run, ctx, fsdp_train.build(run, ctx), chapter=4)


def test_train_hsdp_check_passes_and_reports_bytes_per_group(pools):
    argv = ["--model", "tiny", "--steps", "2", "--global-batch", "8", "--seq-len", "8", "--check",
            "--data", "synthetic", "--log-every", "0", "--grad-accum", "2", "--clip-grad", "1.0",
            "--dtype", "float64", "--sharding-strategy", "HYBRID_SHARD", "--nodes", "2"]
    report = pools.run(4, train_cli, argv)[0]
    assert report["check_passed"] and report["max_grad_diff"] <= 1e-10, report
    assert report["mesh"] == {"dp_replicate": 2, "dp_shard": 2}
    assert report["comm_bytes_per_rank"] == pytest.approx(report["comm_bytes_formula"], rel=1e-12)
    for group in ("intra", "inter"):
        measured, formula = report[f"comm_bytes_{group}"], report[f"comm_bytes_{group}_formula"]
        assert measured == pytest.approx(formula, rel=1e-12), group
    assert report["comm_bytes_intra"] + report["comm_bytes_inter"] == pytest.approx(
        report["comm_bytes_per_rank"], rel=1e-12)
    assert report["inter_vs_flat"] < 1 / 3  # s = 2, r = 2: 2(r-1)/r·P/s vs 3(n-1)/n·P
    assert report["full_params_peak"] == report["full_params_peak_formula"]


@pytest.mark.parametrize("argv, env, message", [
    (["--sharding-strategy", "HYBRID_SHARD", "--nodes", "3"], "4", r"--nodes 3: 4 ranks do not split into "
                                                                   r"3 equal nodes; use one of 1, 2, 4"),
    (["--nodes", "2"], "4", r"--nodes 2 with --sharding-strategy FULL_SHARD: .*use --sharding-strategy "
                            r"HYBRID_SHARD"),
    (["--sharding-strategy", "HYBRID_SHARD"], None, r"without --nodes: .*LOCAL_WORLD_SIZE=None.*--nodes N"),
    (["--sharding-strategy", "_HYBRID_SHARD_ZERO2"], "3", r"LOCAL_WORLD_SIZE=3 \(world size 4\)"),
    (["--sharding-strategy", "HYBRID_SHARD", "--nodes", "2", "--impl", "torch-fsdp2"], "4",
     r"--impl torch-fsdp2 with --sharding-strategy HYBRID_SHARD: .*use --impl ours"),
])
def test_bad_hsdp_flags_fail_before_any_collective(monkeypatch, argv, env, message):
    """validate() reads only the flags and the environment (no process group exists here)."""
    monkeypatch.setenv("PFS_BACKEND", "gloo")
    if env is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", env)
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match=message):
        fsdp_train.validate(fsdp_train.parse_args(argv), 4)


def node_groups(per_node: int) -> tuple:
    """torch's default HSDP groups (a node = per_node consecutive ranks), from the kernel's mesh."""
    world = dist.get_world_size()
    mesh = build_mesh(MeshShape(dp_replicate=world // per_node, dp_shard=per_node),
                      ("dp_shard", "dp_replicate"))
    return mesh.group("dp_shard"), mesh.group("dp_replicate")


def wrap_with_one_group_twice() -> None:
    shard, _ = node_groups(2)
    FullyShardedDataParallel(nn.Sequential(nn.Linear(3, 3)), process_group=(shard, shard),
                             sharding_strategy=ShardingStrategy.HYBRID_SHARD)


def test_overlapping_groups_are_refused_on_every_rank_before_any_collective(pools):
    with pytest.raises(RankError, match=r"replicate_group \[0, 1\]\) must share only this rank "
                                        r".*build_mesh\(MeshShape\(dp_replicate") as info:
        pools.run(4, wrap_with_one_group_twice)
    assert sorted(info.value.errors) == [0, 1, 2, 3]
    pools.run(4, dist.barrier)  # no rank was left inside a collective
