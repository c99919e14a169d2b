"""Chapter 01's training step run in the rank pool, and its broken variants: shared by the tests of
chapters 01 (naive DP, DDP) and 02 (DDP over the ring all-reduce)."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from common.data import local_micro_batches, split_inputs_targets
from common.kernel.model import build_model, loss_fn
from common.reference import make_optimizer
from data_parallel import DistributedDataParallel, NaiveDataParallel
from tests.equivalence import RunRecord, TrainSpec


# Deliberately broken variants: the negative controls that prove the checks can fail.
class SumNotAverageDDP(DistributedDataParallel):
    def __init__(self, module, bucket_cap_mb, all_reduce=None):
        super().__init__(module, bucket_cap_mb=bucket_cap_mb, all_reduce=all_reduce)
        self.world_size = 1  # sums the gradients, never divides by n


class SkipFirstBucketDDP(DistributedDataParallel):
    def _launch_ready_buckets(self) -> None:
        if self._next_bucket == 0 and len(self.buckets[0].ready) == len(self.buckets[0].params):
            self._next_bucket = 1  # bucket 0 keeps its local gradient
        super()._launch_ready_buckets()


def wrap(model: nn.Module, strategy: str, bucket_cap_mb: float, all_reduce=None) -> nn.Module:
    if strategy == "naive":
        return NaiveDataParallel(model)
    cls = {"ddp": DistributedDataParallel, "sum-not-average": SumNotAverageDDP,
           "skip-first-bucket": SkipFirstBucketDDP}[strategy]
    return cls(model, bucket_cap_mb=bucket_cap_mb, all_reduce=all_reduce)


def train_data_parallel(spec: TrainSpec, strategy: str, bucket_cap_mb: float = 25.0,
                        all_reduce=None) -> RunRecord:
    """Runs on every rank: the chapter's training step, recording full gradients each step.
    `all_reduce` replaces DDP's `dist.all_reduce` (chapter 02's ring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(spec.cfg, spec.seed, spec.torch_dtype)
    dp = wrap(model, strategy, bucket_cap_mb, all_reduce)
    optimizer = make_optimizer(model.parameters(), spec.optimizer, spec.lr)
    data, losses, grads, step_params = spec.data(), [], [], []
    teacher_forced = spec.precision != torch.float64  # as tests.equivalence.train_strategy
    for step in range(spec.steps):
        micro = local_micro_batches(data.global_batch(step, spec.global_batch), rank, world,
                                    spec.micro_batch)
        loss_sum = 0.0
        for i, tokens in enumerate(micro):
            inputs, targets = split_inputs_targets(tokens)
            with nullcontext() if i == len(micro) - 1 else dp.no_sync():
                loss = loss_fn(dp(inputs), targets) / len(micro)
                loss.backward()
            loss_sum += loss.item()
        dp.finish()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if teacher_forced:
            step_params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        losses.append(loss_sum)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return RunRecord(losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, step_params)


def run_data_parallel(pools, spec: TrainSpec, strategy: str, bucket_cap_mb: float = 25.0,
                      replicas_must_agree: bool = True, all_reduce=None) -> RunRecord:
    """All ranks' records → one: replicas must agree exactly; the step loss is the ranks' mean."""
    records = pools.run(spec.world_size, train_data_parallel, spec, strategy, bucket_cap_mb, all_reduce)
    for rank, record in enumerate(records[1:] if replicas_must_agree else [], start=1):
        for name, p in record.params.items():
            assert torch.equal(p, records[0].params[name]), f"rank {rank} drifted from rank 0 in {name}"
    losses = [sum(r.losses[s] for r in records) / len(records) for s in range(spec.steps)]
    return RunRecord(losses, records[0].grads, records[0].params, records[0].step_params)
