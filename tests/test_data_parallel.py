"""Chapter 01: naive DP and bucketed DDP train the same numbers as one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from common.cli import ConfigError, batch_layout
from common.comm import CommMeter
from common.data import local_micro_batches, split_inputs_targets
from common.dist import init_distributed
from common.forkrun import torchrun_forked
from common.kernel.model import build_model, get_config, loss_fn
from common.kernel.patch import patch_dist
from common.reference import TOLERANCE
from common.report import printed_line
from common.run import Run
from common.training import build_and_train
from data_parallel import DistributedDataParallel, assign_buckets
from data_parallel import train as dp_train
from tests.data_parallel_runs import SumNotAverageDDP, run_data_parallel, wrap
from tests.equivalence import (
    TrainSpec,
    assert_matches_reference,
    compare,
    data_parallel_specs,
    differences,
    reference_record,
)
from tests.harness import RankError

REPO = Path(__file__).resolve().parent.parent


bucket_caps = st.sampled_from([1e-6, 0.001, 0.004, 25.0])  # one tensor per bucket … one bucket


@given(spec=data_parallel_specs(), strategy=st.sampled_from(["naive", "ddp"]), bucket_cap_mb=bucket_caps)
def test_data_parallel_equals_single_device_float64(pools, spec, strategy, bucket_cap_mb):
    assert_matches_reference(run_data_parallel(pools, spec, strategy, bucket_cap_mb), spec)


@given(spec=data_parallel_specs(dtype="float32"), strategy=st.sampled_from(["naive", "ddp"]),
       bucket_cap_mb=bucket_caps)
def test_data_parallel_equals_single_device_float32(pools, spec, strategy, bucket_cap_mb):
    """Tolerance TOLERANCE[float32] = 1e-4 in the global relative norm (AdamW amplifies float32
    rounding of near-zero gradients up to lr/eps; see common/reference.py)."""
    assert_matches_reference(run_data_parallel(pools, spec, strategy, bucket_cap_mb), spec)


@given(spec=data_parallel_specs(world_sizes=(2, 4), dtype="bfloat16"), bucket_cap_mb=bucket_caps)
def test_ddp_equals_single_device_bfloat16(pools, spec, bucket_cap_mb):
    """Tolerance TOLERANCE[bfloat16] = 5e-2 in the global relative norm: bf16 stores 7 mantissa
    bits (8 of precision), and each micro-batch's matmuls round differently from the whole batch."""
    assert_matches_reference(run_data_parallel(pools, spec, "ddp", bucket_cap_mb), spec)


NEGATIVE_SPEC = TrainSpec(cfg=get_config("tiny", n_layers=1), world_size=2, global_batch=4,
                          micro_batch=1, seq_len=6, steps=2)


