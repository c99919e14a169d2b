"""Shared pieces of the equivalence properties: a drawn training spec, the reference run in the
test process, and the comparison of a strategy's per-step gradients, losses and final parameters
against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from common.cli import DTYPES
from common.data import SyntheticTokens
from common.model import LlamaConfig
from common.reference import METRIC, TOLERANCE, ReferenceTrainer, relative_diff


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

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.world_size * self.micro_batch)

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
    and the parameters at the end, all as full (gathered) tensors on CPU."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    params: dict[str, torch.Tensor]


def reference_record(spec: TrainSpec) -> RunRecord:
    trainer = ReferenceTrainer(spec.cfg, spec.seed, spec.torch_dtype, spec.optimizer, spec.lr)
    data, losses, grads = spec.data(), [], []
    for step in range(spec.steps):
        loss, g = trainer.step(data.global_batch(step, spec.global_batch))
        losses.append(loss)
        grads.append(g)
    return RunRecord(losses, grads, {k: v.clone() for k, v in trainer.parameters().items()})


def differences(record: RunRecord, reference: RunRecord,
                dtype: torch.dtype = torch.float64) -> dict[str, float]:
    """Max relative differences of a run from the reference, measured as common.reference's
    TOLERANCE comment says (in METRIC[dtype])."""
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(record.losses, reference.losses, strict=True)),
        "grad": max(relative_diff(g, r, METRIC[dtype])
                    for g, r in zip(record.grads, reference.grads, strict=True)),
        "param": relative_diff(record.params, reference.params, METRIC[dtype]),
    }


def assert_matches_reference(record: RunRecord, spec: TrainSpec, tolerance: float | None = None) -> None:
    tolerance = TOLERANCE[spec.torch_dtype] if tolerance is None else tolerance
    diffs = differences(record, reference_record(spec), spec.torch_dtype)
    assert max(diffs.values()) <= tolerance, f"differs from single-device training: {diffs} > {tolerance}"
