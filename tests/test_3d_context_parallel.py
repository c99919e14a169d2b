"""Chapter 07 with context parallelism, the mesh's fourth dimension: cp ranks of a replica share
each sequence (zig-zag chunks), attention passes K/V around the CP ring, FSDP shards over dp × cp.
The 3D trainer with cp 2 and 4 trains the same numbers as one device (float64 1e-10, with TP+SP,
PP, DP, recomputation, clipping, GQA; bf16 mixed at its tolerance); the CP replicas double
counted in clipping are rejected; the comm formula (and its CP ring part) equals the meter; bad
input fails on every rank before any collective."""

from __future__ import annotations

import re
from dataclasses import replace
from unittest import mock

import pytest
import torch

from common.dist import init_distributed
from common.kernel.model import LlamaConfig
from parallel3d import train as train3d
from parallel3d.clip import clip_grad_norm_3d
from parallel3d.comm_formulas import cp_bytes_per_step
from parallel3d.train import Parallel3DStrategy
from tests.equivalence import TrainSpec, check_strategy, check_strategy_rejected, spec_args


def flags(dp: int, pp: int, cp: int, tp: int, sp: bool = False, ac: str = "none",
          sharding: str = "FULL_SHARD", schedule: str = "1f1b") -> dict:
    return dict(dp=dp, pp=pp, cp=cp, tp=tp, schedule=schedule, microbatches=None, virtual_stages=None,
                sequence_parallel=sp, activation_checkpointing=ac, sharding_strategy=sharding,
                lr_schedule="constant", warmup_steps=None, min_lr_ratio=0.1)


def strategy_cp(spec: TrainSpec, chapter_flags: dict, cls=Parallel3DStrategy, args=None):
    args = args or spec_args(spec, **chapter_flags)
    return cls(train3d.validate(args, spec.world_size), init_distributed())


CFG = LlamaConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=32, multiple_of=8)  # GQA
SPEC = TrainSpec(cfg=CFG, world_size=8, dp=1, global_batch=4, micro_batch=1, seq_len=8, steps=2,
                 clip_grad=1e-2, optimizer="sgd")  # 1e-2 clips (SGD feels the coefficient, AdamW barely)


@pytest.mark.parametrize("mesh, sp, ac, sharding, optimizer", [
    ((1, 2, 2, 2), True, "selective", "FULL_SHARD", "sgd"),   # tp 2 · cp 2 · pp 2, SP in the s/cp tokens
    ((2, 2, 2, 1), False, "full", "NO_SHARD", "sgd"),         # dp 2 · cp 2 · pp 2: replicas over dp × cp
    ((1, 2, 4, 1), False, "none", "SHARD_GRAD_OP", "adamw"),  # cp 4
])
def test_cp_in_the_mesh_equals_single_device_float64(pools, mesh, sp, ac, sharding, optimizer):
    dp, pp, cp, tp = mesh
    spec = TrainSpec(**{**SPEC.__dict__, "dp": dp, "global_batch": 4 * dp, "optimizer": optimizer})
    check_strategy(pools, spec, strategy_cp, flags(dp, pp, cp, tp, sp, ac, sharding))


def test_cp_with_mixed_precision_equals_mixed_precision_reference(pools):
    spec = TrainSpec(**{**SPEC.__dict__, "dtype": "float32", "mixed_precision": "bf16", "clip_grad": 1.0})
    check_strategy(pools, spec, strategy_cp, flags(1, 2, 2, 2, sp=True))


class CPReplicasCountedTwice(Parallel3DStrategy):
    """Clipping's norm counts a NO_SHARD unit on every CP rank of DP rank 0 (only the dp × cp
    group's rank 0 should): the squared norm cp times too large."""

    def step(self):
        on_dp_rank_0 = self.device_mesh.dp_rank == 0
        shards = replace(self.shards, pieces=tuple(replace(p, counted=on_dp_rank_0)
                                                   for p in self.shards.pieces))
        with mock.patch("parallel3d.train.clip_grad_norm_3d",
                        lambda _, max_norm: clip_grad_norm_3d(shards, max_norm)):
            super().step()


def test_cp_replicas_double_counted_in_clipping_are_rejected(pools):
    spec = TrainSpec(**{**SPEC.__dict__, "dp": 2, "global_batch": 4, "steps": 1})
    check_strategy_rejected(pools, spec, strategy_cp, flags(2, 2, 2, 1, sharding="NO_SHARD"),
                            CPReplicasCountedTwice)


def metered_step(spec: TrainSpec, chapter_flags: dict) -> tuple[float, float, float, float]:
    from common.comm import CommMeter
    from common.training import rank_micro_batches

    strategy = strategy_cp(spec, chapter_flags)
    micro = rank_micro_batches(strategy, spec.data().global_batch(0, spec.global_batch),
                               spec.micro_batch, torch.device("cpu"))
    with CommMeter() as meter:
        strategy.forward_backward(micro)
        strategy.step()
        strategy.zero_grad()
    return (meter.bytes_sent, strategy.formulas(1)[0], strategy.cp_sent[0],
            cp_bytes_per_step(strategy.rank3d, 1))


