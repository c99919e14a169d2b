"""The shared loop and property helper (common.training, tests.equivalence): a strategy written
only against the interface is checked in a few lines, and a broken one is caught."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from common.dist import init_distributed
from common.model import get_config
from data_parallel.train import STRATEGIES, DataParallelStrategy
from tests.equivalence import (
    TrainSpec,
    check_strategy,
    check_strategy_rejected,
    data_parallel_specs,
    spec_args,
    with_spec,
)


def data_parallel_strategy(spec: TrainSpec, strategy: str = "ddp", bucket_mb: float = 25.0):
    args = spec_args(spec, strategy=strategy, bucket_mb=bucket_mb)
    return DataParallelStrategy(args, init_distributed(), STRATEGIES[strategy])


class PartialNormClipping(DataParallelStrategy):
    """Toy broken strategy: clips each rank by a norm of only half of its gradients."""

    def step(self) -> None:
        half = self.master[: len(self.master) // 2]
        torch.nn.utils.clip_grad_norm_(half, self.clip_grad, foreach=False)
        self.optimizer.step()


def broken_clipping_strategy(spec: TrainSpec):
    args = spec_args(spec, strategy="ddp", bucket_mb=25.0)
    return PartialNormClipping(args, init_distributed(), STRATEGIES["ddp"])


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