@pytest.mark.parametrize("broken", ["sum-not-average", "skip-first-bucket"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_broken_data_parallel_is_detected(pools, broken, optimizer):
    spec = TrainSpec(**{**NEGATIVE_SPEC.__dict__, "optimizer": optimizer})
    with pytest.raises(AssertionError, match=r"differs from single-device training|drifted"):
        assert_matches_reference(run_data_parallel(pools, spec, broken, 0.004), spec)
    record = run_data_parallel(pools, spec, broken, 0.004, replicas_must_agree=False)
    assert differences(record, reference_record(spec))["grad"] > 1e3 * TOLERANCE[torch.float64]


@pytest.mark.parametrize("broken", ["sum-not-average", "skip-first-bucket"])
def test_broken_ddp_is_detected_in_bfloat16(pools, broken):
    """The bfloat16 property's negative control: teacher-forced (each step from the strategy's own
    parameters), a broken DDP misses by more than 10× the bf16 tolerance."""
    spec = TrainSpec(**{**NEGATIVE_SPEC.__dict__, "dtype": "bfloat16", "steps": 3})
    diffs = compare(run_data_parallel(pools, spec, broken, 1e-6, replicas_must_agree=False), spec)
    assert diffs["grad"] > 10 * TOLERANCE[torch.bfloat16], diffs


def test_sum_not_average_hides_from_adamw_loss_but_not_from_gradients(pools):
    """Why the suite compares gradients: with AdamW, n× too large gradients barely move the loss."""
    spec = TrainSpec(**{**NEGATIVE_SPEC.__dict__, "steps": 2})
    diffs = differences(run_data_parallel(pools, spec, "sum-not-average"), reference_record(spec))
    assert diffs["loss"] < 1e-3 < diffs["grad"], diffs


def metered_step(spec: TrainSpec, strategy: str, bucket_cap_mb: float) -> dict:
    model = build_model(spec.cfg, spec.seed, spec.torch_dtype)
    dp = wrap(model, strategy, bucket_cap_mb)
    micro = local_micro_batches(spec.data().global_batch(0, spec.global_batch), dist.get_rank(),
                                dist.get_world_size(), spec.micro_batch)
    with CommMeter() as meter:
        for i, tokens in enumerate(micro):
            inputs, targets = split_inputs_targets(tokens)
            with nullcontext() if i == len(micro) - 1 else dp.no_sync():
                loss_fn(dp(inputs), targets).backward()
            if i < len(micro) - 1:
                assert meter.calls("all_reduce") == 0, "no_sync must not communicate"
        dp.finish()
    n_buckets = len(dp.buckets) if strategy == "ddp" else len(list(model.parameters()))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"comm": meter.as_dict(), "calls_expected": n_buckets, "grad_bytes": grad_bytes}


@given(spec=data_parallel_specs(world_sizes=(1, 2, 3, 4)), strategy=st.sampled_from(["naive", "ddp"]),
       bucket_cap_mb=bucket_caps)
def test_comm_meter_shows_2_n_minus_1_over_n_gradient_bytes(pools, spec, strategy, bucket_cap_mb):
    result = pools.run(spec.world_size, metered_step, spec, strategy, bucket_cap_mb)[0]
    n = spec.world_size
    assert set(result["comm"]) == {"all_reduce"}
    assert result["comm"]["all_reduce"]["calls"] == result["calls_expected"]
    assert result["comm"]["all_reduce"]["bytes"] == pytest.approx(
        2 * (n - 1) / n * result["grad_bytes"], rel=1e-12, abs=0)


def test_buckets_follow_reverse_registration_order_and_cap():
    model = build_model(get_config("tiny", n_layers=2))
    named = list(model.named_parameters())
    buckets = assign_buckets(named, bucket_cap_bytes=40_000)
    flat = [name for bucket in buckets for name, _ in bucket]
    assert flat == [name for name, _ in reversed(named)]
    for bucket in buckets:
        size = sum(p.numel() * p.element_size() for _, p in bucket)
        assert size <= 40_000 or len(bucket) == 1
    assert len(assign_buckets(named, 1.0)) == len(named)
    assert len(assign_buckets(named, 1e12)) == 1


def record_overlap(bucket_cap_mb: float) -> list[str]:
    """Order of events in one backward: bucket launches vs the last gradient (the embedding's)."""
    model = build_model(get_config("tiny", n_layers=4), seed=0)
    dp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    events = []

    def launching(all_reduce):
        def launch(*args, **kwargs):
            events.append("launch")
            return all_reduce(*args, **kwargs)
        return launch

    model.tok_embeddings.weight.register_post_accumulate_grad_hook(lambda p: events.append("last grad"))
    with patch_dist({"all_reduce": launching}):
        tokens = torch.randint(0, 256, (2, 9))
        loss_fn(dp(tokens[:, :-1]), tokens[:, 1:]).backward()
        dp.finish()
    return events


def test_ddp_launches_buckets_during_backward(pools):
    events = pools.run(2, record_overlap, 0.01)[0]
    first_launch, last_grad = events.index("launch"), events.index("last grad")
    assert first_launch < last_grad and events.count("launch") > 2, events


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def backward_with_unused_parameter() -> None:
    dp = DistributedDataParallel(WithUnused(), bucket_cap_mb=1e-6)
    dp(torch.randn(2, 4)).sum().backward()
    dp.finish()


def test_unused_parameter_is_a_clear_error_on_every_rank(pools):
    with pytest.raises(RankError, match=r"unused\.weight") as info:
        pools.run(3, backward_with_unused_parameter)
    assert sorted(info.value.errors) == [0, 1, 2]
    pools.run(3, dist.barrier)  # no rank was left inside a collective


def test_batch_layout_rejects_bad_batches_naming_values_and_fix():
    assert batch_layout(16, 4, None, None) == (4, 1)
    assert batch_layout(16, 4, None, 2) == (2, 2)
    assert batch_layout(16, 4, 1, None) == (1, 4)
    with pytest.raises(ConfigError, match=r"--global-batch 10 is not divisible by .* 4.*multiple of 4"):
        batch_layout(10, 4, None, None)
    with pytest.raises(ConfigError, match=r"--micro-batch 3 does not divide the 4 sequences per rank"):
        batch_layout(16, 4, 3, None)
    with pytest.raises(ConfigError, match=r"--grad-accum 3 does not divide"):
        batch_layout(16, 4, None, 3)
    with pytest.raises(ConfigError, match=r"--grad-accum 3 × --micro-batch 2 != 4"):
        batch_layout(16, 4, 2, 3)


def validate_argv(argv: list[str]) -> Run:
    return dp_train.validate(dp_train.parse_args(argv), dist.get_world_size())


@pytest.mark.parametrize("argv, message", [
    (["--global-batch", "6"], r"--global-batch 6 is not divisible by the data-parallel size 4"),
    (["--bucket-mb", "0"], r"--bucket-mb 0.0: must be > 0"),
    (["--strategy", "zero"], r"--strategy 'zero' is unknown: use one of naive, ddp"),
    (["--micro-batch", "3"], r"--micro-batch 3 does not divide the 4 sequences per rank"),
    (["--data", "/no/such/file"], r"--data /no/such/file: no such file"),
    (["--steps", "0"], r"--steps 0: must be positive"),
])
def test_bad_input_fails_on_every_rank_before_any_collective(pools, argv, message):
    with pytest.raises(RankError, match=message) as info:
        pools.run(4, validate_argv, argv)
    assert sorted(info.value.errors) == [0, 1, 2, 3]


def test_ddp_rejects_a_negative_bucket_cap(pools):
    with pytest.raises(RankError, match=r"bucket_cap_mb=-1 must be >= 0"):
        pools.run(1, DistributedDataParallel, nn.Linear(2, 2), bucket_cap_mb=-1)


def build_broken(run: Run, ctx) -> dp_train.DataParallelStrategy:
    return dp_train.DataParallelStrategy(run, ctx,
                                         lambda model, r: SumNotAverageDDP(model, r.options.bucket_mb))


def train_cli(argv: list[str], broken: bool = False) -> dict:
    run = dp_train.validate(dp_train.parse_args([*argv, "--log-every", "0"]), dist.get_world_size())
    return build_and_train(run, init_distributed(), build_broken if broken else dp_train.build, 1)


CLI_ARGV = ["--model", "tiny", "--dtype", "float64", "--steps", "2", "--global-batch", "8",
            "--seq-len", "8", "--check", "--data", "synthetic"]


@pytest.mark.parametrize("strategy, dtype", [("naive", "float64"), ("ddp", "float64"), ("ddp", "float32")])
def test_train_check_passes_and_report_matches_formulas(pools, strategy, dtype):
    reports = pools.run(2, train_cli, [*CLI_ARGV, "--strategy", strategy, "--grad-accum", "2",
                                       "--bucket-mb", "0.01", "--dtype", dtype])
    assert all(r["check_passed"] for r in reports)
    report = reports[0]
    assert report["teacher_forced"]
    assert ("free_running" in report) == (dtype == "float64")
    assert max(report["max_param_diff"], report["max_grad_diff"]) <= report["tolerance"]
    assert report["comm_bytes_per_rank"] == pytest.approx(report["comm_bytes_formula"], rel=1e-12)
    for key in ("params", "grads", "optimizer"):
        assert report["memory"][key] == report["memory_formula"][key], key
    assert report["memory"]["activations_peak"] > 0


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_train_check_fails_on_a_broken_strategy_on_every_rank(pools, dtype):
    """Teacher forcing (float32) compares each step from the same parameters: it cannot hide a bug."""
    reports = pools.run(2, train_cli, [*CLI_ARGV, "--dtype", dtype], True)
    assert [r["check_passed"] for r in reports] == [False, False]
    assert reports[0]["max_grad_diff"] > 0.5


@pytest.mark.slow
def test_torchrun_check_exits_zero_with_json_report(tmp_path):
    """The issue's 'done when': `make run-1 ARGS="--dtype float64 --check"` (on 2 ranks, tiny), on
    forked ranks (torchrun itself launches chapter 01 in tests/test_gpu_check.py)."""
    proc = torchrun_forked(
        ["--standalone", "--nproc-per-node", "2",
         "01_data_parallel/train.py", "--dtype", "float64", "--check", "--model", "tiny",
         "--steps", "3", "--report", str(tmp_path / "r.json")],
        cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["max_param_diff"] <= 1e-10 and report["check_passed"]
    assert printed_line(json.loads((tmp_path / "r.json").read_text())) == report


def test_launch_without_torchrun_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    proc = subprocess.run([sys.executable, "01_data_parallel/train.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "torchrun --standalone --nproc-per-node N" in proc.stderr


def test_the_lessons_overlap_numbers_are_overlap_tokens():
    """01's README and overlap.md quote the tokens per rank the overlap condition needs, and ρ at
    16,384 tokens: each must be what `overlap_tokens` computes (H100 backward at half of 989
    TFLOP/s, 8 ranks; NVLink 360 GB/s, InfiniBand 45 GB/s; bf16 gradients and fp32 buckets)."""
    lesson = (REPO / "01_data_parallel" / "README.md").read_text(encoding="utf-8")
    page = (REPO / "01_data_parallel" / "overlap.md").read_text(encoding="utf-8")
    flops, tokens = 0.5 * 989e12, 4 * 4096
    for busbw, grad_bytes in ((360e9, 2), (360e9, 4), (45e9, 2), (45e9, 4)):
        need = dp_train.overlap_tokens(8, grad_bytes, flops, busbw)
        assert f"| {need:,.0f} | {need / tokens:.2f} |" in page, (
            f"overlap.md's row for {busbw:.0e} B/s, b = {grad_bytes}")
        if busbw == 45e9:
            assert f"{need:,.0f}" in lesson
