"""Chapter 07 with expert parallelism and HSDP as dimensions of its mesh (experts.py): a MoE LLaMA
trained over EP × TP × PP (× HSDP's replicas) equals one device in float64 (free-running, 1-3
steps at 1e-10: routing, capacity, the aux loss, accumulation, clipping); `--check` passes and the
report's bytes per group (and EP's all-to-alls) equal their formulas; the three classic EP bugs
(and an aux loss counted on every TP rank) go red; every bad combination fails on every rank
before any collective."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

from common.dist import init_distributed
from common.kernel.mesh import ParallelMesh
from common.kernel.model import LlamaConfig, get_config
from common.kernel.moe import moe_layers
from common.training import build_and_train
from fsdp.fully_sharded import FullyShardedDataParallel
from parallel3d import train as train3d
from parallel3d.clip import clip_grad_norm_3d
from parallel3d.parallelize import parallelize_3d
from parallel3d.shards import ShardMap, first_holder
from parallel3d.train import Parallel3DStrategy
from tensor_parallel.expert_parallel import is_expert
from tests.equivalence import TrainSpec, check_strategy, check_strategy_rejected, spec_args
from tests.harness import RankError

# (dp_replicate, dp_shard, pp, tp, ep); sharding strategies fit dp_replicate
MESHES_4 = [(1, 2, 1, 2, 2), (2, 2, 1, 1, 2), (1, 2, 2, 1, 2), (1, 4, 1, 1, 2)]


def moe_flags(R: int, S: int, pp: int, tp: int, ep: int, sharding: str, schedule: str = "1f1b",
              sp: bool = False, ac: str = "none") -> dict:
    return dict(dp=R * S, dp_replicate=R, dp_shard=S, pp=pp, tp=tp, ep=ep, schedule=schedule,
                microbatches=None, virtual_stages=None, sequence_parallel=sp, activation_checkpointing=ac,
                sharding_strategy=sharding, lr_schedule="constant", warmup_steps=None, min_lr_ratio=0.1)


def strategy_moe(spec: TrainSpec, chapter_flags: dict, cls=Parallel3DStrategy):
    args = spec_args(spec, **chapter_flags)
    return cls(train3d.validate(args, spec.world_size), init_distributed())


def moe_config(tp: int, ep: int, pp: int, experts_per_rank: int = 2, top_k: int = 2, shared: int = 1,
               gate: str = "softmax", capacity: float | None = None, dense: int = 1) -> LlamaConfig:
    return LlamaConfig(dim=16, n_layers=2 * pp, n_heads=2 * tp, n_kv_heads=tp, vocab_size=32,
                       multiple_of=4 * tp, n_experts=ep * experts_per_rank, top_k=top_k,
                       n_shared_experts=shared, moe_hidden_dim=4 * tp, gate=gate, aux_loss_coef=0.01,
                       capacity_factor=capacity, first_dense_layers=dense)


@st.composite
def moe_specs(draw):
    R, S, pp, tp, ep = draw(st.sampled_from(MESHES_4))
    cfg = moe_config(tp, ep, pp, draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])),
                     draw(st.sampled_from([0, 1])), draw(st.sampled_from(["softmax", "sigmoid"])),
                     draw(st.sampled_from([None, 1.0])), draw(st.sampled_from([0, 1])))
    micro, accum = draw(st.integers(1, 2)), (pp if pp > 1 else draw(st.sampled_from([1, 2])))
    sharding = draw(st.sampled_from(["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"] if R > 1
                                    else ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]))
    spec = TrainSpec(cfg=cfg, world_size=R * S * pp * tp, dp=R * S, global_batch=R * S * micro * accum,
                     micro_batch=micro, seq_len=4 * tp, steps=draw(st.integers(1, 2)),
                     optimizer=draw(st.sampled_from(["adamw", "sgd"])), seed=draw(st.integers(0, 999)),
                     clip_grad=draw(st.sampled_from([1e-2, None])))
    chapter = moe_flags(R, S, pp, tp, ep, sharding, sp=tp > 1 and draw(st.booleans()),
                        ac=draw(st.sampled_from(["none", "full", "selective"])))
    return spec, chapter


# 8 ranks, every dimension but HSDP's (the --check run below has HSDP): EP 2 × TP 2 × PP 2,
# interleaved, full recomputation, 4 micro-batches per pipeline, clipping that clips
EP_TP_PP = (TrainSpec(cfg=replace(moe_config(2, 2, 2), n_layers=8), world_size=8, dp=2, global_batch=8,
                      micro_batch=1, seq_len=8, steps=2, optimizer="sgd", clip_grad=1e-2),
            {**moe_flags(1, 2, 2, 2, 2, "FULL_SHARD", "interleaved", sp=True, ac="full"),
             "virtual_stages": 2})


@given(drawn=moe_specs())
@example(drawn=EP_TP_PP)
def test_moe_3d_trainer_equals_single_device_float64(pools, drawn):
    spec, chapter = drawn
    check_strategy(pools, spec, strategy_moe, chapter)


# --- --check and the report: HSDP × EP × TP on 8 ranks, every group's bytes beside its formula ---

def train_cli(argv: list[str]) -> dict:
    """train.py's path in the rank pool: parse_args, validate, common.training.build_and_train."""
    run = train3d.validate(train3d.parse_args(argv), dist.get_world_size())
    return build_and_train(run, init_distributed(), train3d.build, 7)


