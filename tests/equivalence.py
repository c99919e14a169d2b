"""Shared pieces of the equivalence properties: a drawn training spec, the reference run in the
test process, and the comparison of a strategy's per-step gradients, losses and final parameters
against it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from hypothesis import strategies as st

from common.cli import DTYPES
from common.data import SyntheticTokens
from common.kernel.model import LlamaConfig
from common.loss_scaler import LossScaling
from common.reference import (
    METRIC,
    TOLERANCE,
    LockstepReference,
    make_reference,
    precision_key,
    relative_diff,
)
from common.run import Run
from common.training import Strategy, loss_value, rank_micro_batches


@dataclass(frozen=True)
class TrainSpec:
    cfg: LlamaConfig
    world_size: int
    global_batch: int
    micro_batch: int
    seq_len: int
    steps: int
    dtype: str = "float64"
    optimizer: str = "adamw"
    lr: float = 1e-2
    seed: int = 0
    clip_grad: float | None = None
    mixed_precision: str = "none"  # "bf16"/"fp16": that compute, fp32 master/reduce/optimizer (float32)
    loss_scaling: LossScaling = field(default_factory=LossScaling)  # fp16's scaler settings
    dp: int | None = None  # data-parallel size (default: world_size; TP and PP ranks share data)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def precision(self) -> torch.dtype | str:
        """The row of CONTRIBUTING.md's tolerance table this spec is checked against."""
        return precision_key(self.torch_dtype, self.mixed_precision)

    @property
    def dp_size(self) -> int:
        return self.world_size if self.dp is None else self.dp

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.dp_size * self.micro_batch)

    def data(self) -> SyntheticTokens:
        return SyntheticTokens(self.cfg.vocab_size, self.seq_len, self.seed)


@st.composite
def tiny_configs(draw, heads_multiple_of: int = 1, layers_multiple_of: int = 1) -> LlamaConfig:
    """Small random LLaMA shapes (GQA included)."""
    kv = heads_multiple_of * draw(st.integers(1, 2))
    heads = kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    return LlamaConfig(dim=heads * head_dim, n_layers=layers_multiple_of * draw(st.integers(1, 2)),
                       n_heads=heads, n_kv_heads=kv, vocab_size=draw(st.sampled_from([16, 32, 64])),
                       multiple_of=draw(st.sampled_from([4, 8, 16])))


@st.composite
def data_parallel_specs(draw, world_sizes=(1, 2, 3, 4), dtype: str = "float64") -> TrainSpec:
    world = draw(st.sampled_from(world_sizes))
    micro = draw(st.integers(1, 2))
    accum = draw(st.integers(1, 4))
    return TrainSpec(cfg=draw(tiny_configs()), world_size=world, global_batch=world * micro * accum,
                     micro_batch=micro, seq_len=draw(st.integers(2, 8)), steps=draw(st.integers(1, 3)),
                     dtype=dtype, optimizer=draw(st.sampled_from(["adamw", "sgd"])),
                     seed=draw(st.integers(0, 2**16)))


