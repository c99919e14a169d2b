"""fp16 with dynamic loss scaling under DP (01), ZeRO (03) and FSDP (04): every rank skips the step
one rank's overflow calls for, and each strategy equals the single-device fp16 reference.

The recipe (common/loss_scaler.py): fp16 compute over fp32 masters, backward from s·loss, the
fp32 gradients unscaled, the overflow flag all-reduced over the strategy's group, the step skipped
on an inf/nan, s backed off or grown. The reference follows it on one device, teacher-forced
(parameters and scaler state), at TOLERANCE["fp16-mixed"]; a scale or skip that differs from the
reference's at any step fails outright ("loss_scale": inf).

Each run is 3 steps with scale 2⁴⁰, backoff 2⁻²⁸, growth every good step: step 0 overflows on
every rank (s·g > 65504 for any g > 2⁻²⁴), s → 2¹²; step 1 trains, s → 2¹³; at step 2 one rank
finds an inf in its own gradients (planted: an fp16 overflow that landed in one shard), s → 2⁻¹⁵.
The negative control checks the flag locally: under ZeRO and FSDP the other ranks step their
shards while the poisoned one skips, and the run leaves the reference. Under DP an inf planted
before the gradient all-reduce reaches every rank through it (a local check agrees already), so
DP's control plants it after the all-reduce, where only the flag's all-reduce carries it.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings

from common.cli import ConfigError
from common.dist import init_distributed
from common.kernel.model import get_config
from common.loss_scaler import LossScaling, agreement_bytes
from common.reference import TOLERANCE
from common.training import Strategy, build_and_train
from data_parallel import train as dp_train
from fsdp import train as fsdp_train
from tests.equivalence import (
    TrainSpec,
    data_parallel_specs,
    lockstep_reference,
    run_strategy,
    spec_args,
    spec_run,
    teacher_forced_differences,
    with_spec,
)
from tests.harness import examples
from zero import train as zero_train

SCALING = LossScaling(init_scale=2.0**40, growth_factor=2.0, backoff_factor=2.0**-28, growth_interval=1)
POISONED_STEP = 2
FP16 = TOLERANCE["fp16-mixed"]


def fp16_spec(spec: TrainSpec) -> TrainSpec:
    """lr 1e-3, as bf16's properties: AdamW moves an element whose gradient is within fp16
    rounding of zero by up to 2·lr whatever the strategy does."""
    return with_spec(spec, steps=3, mixed_precision="fp16", loss_scaling=SCALING, clip_grad=1.0, lr=1e-3)


def ddp(spec: TrainSpec) -> Strategy:
    return dp_train.build(spec_run(spec, dp_train.validate, strategy="ddp", bucket_mb=0.004),
                          init_distributed())


def zero(spec: TrainSpec, stage: int) -> Strategy:
    args = spec_args(spec, stage=stage, offload=False, config=None, reduce_bucket_size=None,
                     allgather_bucket_size=None, param_persistence_threshold=0, no_overlap=False)
    return zero_train.build(zero_train.validate(args, spec.world_size), init_distributed())


def fsdp(spec: TrainSpec, sharding: str) -> Strategy:
    args = spec_args(spec, sharding_strategy=sharding, impl="ours", no_sync=False, no_prefetch=False,
                     nodes=2 if sharding == "HYBRID_SHARD" else None)
    return fsdp_train.build(fsdp_train.validate(args, spec.world_size), init_distributed())


def poisoned(spec: TrainSpec, make, make_args: tuple, where: str, agree: bool) -> Strategy:
    """`make(spec, *make_args)` with an inf in the last rank's gradient at POISONED_STEP: in its
    reduced gradients ("after": what an fp16 overflow in one shard looks like) or in its local
    gradient before the reduction ("before"). `agree` False: the negative control, whose ranks
    each read their own flag."""
    strategy, steps = make(spec, *make_args), [0]
    mine = dist.get_rank() == dist.get_world_size() - 1
    after_backward = strategy.after_backward

    def plant_after() -> None:
        after_backward()
        if mine and steps[0] == POISONED_STEP and where == "after":
            strategy.local_gradients()[0].view(-1)[0] = math.inf
        steps[0] += 1

    def plant_before(grad: torch.Tensor) -> torch.Tensor:
        if mine and steps[0] == POISONED_STEP:
            grad = grad.clone()
            grad.view(-1)[0] = math.inf
        return grad

    strategy.after_backward = plant_after
    if where == "before":
        next(strategy.model.parameters()).register_hook(plant_before)
    if not agree:
        skip_alone(strategy)
    return strategy


def skip_alone(strategy: Strategy) -> None:
    """The negative control: each rank skips on its own flag, never agreed. A rank that simply
    returned from step() would leave the others waiting in the step's collectives (ZeRO's
    all-gather, clipping's norm): a hang, here as on NCCL. So the skipping rank zeroes its update
    instead (gradients 0, lr 0 for this step) and takes part in every collective."""
    scaler, step = strategy.scaler, strategy.step
    scaler.skip_step = lambda group=None: False

    def step_alone() -> None:
        groups = strategy.optimizer.param_groups
        lrs, alone = [g["lr"] for g in groups], bool(scaler.found_inf.item())
        if alone:
            for grad in strategy.local_gradients():
                grad.zero_()
            for g in groups:
                g["lr"] = 0.0
        step()
        for g, lr in zip(groups, lrs, strict=True):
            g["lr"] = lr

    strategy.step = step_alone


def differences(pools, spec: TrainSpec, make, make_args: tuple = (), where: str = "after",
                agree: bool = True) -> dict[str, float]:
    """The strategy's run against the fp16 reference poisoned at the same step (any element: one
    inf anywhere makes one device skip), and "moved": 1 if the gathered parameters changed at the
    poisoned step, which every rank should have skipped (0: not one bit moved)."""
    record = run_strategy(pools, spec, poisoned, make, make_args, where, agree)
    start = record.step_params[POISONED_STEP]
    moved = float(any(not torch.equal(record.params[n], start[n]) for n in start))
    reference = lockstep_reference(spec)
    scaler, calls, unscale = reference.trainer.scaler, [0], reference.trainer.scaler.unscale_

    def unscale_poisoned(grads):
        grads = list(grads)
        if calls[0] == POISONED_STEP:
            grads[0].view(-1)[0] = math.inf
        calls[0] += 1
        return unscale(grads)

    scaler.unscale_ = unscale_poisoned
    scales = [s["scale"] for s in record.scaler_states]  # rank 0's
    assert scales == [2.0**40, 2.0**12, 2.0**13, 2.0**(14 if not agree and where == "after" else -15)], scales
    return {**teacher_forced_differences(record, spec, reference), "moved": moved}


def matches(diffs: dict[str, float]) -> bool:
    return max(diffs.values()) <= FP16 and diffs["moved"] == 0


def rejected(diffs: dict[str, float]) -> bool:
    """The ranks diverged: some stepped their part at the poisoned step, and rank 0, which saw no
    inf, grew its scale where the reference backed off."""
    return diffs["moved"] == 1 and diffs["loss_scale"] == math.inf


specs = data_parallel_specs(world_sizes=(2, 3), dtype="float32")
FIXED = TrainSpec(cfg=get_config("tiny", n_layers=1), world_size=2, global_batch=4, micro_batch=1,
                  seq_len=4, steps=3, dtype="float32")


@settings(max_examples=examples(2))
@given(spec=specs)
def test_ddp_fp16_skips_every_rank_on_one_ranks_overflow(pools, spec):
    """DP: the overflow flag's all-reduce skips every rank's step; an inf after the gradients'
    all-reduce on one rank, checked there alone, lets the others step (rejected). Before the
    all-reduce the gradients' own all-reduce carries it: a local check agrees (inf + x = inf)."""
    spec = fp16_spec(spec)
    assert matches(diffs := differences(pools, spec, ddp)), diffs
    assert matches(diffs := differences(pools, spec, ddp, where="before", agree=False)), diffs
    assert rejected(diffs := differences(pools, spec, ddp, agree=False)), diffs


