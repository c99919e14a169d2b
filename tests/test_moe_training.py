"""MoE training under data parallelism (DDP, FSDP) and a pipeline equals one device (float64,
1e-10): each micro-batch's aux-loss gradient is divided like its loss (1/k in the shared loop, 1/m
in the pipeline executor), and the per-sequence aux loss and capacity drops are exact under
sharding. The single-process properties of common/kernel/moe.py are in tests/test_moe.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.cli import ConfigError
from common.dist import init_distributed
from common.kernel.model import build_model, get_config
from common.kernel.moe import set_aux_loss_scale
from data_parallel import train as dp_train
from data_parallel.train import STRATEGIES, DataParallelStrategy
from fsdp import train as fsdp_train
from fsdp.train import FSDPStrategy
from pipeline import train as pp_train
from pipeline.train import PipelineStrategy
from tensor_parallel.parallelize import parallelize_llama
from tensor_parallel.train import parse_args, validate
from tests.equivalence import TrainSpec, check_strategy, check_strategy_rejected, spec_run


def ddp(spec: TrainSpec):
    run = spec_run(spec, dp_train.validate, strategy="ddp", bucket_mb=0.004)
    return DataParallelStrategy(run, init_distributed(), STRATEGIES["ddp"])


def fsdp(spec: TrainSpec):
    return FSDPStrategy(spec_run(spec, fsdp_train.validate, sharding_strategy="FULL_SHARD", no_sync=False,
                                 no_prefetch=False, impl="ours", nodes=None), init_distributed())


def pipeline(spec: TrainSpec):
    run = spec_run(spec, pp_train.validate, schedule="1f1b", microbatches=spec.grad_accum, virtual_stages=1,
                   partition=None, timeline_png=None)
    return PipelineStrategy(run, init_distributed())


class AuxNotDivided(DataParallelStrategy):
    """Broken: the loss is divided by k, the aux losses are not."""

    def micro_batch_loss(self, tokens):
        set_aux_loss_scale(self.model, 1.0)
        return super().micro_batch_loss(tokens)


def aux_not_divided(spec: TrainSpec):
    run = spec_run(spec, dp_train.validate, strategy="ddp", bucket_mb=25.0)
    return AuxNotDivided(run, init_distributed(), STRATEGIES["ddp"])


MOE_SPEC = TrainSpec(cfg=get_config("tiny-moe", n_layers=2, first_dense_layers=0, aux_loss_coef=0.1),
                     world_size=2, global_batch=8, micro_batch=2, seq_len=8, steps=2)


@pytest.mark.parametrize("factory, changes", [
    (ddp, {}), (ddp, {"capacity_factor": 1.0, "gate": "sigmoid", "top_k": 1}),
    (fsdp, {"capacity_factor": 1.25}), (pipeline, {}),
])
def test_moe_training_equals_single_device(pools, factory, changes):
    """2 ranks, 2 micro-batches each (the pipeline: p 2, m 4): the aux gradient of each micro-batch
    scaled by 1/k (1/m) like its loss, per-sequence aux and capacity exact under sharding."""
    spec = replace(MOE_SPEC, cfg=replace(MOE_SPEC.cfg, **changes),
                   dp=1 if factory is pipeline else None, micro_batch=2)
    check_strategy(pools, spec, factory)


def test_aux_loss_not_divided_like_the_loss_is_rejected(pools):
    check_strategy_rejected(pools, MOE_SPEC, aux_not_divided)


def test_context_parallelism_and_the_dense_plan_refuse_a_moe_model():
    """05's TP/CP demo refuses MoE loudly rather than shard the router's per-sequence sums (in
    validate, before any collective), naming the experts' own demo (train_expert.py, no CP), and
    the dense TP plan refuses it rather than skip the experts, naming the MoE plan
    (moe_tensor_parallel.parallelize_moe_llama) for a caller that skips validate."""
    with pytest.raises(ConfigError, match=r"--model tiny-moe is a mixture-of-experts model: train it with "
                                          r"expert parallelism, make run-5-ep \(05_tensor_parallel/"):
        validate(parse_args(["--model", "tiny-moe", "--cp", "2"]), 2)
    with pytest.raises(ValueError, match=r"mixture-of-experts.*parallelize_moe_llama"):
        parallelize_llama(build_model(get_config("tiny-moe"), device="meta"), tp_group=None)