@dataclass
class RunRecord:
    """What a strategy (or the reference) did, per step: the loss and the gradients it applied,
    and the parameters at the end, all as full (gathered) tensors on CPU. In reduced precision
    also the parameters each step started from (`step_params`), for the teacher-forced check."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    params: dict[str, torch.Tensor]
    step_params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    scaler_states: list[dict] = field(default_factory=list)  # fp16: each step's start, then the end's


def reference_record(spec: TrainSpec) -> RunRecord:
    trainer = make_reference(spec.cfg, spec.seed, spec.torch_dtype, spec.optimizer, spec.lr,
                             clip_grad=spec.clip_grad, mixed_precision=spec.mixed_precision)
    data, losses, grads = spec.data(), [], []
    for step in range(spec.steps):
        loss, g = trainer.step(data.global_batch(step, spec.global_batch))
        losses.append(loss)
        grads.append(g)
    return RunRecord(losses, grads, {k: v.clone() for k, v in trainer.parameters().items()})


def differences(record: RunRecord, reference: RunRecord,
                dtype: torch.dtype | str = torch.float64) -> dict[str, float]:
    """Max relative differences of a run from the reference, measured as common.reference's
    TOLERANCE comment says (in METRIC[dtype])."""
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(record.losses, reference.losses, strict=True)),
        "grad": max(relative_diff(g, r, METRIC[dtype])
                    for g, r in zip(record.grads, reference.grads, strict=True)),
        "param": relative_diff(record.params, reference.params, METRIC[dtype]),
    }


def lockstep_reference(spec: TrainSpec) -> LockstepReference:
    return LockstepReference(spec.cfg, spec.seed, spec.torch_dtype, spec.optimizer, spec.lr,
                             clip_grad=spec.clip_grad, mixed_precision=spec.mixed_precision,
                             loss_scaling=spec.loss_scaling)


def teacher_forced_differences(record: RunRecord, spec: TrainSpec,
                               reference: LockstepReference | None = None) -> dict[str, float]:
    """`--check`'s verdict (common.reference.LockstepReference): each step the reference starts
    from the parameters the strategy started from, so one step's rounding is not compounded by
    AdamW's chaos into the next (in bf16 a 4e-3 gradient difference at step 1 became 7e-2 at step
    2 on a dim-8 model, whatever the strategy). fp16: and from its loss scale; a step whose scale
    or skip differs from the reference's makes "loss_scale" infinite."""
    reference = reference or lockstep_reference(spec)
    data, states = spec.data(), record.scaler_states or [None] * (spec.steps + 1)
    for step in range(spec.steps):
        reference.step(data.global_batch(step, spec.global_batch), record.grads[step],
                       record.step_params[step], states[step])
    verdict = reference.finish(record.losses, record.params, states[-1])
    scaled = ({"loss_scale": float("inf") if verdict["loss_scale_mismatches"] else 0.0}
              if "loss_scale_mismatches" in verdict else {})
    return {"loss": verdict["max_loss_diff"], "grad": verdict["max_grad_diff"],
            "param": verdict["max_param_diff"], **scaled}


def compare(record: RunRecord, spec: TrainSpec) -> dict[str, float]:
    """float64: free-running against the reference (1-3 steps stay within 1e-10); reduced
    precision: teacher-forced, like `--check`."""
    if record.step_params:
        return teacher_forced_differences(record, spec)
    return differences(record, reference_record(spec), spec.precision)


def assert_matches_reference(record: RunRecord, spec: TrainSpec, tolerance: float | None = None) -> None:
    tolerance = TOLERANCE[spec.precision] if tolerance is None else tolerance
    diffs = compare(record, spec)
    assert max(diffs.values()) <= tolerance, f"differs from single-device training: {diffs} > {tolerance}"


# --- strategies through the shared interface (common.training.Strategy) -----------------------

StrategyFactory = Callable[..., Strategy]  # factory(spec, *args) -> Strategy, called on every rank


def train_strategy(spec: TrainSpec, factory: StrategyFactory, *args) -> RunRecord:
    """Runs on every rank: the shared loop's steps (forward_backward, full gradients, step,
    zero_grad) for `spec.steps` steps. Every rank returns its own losses (None where it computes
    none); rank 0's record also carries the gathered gradients and final parameters."""
    strategy = factory(spec, *args)
    device = next(strategy.model.parameters()).device
    data, losses, grads, step_params, states = spec.data(), [], [], [], []
    teacher_forced = spec.precision != torch.float64
    cpu = lambda tensors: {n: t.detach().cpu().clone() for n, t in tensors.items()}  # noqa: E731
    for step in range(spec.steps):
        micro = rank_micro_batches(strategy, data.global_batch(step, spec.global_batch),
                                   spec.micro_batch, device)
        losses.append(loss_value(strategy.forward_backward(micro)))
        full = strategy.full_gradients()
        start = strategy.full_parameters() if teacher_forced else None
        if dist.get_rank() == 0:
            grads.append(cpu(full))
            if teacher_forced:
                step_params.append(cpu(start))
        if strategy.scaler is not None:
            states.append(strategy.scaler.state_dict())
        strategy.step()
        strategy.zero_grad()
    params = strategy.full_parameters()
    if strategy.scaler is not None:
        states.append(strategy.scaler.state_dict())
    if dist.get_rank() != 0:
        return RunRecord(losses, [], {})
    return RunRecord(losses, grads, cpu(params), step_params, states)


