"""The shared loop and property helper (common.training, tests.equivalence): a strategy written
only against the interface is checked in a few lines, and a broken one is caught."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import data_parallel.train as dp_train
from common.data import SyntheticTokens
from common.dist import init_distributed
from common.kernel.mesh import MeshShape
from common.kernel.model import get_config
from common.memory import CudaPeakMeter
from common.profile import WINDOW_PREFIXES, load_events, rank_lanes
from common.run import Run
from common.training import build_and_train, measure_activations, rank_micro_batches
from data_parallel.train import STRATEGIES, DataParallelStrategy
from fsdp.torch_fsdp2 import fsdp2_unavailable
from tests.equivalence import (
    TrainSpec,
    check_strategy,
    check_strategy_rejected,
    data_parallel_specs,
    spec_run,
    with_spec,
)


def data_parallel_strategy(spec: TrainSpec, strategy: str = "ddp", bucket_mb: float = 25.0):
    run = spec_run(spec, dp_train.validate, strategy=strategy, bucket_mb=bucket_mb)
    return DataParallelStrategy(run, init_distributed(), STRATEGIES[strategy])


class PartialNormClipping(DataParallelStrategy):
    """Toy broken strategy: its clip hook scales half of the gradients, by the norm of that half."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        master = self.weights.master
        return torch.nn.utils.clip_grad_norm_(master[: len(master) // 2], max_norm, foreach=False)


def broken_clipping_strategy(spec: TrainSpec):
    run = spec_run(spec, dp_train.validate, strategy="ddp", bucket_mb=25.0)
    return PartialNormClipping(run, init_distributed(), STRATEGIES["ddp"])


@given(spec=data_parallel_specs(), clip=st.sampled_from([None, 1e-3, 1e3]),
       strategy=st.sampled_from(["naive", "ddp"]))
def test_data_parallel_strategy_with_clipping_equals_single_device_float64(pools, spec, clip, strategy):
    check_strategy(pools, with_spec(spec, clip_grad=clip), data_parallel_strategy, strategy, 0.001)


@given(spec=data_parallel_specs(world_sizes=(2, 3), dtype="float32"))
def test_ddp_mixed_precision_equals_mixed_precision_reference(pools, spec):
    """bf16 compute, fp32 main_grad buckets and fp32 master AdamW, against the reference that
    follows the same recipe: TOLERANCE['bf16-mixed'] = 5e-2 in the global relative norm."""
    check_strategy(pools, with_spec(spec, mixed_precision="bf16", clip_grad=1.0),
                   data_parallel_strategy, "ddp", 0.001)


NEGATIVE = TrainSpec(cfg=get_config("tiny", n_layers=1), world_size=2, global_batch=4, micro_batch=1,
                     seq_len=6, steps=2, clip_grad=1e-3, optimizer="sgd")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_toy_strategy_with_partial_clipping_norm_is_rejected(pools, optimizer):
    check_strategy_rejected(pools, with_spec(NEGATIVE, optimizer=optimizer), broken_clipping_strategy)


def no_copy_back_strategy(spec: TrainSpec):
    """Toy broken mixed-precision strategy: AdamW steps the fp32 masters, which are never copied
    into the bf16 model (it keeps computing with its initial weights)."""
    strategy = data_parallel_strategy(spec)
    strategy.weights.copy_to_model = lambda: None
    return strategy


@pytest.mark.parametrize("precision, broken, margin", [
    ({"dtype": "float32"}, broken_clipping_strategy, 100.0),
    ({"dtype": "float32", "mixed_precision": "bf16"}, no_copy_back_strategy, 5.0)])
def test_teacher_forced_check_still_rejects_a_broken_strategy_in_reduced_precision(pools, precision,
                                                                                   broken, margin):
    """Reduced-precision properties compare each step from the strategy's own parameters (like
    `--check`); that must not forgive a bug: the partial clipping norm misses by > 100× TOLERANCE
    in float32 (measured param 1.8e-2 against 1e-4), the missing master → model copy by > 5× in
    bf16 mixed (measured grad 4.2e-1 against 5e-2). Partial clipping alone stays under bf16's 5e-2
    in two steps (param 1.8e-2 with AdamW, 1.1e-3 with SGD: at lr 1e-2 clipping moves too little)."""
    check_strategy_rejected(pools, with_spec(NEGATIVE, optimizer="adamw", **precision), broken,
                            margin=margin)


# --- the loop on a GPU's terms: no host read inside a step, the peak over the windows only -------

HOST_READS = ("item", "tolist", "__float__", "__bool__")


@contextmanager
def counting_host_reads(counts: Counter, where: Callable[[], str]):
    """Count every read of a tensor's values into Python (a host sync on CUDA) by `where()`."""
    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            counts[where(), name, str(self.dtype)] += 1
            return original(self, *args, **kwargs)
        return read

    with ExitStack() as stack:
        for name in HOST_READS:
            stack.enter_context(mock.patch.object(torch.Tensor, name, counted(name)))
        yield


class WindowTracker(dp_train.DataParallelStrategy):
    """DDP that tells the counter which part of the loop runs: its forward_backward, its
    optimizer step (AdamW reads its CPU step counters there: not a device sync), or the loop."""

    part = "loop"

    def forward_backward(self, micro_batches):
        WindowTracker.part = "forward_backward"
        try:
            loss = super().forward_backward(micro_batches)
        finally:
            WindowTracker.part = "loop"
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
        return loss

    def step(self) -> None:
        WindowTracker.part = "optimizer step"
        try:
            super().step()
        finally:
            WindowTracker.part = "loop"


def host_reads_of_a_run(argv: list[str]) -> tuple[Counter, dict]:
    args = dp_train.parse_args(["--model", "tiny", "--seq-len", "8", "--global-batch", "8",
                                "--grad-accum", "2", "--data", "synthetic", "--steps", "3", *argv])
    run = dp_train.validate(args, dist.get_world_size())
    reads: Counter = Counter()
    build = lambda r, ctx: WindowTracker(r, ctx, dp_train.STRATEGIES[r.options.strategy])  # noqa: E731
    with counting_host_reads(reads, lambda: WindowTracker.part):
        report = build_and_train(run, init_distributed(), build, 1)
    parts: Counter = Counter()
    for (part, *_), n in reads.items():
        parts[part] += n
    return parts, report


@pytest.mark.parametrize("log_every, loop_reads", [(0, 1), (2, 3)])
def test_loop_reads_losses_only_on_logged_steps_and_once_at_the_end(pools, log_every, loop_reads):
    """3 steps of 2 micro-batches: forward_backward reads nothing (its loss stays a tensor); the
    loop reads one [k, 2] loss buffer per logged step (steps 2 and 3 for --log-every 2) and once
    at the end. The saved-tensor meter is off when asked (on CUDA, by default)."""
    flags = ["--log-every", str(log_every)] + (["--no-measure-activations"] if log_every else [])
    (reads, report), _ = pools.run(2, host_reads_of_a_run, flags)
    assert reads["forward_backward"] == 0, reads
    assert reads["loop"] == loop_reads, reads
    assert len(report["losses"]) == 3 and all(5 < loss < 6 for loss in report["losses"])
    peak = report["memory"]["activations_peak"]
    assert (peak is None) if log_every else (peak > 0)


def forward_backward_reads(module: str, argv: list[str]) -> tuple[Counter, bool]:
    """One forward_backward of a chapter's strategy under the read counter; (the reads, whether
    this rank returned a loss, which must then be a 0-dim tensor)."""
    chapter = importlib.import_module(module)
    args = chapter.parse_args(["--model", "tiny", "--seq-len", "8", "--data", "synthetic", *argv])
    run = chapter.validate(args, dist.get_world_size())
    strategy = chapter.build(run, init_distributed())
    tokens = SyntheticTokens(256, 8, 0).global_batch(0, run.global_batch)
    micro = rank_micro_batches(strategy, tokens, run.micro_batch, torch.device("cpu"))
    reads: Counter = Counter()
    with counting_host_reads(reads, lambda: "forward_backward"):
        loss = strategy.forward_backward(micro)
    assert loss is None or (isinstance(loss, torch.Tensor) and loss.dim() == 0), type(loss)
    return reads, loss is not None


TWO_MICRO = ["--global-batch", "4", "--grad-accum", "2"]


@pytest.mark.parametrize("module, argv", [
    ("data_parallel.train", ["--strategy", "naive", *TWO_MICRO]),
    ("zero.train", ["--stage", "3", *TWO_MICRO]),
    ("fsdp.train", TWO_MICRO),
    ("data_parallel.train", ["--mixed-precision", "fp16", *TWO_MICRO]),  # the loss scaler: unscale_
    ("zero.train", ["--stage", "2", "--mixed-precision", "fp16", *TWO_MICRO]),  # checks on the device
    ("fsdp.train", ["--mixed-precision", "fp16", *TWO_MICRO]),
    pytest.param("fsdp.train", ["--impl", "torch-fsdp2", *TWO_MICRO], marks=pytest.mark.skipif(
        fsdp2_unavailable("cpu") is not None, reason=str(fsdp2_unavailable("cpu")))),
    ("tensor_parallel.train", ["--tp", "2", *TWO_MICRO]),
    ("pipeline.train", ["--schedule", "1f1b", "--global-batch", "4", "--microbatches", "4"]),
    ("parallel3d.train", ["--pp", "2", "--dp", "1", "--tp", "1", "--global-batch", "4",
                          "--microbatches", "4"]),
])
def test_forward_backward_reads_no_value_to_the_host(pools, module, argv):
    """The hot-path rule: `.item()` per micro-batch, or a data-dependent branch (`.any()` in the
    vocab-parallel loss), is a host sync on a GPU; the loss comes back as a device tensor."""
    results = pools.run(2, forward_backward_reads, module, argv)
    assert [reads for reads, _ in results] == [Counter(), Counter()]
    assert any(has_loss for _, has_loss in results)


def test_vocab_parallel_loss_decides_the_padding_on_the_host():
    """vocab 6 in a range of 8 columns: the 2 padding columns are masked from the shapes (no
    `.any()`/bool read of the data), and the loss and gradient are those of the 6 real columns."""
    from tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    logits = torch.randn(3, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[0, 5, 2, 1], [3, 4, 5, 0], [1, 1, 2, 3]])
    ours, theirs = logits.clone().requires_grad_(), logits[..., :6].clone().requires_grad_()
    reads: Counter = Counter()
    with counting_host_reads(reads, lambda: "loss"):
        loss = vocab_parallel_cross_entropy(ours, targets, None, vocab_start=0, vocab_size=6).mean()
        loss.backward()
    assert not reads, reads
    expected = torch.nn.functional.cross_entropy(theirs.flatten(0, 1), targets.flatten())
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(ours.grad[..., :6], theirs.grad, rtol=1e-12, atol=1e-15)
    assert (ours.grad[..., 6:] == 0).all()


class FakeAllocator:
    """The CUDA caching allocator's counters, driven by hand: `alloc`/`free` move the live total."""

    def __init__(self):
        self.live = self.peak = 0

    def alloc(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def free(self, n: int) -> None:
        self.live -= n

    @contextmanager
    def installed(self):
        reset = lambda device=None: setattr(self, "peak", self.live)  # noqa: E731
        with mock.patch("torch.cuda.reset_peak_memory_stats", reset), \
                mock.patch("torch.cuda.max_memory_allocated", lambda device=None: self.peak), \
                mock.patch("torch.cuda.memory_allocated", lambda device=None: self.live):
            yield self


def test_cuda_peak_counts_the_windows_only_and_not_the_check_reference():
    """The loop's sequence on rank 0 of a sharded job, against a fake allocator: building the
    full model then sharding it (peak 1000), the --check reference resident (300), per step a
    window that finds 100 of shards resident and allocates 50, the --check gathers (400) outside,
    the reference's step (its AdamW state, 60, stays), then the optimizer window (+20). The
    strategy's peak is 100 + 50 = 150: no reset would give 1000, no exclusion 510."""
    with FakeAllocator().installed() as fake:
        fake.alloc(1000)
        fake.free(900)  # the full model built, then sharded: 100 resident
        peak = CudaPeakMeter(torch.device("cuda", 0))
        with peak.exclude():
            fake.alloc(300)
        for step in range(2):
            with peak:
                fake.alloc(50)
                fake.free(50)
            fake.alloc(400)  # gathered full gradients and parameters, to the reference
            with peak.exclude():
                fake.alloc(30)  # the reference's step: its temporaries
                fake.free(30)
                if step == 0:
                    fake.alloc(60)  # its optimizer state, created at its first step
            fake.free(400)
            with peak:
                fake.alloc(20)
                fake.free(20)
    assert peak.bytes == 150
    assert CudaPeakMeter(torch.device("cpu")).bytes is None


def test_activation_meter_is_opt_in_on_cuda_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert measure_activations(None, cpu)
    assert not measure_activations(None, cuda)
    assert measure_activations(True, cuda)
    assert not measure_activations(False, cpu)


# --- --profile DIR: a trace per rank of the timed windows, the numbers unchanged -----------------

def profiled_ddp_run(directory: str | None) -> dict:
    """2 steps of tiny DDP with one bucket per few parameters (so backward issues several)."""
    argv = ["--model", "tiny", "--seq-len", "8", "--global-batch", "4", "--data", "synthetic",
            "--steps", "2", "--bucket-mb", "0.01", "--log-every", "0"]
    args = dp_train.parse_args(argv + (["--profile", directory] if directory else []))
    return build_and_train(dp_train.validate(args, 2), init_distributed(), dp_train.build, 1)


def test_profile_traces_the_bucket_all_reduces_inside_backward_and_changes_no_number(pools, tmp_path):
    """Step 2 is traced (step 1 is warm-up); every bucket all-reduce DDP issued in it is in the
    trace (its call on the training thread, its transfer on gloo's worker thread), inside the
    forward_backward window; the losses equal an unprofiled run's."""
    plain = pools.run(2, profiled_ddp_run, None)
    profiled = pools.run(2, profiled_ddp_run, str(tmp_path))
    assert [r["losses"] for r in profiled] == [r["losses"] for r in plain]
    buckets_per_step = profiled[0]["comm"]["all_reduce"]["calls"] // 2
    assert buckets_per_step >= 2, profiled[0]["comm"]
    for rank in range(2):
        events = load_events(tmp_path / f"rank{rank}.json")
        windows = {e["name"]: e for e in events if e["name"].startswith(WINDOW_PREFIXES)}
        assert sorted(windows) == ["forward_backward 2", "optimizer step 2"]
        backward_from, step_from = windows["forward_backward 2"]["ts"], windows["optimizer step 2"]["ts"]
        for name in ("c10d::allreduce_", "gloo:all_reduce"):
            starts = [e["ts"] for e in events if e["name"] == name]
            in_backward = [t for t in starts if backward_from <= t < step_from]
            assert len(starts) == len(in_backward) == buckets_per_step, (name, len(starts))
        _, lanes = rank_lanes(events)
        assert lanes["backward"] and lanes["communication"] and lanes["optimizer"]


# --- one run per chapter: validate returns it, frozen, and the namespace stops there ---------------

CHAPTER_ARGV = {  # one demo command line per chapter's validate (05 twice: TP and EP), on 4 ranks
    "data_parallel.train": ["--strategy", "naive", "--grad-accum", "2"],
    "ring_allreduce.train": ["--algorithm", "naive", "--bench-mb", "0"],
    "zero.train": ["--stage", "3", "--clip-grad", "1.0"],
    "fsdp.train": ["--sharding-strategy", "HYBRID_SHARD", "--nodes", "2", "--no-sync"],
    "tensor_parallel.train": ["--tp", "2", "--sequence-parallel"],
    "tensor_parallel.train_expert": ["--model", "tiny-moe", "--ep", "2"],
    "pipeline.train": ["--schedule", "interleaved", "--microbatches", "4"],
    "parallel3d.train": ["--tp", "2", "--pp", "2", "--schedule", "interleaved"],
}


def namespaces_inside(value, path: str = "run") -> list[str]:
    """Where an argparse namespace (or any non-frozen dataclass) hides in a run's values."""
    if isinstance(value, argparse.Namespace):
        return [path]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        found = [] if value.__dataclass_params__.frozen else [f"{path} (not frozen)"]
        return found + [p for f in dataclasses.fields(value)
                        for p in namespaces_inside(getattr(value, f.name), f"{path}.{f.name}")]
    if isinstance(value, (list, dict)):
        return [f"{path} (mutable {type(value).__name__})"]
    if isinstance(value, tuple):
        return [p for i, v in enumerate(value) for p in namespaces_inside(v, f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("chapter", list(CHAPTER_ARGV))
def test_validate_returns_a_frozen_run_that_holds_no_namespace(chapter):
    """The strategy, the loop and the report take the run alone: every value resolved once, in
    validation, into frozen dataclasses (the mesh shape and the chapter's options among them)."""
    module = importlib.import_module(chapter.split()[0])
    argv = ["--model", "tiny", "--data", "synthetic", "--global-batch", "8", *CHAPTER_ARGV[chapter]]
    run = module.validate(module.parse_args(argv), 4)
    assert isinstance(run, Run) and isinstance(run.mesh, MeshShape) and run.mesh.world == 4
    assert namespaces_inside(run) == []
    assert run.global_batch == run.mesh.dp * run.grad_accum * run.micro_batch
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.steps = 1