@pytest.mark.parametrize("stage", [1, 2, 3])
@settings(max_examples=examples(1))
@given(spec=specs)
def test_zero_fp16_skips_every_rank_on_one_shards_overflow(pools, stage, spec):
    """ZeRO 1-3: the inf lands in one owner's gradient shard; agreed, every rank skips and the run
    equals the reference; checked locally (the control), the other owners step their slices."""
    spec = fp16_spec(spec)
    assert matches(diffs := differences(pools, spec, zero, (stage,))), diffs
    assert rejected(diffs := differences(pools, spec, zero, (stage,), agree=False)), diffs


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
@settings(max_examples=examples(1))
@given(spec=specs)
def test_fsdp_fp16_skips_every_rank_on_one_shards_overflow(pools, sharding, spec):
    """FSDP: the same property over the shard group (FULL_SHARD, SHARD_GRAD_OP), and its control."""
    spec = fp16_spec(spec)
    assert matches(diffs := differences(pools, spec, fsdp, (sharding,))), diffs
    assert rejected(diffs := differences(pools, spec, fsdp, (sharding,), agree=False)), diffs


def test_hsdp_fp16_agrees_over_the_shard_group(pools):
    """HSDP on 4 ranks (2 nodes × 2): an inf found after the replicas' all-reduce reaches the
    other node only through the flag's all-reduce over every rank."""
    spec = fp16_spec(with_spec(FIXED, world_size=4, global_batch=4))
    assert matches(diffs := differences(pools, spec, fsdp, ("HYBRID_SHARD",))), diffs
    assert rejected(diffs := differences(pools, spec, fsdp, ("HYBRID_SHARD",), agree=False)), diffs