def run_strategy(pools, spec: TrainSpec, factory: StrategyFactory, *args) -> RunRecord:
    """All ranks' records → one: the step loss is the mean over the ranks that report one (the
    shared loop's rule); gradients and parameters are rank 0's gathered ones."""
    records = pools.run(spec.world_size, train_strategy, spec, factory, *args)
    losses = []
    for step in range(spec.steps):
        values = [r.losses[step] for r in records if r.losses[step] is not None]
        assert values, f"no rank reported a loss at step {step}"
        losses.append(sum(values) / len(values))
    return RunRecord(losses, records[0].grads, records[0].params, records[0].step_params,
                     records[0].scaler_states)


def check_strategy(pools, spec: TrainSpec, factory: StrategyFactory, *args) -> dict[str, float]:
    """The equivalence property of every chapter: the strategy built by `factory` on each rank
    trains the same losses, per-step gradients and final parameters as the single-device
    reference, within TOLERANCE[spec.precision]. Returns the differences."""
    tolerance = TOLERANCE[spec.precision]
    diffs = compare(run_strategy(pools, spec, factory, *args), spec)
    assert max(diffs.values()) <= tolerance, f"differs from single-device training: {diffs} > {tolerance}"
    return diffs


def check_strategy_rejected(pools, spec: TrainSpec, factory: StrategyFactory, *args,
                            margin: float = 10.0) -> dict[str, float]:
    """The negative control: a deliberately broken strategy must miss the reference by more than
    `margin` × the tolerance that `check_strategy` applies (so the check can fail, and not by
    luck). Returns the differences."""
    tolerance = TOLERANCE[spec.precision]
    diffs = compare(run_strategy(pools, spec, factory, *args), spec)
    assert max(diffs.values()) > margin * tolerance, (
        f"a broken strategy passed: {diffs} within {margin} × {tolerance}")
    return diffs


def with_spec(spec: TrainSpec, **changes) -> TrainSpec:
    return replace(spec, **changes)


def spec_args(spec: TrainSpec, **chapter_flags) -> argparse.Namespace:
    """The namespace a chapter's `train.py` would parse for this spec (shared flags + the
    chapter's own), so a test builds the strategy exactly as the demo does."""
    return argparse.Namespace(
        cfg=spec.cfg, model=None, seed=spec.seed, dtype=spec.dtype, optimizer=spec.optimizer,
        lr=spec.lr, clip_grad=spec.clip_grad, mixed_precision=spec.mixed_precision,
        global_batch=spec.global_batch, micro_batch=spec.micro_batch, grad_accum=spec.grad_accum,
        seq_len=spec.seq_len, steps=spec.steps, data="synthetic", check=False, report=None,
        log_every=0, measure_activations=None, profile=None, observed_comm=False,
        loss_scaling=spec.loss_scaling, **chapter_flags)


def spec_run(spec: TrainSpec, validate: Callable[[argparse.Namespace, int], Run], **chapter_flags) -> Run:
    """The run a chapter's `validate` resolves from this spec's namespace (`spec_args`): what its
    strategy is built from, as in the demo."""
    return validate(spec_args(spec, **chapter_flags), spec.world_size)