@pytest.mark.parametrize("chapter, mixed", [
    (flags(2, 2, 2, 1, ac="full"), False),
    (flags(1, 2, 2, 2, sp=True, ac="selective"), True),  # bf16 K/V, dK/dV in float32
])
def test_comm_formula_and_its_cp_ring_part_equal_the_meter(pools, chapter, mixed):
    """Recomputation reruns the ring's forward in backward; FSDP's terms over dp × cp."""
    spec = TrainSpec(**{**SPEC.__dict__, "global_batch": 4 * chapter["dp"], "dp": chapter["dp"],
                        "dtype": "float32" if mixed else "float64",
                        "mixed_precision": "bf16" if mixed else "none"})
    for measured, formula, ring, ring_formula in pools.run(8, metered_step, spec, chapter):
        assert measured == pytest.approx(formula, rel=1e-12), (measured, formula)
        assert ring == pytest.approx(ring_formula, rel=1e-12) and ring > 0, (ring, ring_formula)


BAD_INPUT = [
    (["--cp", "2", "--tp", "2", "--pp", "2", "--dp", "2"],
     r"--dp 2 × --pp 2 × --cp 2 × --tp 2 = 16 != world size 8"),
    (["--cp", "3"], r"world size 8 is not divisible by --cp 3: launch a multiple of 3 ranks"),
    (["--cp", "0"], r"--cp 0: must be >= 1"),
    (["--cp", "2", "--seq-len", "30"], r"--cp 2 with --seq-len 30: .* divisible by 4"),
    (["--cp", "2", "--tp", "4", "--pp", "1", "--sequence-parallel", "--seq-len", "4"],
     r"--tp 4: .*divisible by 4 \(the 2 tokens of a CP rank"),
]


def validation_errors(argvs: list[list[str]], world_size: int) -> list[str | None]:
    """Each argv's ConfigError message from validate() on this rank (None: accepted)."""
    errors = []
    for argv in argvs:
        try:
            train3d.validate(train3d.parse_args(argv), world_size)
            errors.append(None)
        except train3d.ConfigError as error:
            errors.append(str(error))
    return errors


def test_bad_cp_input_fails_on_every_rank_before_any_collective(pools):
    """validate() joins no collective: every rank rejects each bad argv on its own."""
    for errors in pools.run(8, validation_errors, [argv for argv, _ in BAD_INPUT], 8):
        for (argv, message), error in zip(BAD_INPUT, errors, strict=True):
            assert error is not None and re.search(message, error), (argv, error)


def build_cp(mesh: tuple[int, int, int, int], steps: int, root: str):
    dp, pp, cp, tp = mesh
    spec = TrainSpec(**{**SPEC.__dict__, "world_size": dp * pp * cp * tp, "dp": dp, "steps": steps})
    args = spec_args(spec, checkpoint_dir=root, save_every=0, resume="never", keep=2,
                     **{**flags(dp, pp, cp, tp), "lr_schedule": "cosine", "warmup_steps": 1})
    return strategy_cp(spec, {}, args=args), spec


def train_steps(strategy, spec: TrainSpec, start: int, stop: int) -> None:
    from common.training import rank_micro_batches

    for step in range(start, stop):
        micro = rank_micro_batches(strategy, spec.data().global_batch(step, spec.global_batch),
                                   spec.micro_batch, torch.device("cpu"))
        strategy.forward_backward(micro)
        strategy.step()
        strategy.zero_grad()


def saved_or_resumed(root: str, mesh: tuple[int, int, int, int], resume: bool) -> dict | None:
    """3 steps on `mesh`: uninterrupted, saving after step 1; or resumed from that checkpoint."""
    from parallel3d.checkpoint.trainer import load_trainer_state, save_trainer_state

    strategy, spec = build_cp(mesh, steps=3, root=root)
    plan = strategy.run.options.checkpoint
    state, ident = strategy.checkpoints.state, {"data": plan.data, "config": plan.config}
    start = load_trainer_state(state, root, **ident) if resume else 0
    if not resume:
        train_steps(strategy, spec, 0, 1)
        save_trainer_state(state, root, 1, **ident)
        start = 1
    train_steps(strategy, spec, start, 3)
    return strategy.full_parameters()


def test_checkpoint_saved_with_cp_resumes_on_a_mesh_without_it(pools, tmp_path):
    """FSDP's shards over dp × cp are regions of the reference tensors like any others."""
    expected = pools.run(4, saved_or_resumed, str(tmp_path), (1, 1, 2, 2), False)[0]
    got = pools.run(4, saved_or_resumed, str(tmp_path), (2, 2, 1, 1), True)[0]
    worst = max(((got[n] - expected[n]).abs().max() / expected[n].abs().max()).item() for n in expected)
    assert worst <= 1e-10, worst
