"""Chapter 07: the planner's per-rank memory predictions (memory_model, from the config alone)
against what the 3D trainer's report measures on every rank of three CPU meshes."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from common.dist import init_distributed
from common.kernel.model import CONFIGS
from common.training import build_and_train
from parallel3d import train as train3d
from parallel3d.memory_model import Layout, activation_bytes, stage_units, state_bytes

SEQ, GLOBAL_BATCH = 32, 8  # the tiny model, float32, AdamW; one micro-batch of one sequence


def train_cli(argv: list[str]) -> dict:
    """train.py's path in the rank pool: parse_args, validate, common.training.build_and_train."""
    run = train3d.validate(train3d.parse_args(argv), dist.get_world_size())
    return build_and_train(run, init_distributed(), train3d.build, 7)


def predicted(layout: Layout, microbatches: int, stage: int) -> dict[str, float]:
    """memory_model's at-rest model states (no gathered blocks: the report measures after the
    step) and saved activations (no recomputation transient: the ledger cannot see it)."""
    cfg = CONFIGS["tiny"]
    states = state_bytes(stage_units(cfg, layout.tp, layout.pp)[stage], layout.dp, layout.zero,
                         "fp32")
    return {"params": states["weights"], "grads": states["grads"], "optimizer": states["optimizer"],
            "activations_peak": activation_bytes(cfg, layout, SEQ, microbatches, elem=4,
                                                 stage=stage)}


# (dp, pp, tp), SP, recomputation, FSDP sharding → ZeRO level of the closed form
MESHES = [((2, 2, 2), False, "none", "FULL_SHARD", 3),
          ((2, 2, 2), True, "selective", "NO_SHARD", 0),
          ((4, 2, 1), False, "full", "FULL_SHARD", 3)]


@pytest.mark.parametrize("mesh, sp, recompute, sharding, zero", MESHES)
def test_memory_model_predicts_every_ranks_measured_memory(pools, mesh, sp, recompute, sharding,
                                                           zero):
    """Model states exactly (⌈P_u/d⌉ per FSDP unit, AdamW's m, v and a step count per unit);
    saved activations (blocks × micro-batches in flight on the stage, the last stage's head)
    within 10% below what the ledger sees, which also holds token ids and RoPE tables."""
    dp, pp, tp = mesh
    argv = ["--model", "tiny", "--dtype", "float32", "--optimizer", "adamw", "--steps", "1",
            "--seq-len", str(SEQ), "--global-batch", str(GLOBAL_BATCH), "--micro-batch", "1",
            "--dp", str(dp), "--pp", str(pp), "--tp", str(tp), "--schedule", "1f1b",
            "--activation-checkpointing", recompute, "--sharding-strategy", sharding,
            "--log-every", "0", "--data", "synthetic", *(["--sequence-parallel"] if sp else [])]
    reports = pools.run(dp * pp * tp, train_cli, argv)
    layout = Layout(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=1, recompute=recompute,
                    sequence_parallel=sp)
    for rank, report in enumerate(reports):
        stage = report["memory_per_rank"][rank]["pp"]
        expect = predicted(layout, GLOBAL_BATCH // dp, stage)
        measured = report["memory"]
        for key in ("params", "grads", "optimizer"):
            assert measured[key] == expect[key], (rank, key, measured[key], expect[key])
        ratio = expect["activations_peak"] / measured["activations_peak"]
        assert 0.9 <= ratio <= 1.0, (rank, ratio)