def loop_report(spec: TrainSpec) -> dict:
    run = spec_run(spec, dp_train.validate, strategy="ddp", bucket_mb=25.0)
    return build_and_train(replace(run, check=True), init_distributed(), dp_train.build, chapter=1)


def test_fp16_through_the_loop_with_check(pools):
    """`--mixed-precision fp16 --check` through the shared loop (01, 2 ranks): the check passes with
    the scaler's state as the reference's, the report carries the final scale and the skipped step,
    and the accounted bytes equal the formula with the flag's 2(n-1)/n·4 per step."""
    spec = fp16_spec(FIXED)
    report = pools.run(2, loop_report, spec)[0]
    assert report["check_passed"] and report["loss_scale_mismatches"] == [], report
    assert (report["loss_scale"], report["skipped_steps"]) == (2.0**14, 1)
    assert report["comm_bytes_per_rank"] == report["comm_bytes_formula"]
    assert report["comm"]["all_reduce"]["bytes"] >= 3 * agreement_bytes(2)


@pytest.mark.parametrize(("chapter", "flags", "match"), [
    ("data_parallel", ["--dtype", "float16"], r"--dtype float16: .* --mixed-precision fp16"),
    ("data_parallel", ["--strategy", "naive", "--mixed-precision", "fp16"], r"naive: the naive version"),
    ("ring_allreduce", ["--mixed-precision", "fp16"], r"fp16 trains in 01_data_parallel"),
    ("tensor_parallel", ["--mixed-precision", "fp16"], r"fp16 trains in 01_data_parallel"),
    ("pipeline", ["--mixed-precision", "fp16"], r"fp16 trains in 01_data_parallel"),
    ("parallel3d", ["--mixed-precision", "fp16"], r"fp16 trains in 01_data_parallel"),
    ("fsdp", ["--mixed-precision", "fp16", "--impl", "torch-fsdp2"], r"FSDP2 yardstick runs no loss scaler"),
    ("zero", ["--mixed-precision", "fp16", "--dtype", "float64"], r"master weights are float32"),
    ("data_parallel", ["--mixed-precision", "fp16", "--model", "tiny-moe", "--data", "synthetic"],
     r"aux loss"),
])
def test_fp16_refused_in_one_line_where_not_supported(chapter, flags, match):
    """Where fp16 does not run, validation says so on every rank before any collective, naming the
    flag and where it does run."""
    train = importlib.import_module(f"{chapter}.train")
    with pytest.raises(ConfigError, match=match) as error:
        train.validate(train.parse_args(["--model", "tiny", *flags]), 4)
    assert "\n" not in str(error.value)