def test_hsdp_ep_tp_check_passes_and_every_group_matches_its_formula(pools):
    argv = ["--model", "tiny-moe", "--dp-replicate", "2", "--dp-shard", "2", "--tp", "2", "--ep", "2",
            "--sequence-parallel",
            "--dtype", "float64", "--steps", "2", "--global-batch", "8", "--grad-accum", "2",
            "--seq-len", "8", "--clip-grad", "0.05", "--check", "--data", "synthetic", "--log-every", "0"]
    reports = pools.run(8, train_cli, argv)
    assert all(r["check_passed"] for r in reports) and reports[0]["max_grad_diff"] < 1e-12
    assert reports[0]["free_running"]["max_param_diff"] < 1e-10
    assert reports[0]["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "ep": 2}
    for r in reports:
        groups = [k for k in r if k.startswith("comm_bytes_") and f"{k}_formula" in r]
        assert sorted(groups) == ["comm_bytes_dp_replicate", "comm_bytes_dp_shard/ep", "comm_bytes_tp"]
        for key in groups:
            assert r[key] == pytest.approx(r[f"{key}_formula"], rel=1e-12), key
        assert r["comm_bytes_per_rank"] == pytest.approx(r["comm_bytes_formula"], rel=1e-12)
        sent = r["comm"]["all_to_all_single"]["bytes"]
        assert sent == pytest.approx(r["ep_all_to_all_bytes_formula"], rel=1e-12) and sent > 0
    # each step as slow as its worst dispatch (a MoE layer's all-to-all, one micro-batch) on any EP group
    for step, imbalance in enumerate(reports[0]["ep_load_imbalance"]):
        worst = max(max(rows) / (sum(rows) / 2) for r in reports for rows in r["ep_rows_per_dispatch"][step])
        assert len(reports[0]["ep_rows_per_dispatch"][step]) == 7 * 2  # MoE layers × micro-batches
        assert imbalance == pytest.approx(worst, rel=1e-12)


# --- negative controls: the three classic bugs of expert parallelism ---------------------------

class ExpertGradientsDividedByTheirGroup(Parallel3DStrategy):
    """The experts' FSDP units keep FSDP's divisor, their group's dp·cp/ep ranks, not dp·cp:
    expert gradients ep× too large (torchtitan's set_gradient_divide_factor forgotten)."""

    def __init__(self, run, ctx):
        with mock.patch.object(FullyShardedDataParallel, "set_gradient_divide_factor", lambda self, f: None):
            super().__init__(run, ctx)


def counted_by_the_dense_rule(shards: ShardMap, mesh) -> ShardMap:
    """Each expert piece counted as if its unit were replicated over the whole dp_shard × cp
    group, not over the ranks holding the same experts: only EP rank 0's experts count."""
    return replace(shards, pieces=tuple(
        replace(p, counted=first_holder(shards.units[p.unit], mesh, False)) if is_expert(p.name)
        else p for p in shards.pieces))


class NormCountedOverTheWrongGroup(Parallel3DStrategy):
    def clip_grad_norm_(self, max_norm):
        return clip_grad_norm_3d(counted_by_the_dense_rule(self.shards, self.device_mesh), max_norm)


def sliced_by_global_rank(*args, **kwargs):
    with mock.patch.object(ParallelMesh, "ep_rank", property(lambda mesh: mesh.rank % mesh.ep)):
        return parallelize_3d(*args, **kwargs)


class ExpertSliceByGlobalRank(Parallel3DStrategy):
    """Each rank draws the experts of slice (global rank mod ep), not of its EP rank: under TP,
    rank 1 (tp 1, ep 0) holds slice 1 while the all-to-all sends it slice 0's tokens (the recipe
    only: the ShardMap still places each rank's pieces at its true slice)."""

    def __init__(self, run, ctx):
        with mock.patch.object(train3d, "parallelize_3d", sliced_by_global_rank):
            super().__init__(run, ctx)


class AuxLossOnEveryTPRank(Parallel3DStrategy):
    """Every TP rank backpropagates the whole aux loss (05's TensorParallelMoE without its 1/t):
    after the router's TP sums it counts t times."""

    def __init__(self, run, ctx):
        super().__init__(run, ctx)
        for layer in moe_layers(self.model):
            layer.tp = 1


# SGD at lr 1 (Adam's update hardly sees a clipping coefficient), clipping that clips
BUG_SPEC = TrainSpec(cfg=moe_config(2, 2, 1), world_size=4, dp=2, global_batch=4, micro_batch=1,
                     seq_len=8, steps=1, optimizer="sgd", lr=1.0, clip_grad=1e-2)


@pytest.mark.parametrize("broken, mesh", [
    (ExpertGradientsDividedByTheirGroup, (1, 4, 1, 1, 2)),  # experts sharded over 2 of the 4
    (NormCountedOverTheWrongGroup, (1, 2, 1, 2, 2)),  # ep = dp_shard: each expert unit on one rank
    (ExpertSliceByGlobalRank, (1, 2, 1, 2, 2)),
    (AuxLossOnEveryTPRank, (1, 2, 1, 2, 2)),
])
def test_broken_expert_parallelism_is_rejected(pools, broken, mesh):
    R, S, pp, tp, ep = mesh
    spec = replace(BUG_SPEC, cfg=moe_config(tp, ep, pp), dp=R * S, global_batch=R * S * 2)
    check_strategy_rejected(pools, spec, strategy_moe, moe_flags(*mesh, "FULL_SHARD"), broken)


# --- bad input ---------------------------------------------------------------------------------

def validate_argv(argv: list[str], overrides: dict):
    args = train3d.parse_args(argv)
    args.cfg = get_config(args.model, **overrides) if overrides else None
    return train3d.validate(args, dist.get_world_size())


FLAT = ["--tp", "1", "--pp", "1"]


@pytest.mark.parametrize("argv, overrides, message", [
    (["--model", "tiny", "--ep", "2"], {}, r"--ep 2 with --model tiny: the model has no experts"),
    (["--model", "tiny-moe", *FLAT, "--ep", "3"], {},
     r"--ep 3 does not divide the 4 ranks it borrows .*: use one of --ep 1, 2, 4$"),
    (["--model", "tiny-moe", "--dp-replicate", "2", "--dp-shard", "2", "--ep", "4", *FLAT], {},
     r"--ep 4 does not divide the 2 ranks it borrows \(dp_shard 2 × cp 1: its groups are consecutive "
     r"ranks of one replica\): use one of --ep 1, 2$"),
    (["--model", "tiny-moe", *FLAT, "--ep", "4"], {"n_experts": 6},
     r"--ep 4 does not divide the 6 experts .*: use one of --ep 1, 2$"),
    (["--dp-replicate", "2", "--dp-shard", "3"], {},
     r"--dp-replicate 2 × --dp-shard 3 = 6 != world size 4"),
    (["--model", "tiny-moe", "--cp", "2", "--tp", "1", "--pp", "1"], {},
     r"--cp 2 with --model tiny-moe, a mixture-of-experts model: .* use --cp 1"),
    (["--sharding-strategy", "HYBRID_SHARD"], {}, r"HYBRID_SHARD \(HSDP\) needs --dp-replicate R > 1"),
    (["--dp-replicate", "2", "--sharding-strategy", "FULL_SHARD"], {},
     r"--dp-replicate 2 with --sharding-strategy FULL_SHARD: .* HYBRID_SHARD or _HYBRID_SHARD_ZERO2"),
    (["--model", "tiny-moe", "--tp", "4", "--pp", "1"], {"moe_hidden_dim": 6},
     r"--tp 4: the experts' hidden size 6 is not divisible by the TP size 4"),
])
def test_bad_input_fails_on_every_rank_before_any_collective(pools, argv, overrides, message):
    with pytest.raises(RankError, match=message) as info:
        pools.run(4, validate_argv, argv, overrides)
    assert sorted(info.value.errors) == [0, 1, 2, 3]
