"""Chapter 01's DDP behaves as torch's does, and the suite's own thresholds are the stated ones.

* The source article's loop, `loss.backward(); optimizer.step(); optimizer.zero_grad()`, works
  unchanged: DDP finishes at the end of backward by itself (an autograd-engine callback), an
  explicit `finish()` is harmless, `no_sync()` accumulates without communicating, and a gradient
  marked ready twice before its bucket was reduced is an error.
* With bf16 parameters and `reduce_dtype=torch.float32`, the buckets are fp32 `main_grad`s:
  bit-exactly the fp32 sum of the bf16 micro-batch gradients, and training follows the
  mixed-precision reference.
* Gradients are views of the buckets: the ledger's "grads" is one copy, the real one.
* `broadcast_module` really broadcasts: rank-dependent init and a registered buffer.
* Small bugs fail at the stated tolerance (one gradient × (1 + 1e-6); a float64 DDP whose
  all-reduce goes through float32), and the threshold the property helper applies is exactly
  TOLERANCE: a run that misses by 0.9 × TOLERANCE passes, one that misses by 1.1 × fails.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import LambdaLR

from common.comm import CommMeter
from common.data import local_micro_batches, split_inputs_targets
from common.dist import init_distributed
from common.kernel.model import build_model, get_config, loss_fn
from common.memory import storage_bytes
from common.reference import TOLERANCE, make_optimizer
from data_parallel import DistributedDataParallel, NaiveDataParallel, broadcast_module
from data_parallel.train import STRATEGIES, DataParallelStrategy
from data_parallel.train import validate as dp_validate
from ring_allreduce.agreement import CompletedWork
from tests.equivalence import (
    RunRecord,
    TrainSpec,
    assert_matches_reference,
    check_strategy,
    check_strategy_rejected,
    data_parallel_specs,
    differences,
    reference_record,
    run_strategy,
    spec_run,
    with_spec,
)
from tests.harness import RankError, examples

TINY = get_config("tiny", n_layers=1)


# ---------------------------------------------------------------- the article's loop, unchanged

def article_loop(spec: TrainSpec, bucket_cap_mb: float, zero_grad: str, explicit_finish: bool) -> RunRecord:
    """Runs on every rank: the plain loop of the source article on our DDP, one micro-batch per
    rank and step, no finish() (unless asked), and one of three ways to zero the gradients."""
    model = build_model(spec.cfg, spec.seed, spec.torch_dtype)
    dp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = make_optimizer(model.parameters(), spec.optimizer, spec.lr)
    data, losses, grads = spec.data(), [], []
    for step in range(spec.steps):
        (tokens,) = local_micro_batches(data.global_batch(step, spec.global_batch), dist.get_rank(),
                                        dist.get_world_size(), spec.global_batch // spec.world_size)
        inputs, targets = split_inputs_targets(tokens)
        loss = loss_fn(dp(inputs), targets)
        loss.backward()
        if explicit_finish:
            before = {n: p.grad.clone() for n, p in model.named_parameters()}
            dp.finish()
            dp.finish()
            assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters()), \
                "an explicit finish() after backward changed the gradients"
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        losses.append(loss.item())
        optimizer.step()
        {"set_to_none": lambda: optimizer.zero_grad(),  # torch's default: set_to_none=True
         "in_place": lambda: optimizer.zero_grad(set_to_none=False), "ddp": dp.zero_grad}[zero_grad]()
    return RunRecord(losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()})


def run_on_ranks(pools, spec: TrainSpec, fn, *args) -> RunRecord:
    """All ranks' records → one; the replicas must agree bit for bit."""
    records = pools.run(spec.world_size, fn, spec, *args)
    for rank, record in enumerate(records[1:], start=1):
        for name, p in record.params.items():
            assert torch.equal(p, records[0].params[name]), f"rank {rank} drifted from rank 0 in {name}"
    losses = [sum(r.losses[s] for r in records) / len(records) for s in range(spec.steps)]
    return RunRecord(losses, records[0].grads, records[0].params)


one_micro_batch_specs = data_parallel_specs(world_sizes=(2, 3)).map(
    lambda s: with_spec(s, micro_batch=s.global_batch // s.world_size))


@given(spec=one_micro_batch_specs, zero_grad=st.sampled_from(["set_to_none", "in_place", "ddp"]),
       bucket_cap_mb=st.sampled_from([1e-6, 0.004, 25.0]))
@settings(max_examples=examples(4))
def test_the_article_loop_works_unchanged_and_equals_single_device(pools, spec, zero_grad, bucket_cap_mb):
    """`loss.backward(); optimizer.step(); optimizer.zero_grad()` with no finish(): the average
    is complete when backward returns, whichever way the gradients are zeroed."""
    assert_matches_reference(run_on_ranks(pools, spec, article_loop, bucket_cap_mb, zero_grad, False), spec)


def test_an_explicit_finish_is_harmless(pools):
    spec = TrainSpec(cfg=TINY, world_size=2, global_batch=4, micro_batch=2, seq_len=6, steps=2)
    assert_matches_reference(run_on_ranks(pools, spec, article_loop, 0.004, "set_to_none", True), spec)


def accumulate(spec: TrainSpec, bucket_cap_mb: float) -> tuple[RunRecord, list[int]]:
    """The article's loop with gradient accumulation: every micro-batch but the last of a step
    under no_sync(). Returns the record and the all-reduce calls of each micro-batch."""
    model = build_model(spec.cfg, spec.seed, spec.torch_dtype)
    dp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = make_optimizer(model.parameters(), spec.optimizer, spec.lr)
    data, losses, grads, calls = spec.data(), [], [], []
    for step in range(spec.steps):
        micro = local_micro_batches(data.global_batch(step, spec.global_batch), dist.get_rank(),
                                    dist.get_world_size(), spec.micro_batch)
        total = 0.0
        for i, tokens in enumerate(micro):
            inputs, targets = split_inputs_targets(tokens)
            with CommMeter() as meter, nullcontext() if i == len(micro) - 1 else dp.no_sync():
                loss = loss_fn(dp(inputs), targets) / len(micro)
                loss.backward()
            calls.append(meter.calls("all_reduce"))
            total += loss.item()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        losses.append(total)
        optimizer.step()
        optimizer.zero_grad()
    return RunRecord(losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}), calls


def test_no_sync_accumulates_locally_and_the_last_micro_batch_reduces(pools):
    spec = TrainSpec(cfg=TINY, world_size=2, global_batch=12, micro_batch=2, seq_len=6, steps=2)
    results = pools.run(2, accumulate, spec, 0.004)
    buckets = len(pools.run(2, bucket_count, TINY, 0.004)[0])
    for _, calls in results:  # 3 micro-batches a step: silent, silent, one call per bucket
        assert calls == [0, 0, buckets] * spec.steps, calls
    record = RunRecord([sum(r.losses[s] for r, _ in results) / 2 for s in range(spec.steps)],
                       results[0][0].grads, results[0][0].params)
    assert_matches_reference(record, spec)


def bucket_count(cfg, bucket_cap_mb: float) -> list[int]:
    dp = DistributedDataParallel(build_model(cfg), bucket_cap_mb=bucket_cap_mb)
    return [b.buffer.numel() for b in dp.buckets]


def ready_twice() -> None:
    """A gradient's hook fires a second time before its bucket was reduced (as a hand-made
    double backward within one reduction would): DDP must refuse, not reduce a wrong sum."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    dp = DistributedDataParallel(model, bucket_cap_mb=25.0)
    first = model[0].weight
    first.register_post_accumulate_grad_hook(dp._on_grad_ready)  # fires after DDP's own hook
    dp(torch.randn(3, 4)).sum().backward()


def test_a_gradient_ready_twice_before_its_reduction_is_an_error_on_every_rank(pools):
    with pytest.raises(RankError, match=r"gradient of '0.weight' became ready twice") as info:
        pools.run(2, ready_twice)
    assert sorted(info.value.errors) == [0, 1]
    pools.run(2, dist.barrier)  # nobody was left inside a collective


# ---------------------------------------------------------------- torch's knobs: bucket cap, unused params

def test_bucket_cap_inf_is_one_bucket_and_zero_a_bucket_per_parameter(pools):
    """(Training on any layout is the property above: buckets only change when the sum runs.)"""
    numels = [p.numel() for p in build_model(TINY).parameters()]
    assert pools.run(1, bucket_count, TINY, math.inf)[0] == [sum(numels)]
    assert pools.run(1, bucket_count, TINY, 0)[0] == numels[::-1]


def bucket_mib(bucket_cap_mb: float | None) -> list[float]:
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # 4 MiB + 4 KiB per layer
    dp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    return [b.buffer.numel() * b.buffer.element_size() / 2**20 for b in dp.buckets]


def test_bucket_cap_none_is_torchs_default_25_mib_with_a_1_mib_first_bucket(pools):
    """torch reads None as 25 MiB and caps the first bucket (the last layers' gradients, ready
    first) at 1 MiB; an explicit 25 does not. 32 MiB of gradients: the 25 MiB cap shows."""
    default, explicit = pools.run(1, bucket_mib, None)[0], pools.run(1, bucket_mib, 25.0)[0]
    assert len(default) == 3 and default[0] <= 1 < default[1] and max(default) <= 25, default
    assert len(explicit) == 2 and explicit[0] > 1 and max(explicit) <= 25, explicit


class Branchy(nn.Module):
    """`branch` runs only when asked (a branch not taken on some ranks, or on all); `never` never."""

    def __init__(self):
        super().__init__()
        self.trunk, self.branch, self.never = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, take_branch: bool):
        h = self.trunk(x).tanh()
        return self.branch(h) if take_branch else h


# (step, rank, micro-batch) that take the branch: step 0 on rank 0's first micro-batch (under
# no_sync: its gradient must survive the last one), step 1 on rank 1's last (rank 0's slot still
# holds step 0's gradient, which the optimizer set to None), step 2 nowhere (no rank uses it).
BRANCH_TAKEN = {(0, 0, 0), (1, 1, 1)}
UNUSED_SPEC = (2, 3, 2)  # world, steps, micro-batches


def branchy_batches(step: int, rank: int) -> list[tuple[torch.Tensor, bool]]:
    _, _, micro = UNUSED_SPEC
    g = torch.Generator().manual_seed(100 * step + 10 * rank)
    return [(torch.randn(3, 4, generator=g, dtype=torch.float64), (step, rank, m) in BRANCH_TAKEN)
            for m in range(micro)]


def branchy_run(distributed: bool, set_to_none: bool) -> dict:
    """Three AdamW steps of Branchy: on every rank through DDP(find_unused_parameters=True), or on
    one device over every rank's micro-batches (the reference). Gradients as applied (None kept),
    zeroed by `optimizer.zero_grad(set_to_none)`."""
    world, steps, micro = UNUSED_SPEC
    torch.manual_seed(0)
    model = Branchy().double()
    net = (DistributedDataParallel(model, bucket_cap_mb=None, find_unused_parameters=True)
           if distributed else model)
    optimizer = make_optimizer(model.parameters(), "adamw", 1e-2)
    grads = []
    for step in range(steps):
        ranks = [dist.get_rank()] if distributed else range(world)
        for rank in ranks:
            for m, (x, take) in enumerate(branchy_batches(step, rank)):
                last = m == micro - 1
                with nullcontext() if last or not distributed else net.no_sync():
                    loss = net(x, take).pow(2).mean() / micro / (1 if distributed else world)
                    loss.backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_find_unused_parameters_trains_as_one_device_does(pools, set_to_none):
    """A parameter used on some ranks only gets the average with zeros from the others (a stale
    slot is zeroed, an accumulated no_sync gradient kept); one that no rank used keeps its .grad
    as it was, as torch's DDP does: None (AdamW skips it: no weight decay, no momentum) or, after
    zero_grad(set_to_none=False), zeros (AdamW decays it), exactly as on one device."""
    world, steps, _ = UNUSED_SPEC
    expected = branchy_run(False, set_to_none)
    for ranked in pools.run(world, branchy_run, True, set_to_none):
        for step in range(steps):
            for name, want in expected["grads"][step].items():
                got = ranked["grads"][step][name]
                assert (got is None) == (want is None), (step, name, got, want)
                if want is not None:
                    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, msg=f"{step} {name}")
        for name, want in expected["params"].items():
            torch.testing.assert_close(ranked["params"][name], want, rtol=1e-12, atol=1e-15, msg=name)
    assert (expected["grads"][2]["branch.weight"] is None) == set_to_none, expected["grads"][2]
    assert expected["grads"][1]["branch.weight"] is not None and expected["grads"][2]["never.weight"] is None


# ---------------------------------------------------------------- fp32 main_grad for bf16 parameters

def main_grads(spec: TrainSpec, reduce_dtype: torch.dtype | None) -> dict:
    """One step of bf16 DDP with accumulation, and, on a plain bf16 copy, this rank's own
    micro-batch gradients summed in fp32 (what main_grad accumulates before the all-reduce)."""
    model = build_model(spec.cfg, spec.seed, torch.bfloat16)
    plain = build_model(spec.cfg, spec.seed, torch.bfloat16)
    dp = DistributedDataParallel(model, bucket_cap_mb=0.004, reduce_dtype=reduce_dtype)
    micro = local_micro_batches(spec.data().global_batch(0, spec.global_batch), dist.get_rank(),
                                dist.get_world_size(), spec.micro_batch)
    local = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in plain.named_parameters()}
    for i, tokens in enumerate(micro):
        inputs, targets = split_inputs_targets(tokens)
        (loss_fn(plain(inputs), targets) / len(micro)).backward()
        for n, p in plain.named_parameters():
            local[n] += p.grad.float()
            p.grad = None
        with nullcontext() if i == len(micro) - 1 else dp.no_sync():
            (loss_fn(dp(inputs), targets) / len(micro)).backward()
    named = list(model.named_parameters())
    return {"local": local, "bucket_dtypes": {b.buffer.dtype for b in dp.buckets},
            "reduced": {n: (p.main_grad if reduce_dtype else p.grad).float() for n, p in named},
            "grad_is_none": all(p.grad is None for _, p in named) if reduce_dtype else None}


MIXED = TrainSpec(cfg=TINY, world_size=2, global_batch=8, micro_batch=2, seq_len=6, steps=2,
                  dtype="float32", mixed_precision="bf16", clip_grad=1.0)


def test_main_grad_is_the_fp32_sum_of_the_bf16_micro_batch_gradients(pools):
    """n = 2, so the fp32 all-reduce is exact up to its one rounding, in either order: main_grad
    must equal (local₀ + local₁) / 2 bit for bit, with local_r the fp32 sum of rank r's bf16
    micro-batch gradients. bf16 buckets (no reduce_dtype) are measurably not that."""
    fp32 = pools.run(2, main_grads, MIXED, torch.float32)
    expected = {n: (fp32[0]["local"][n] + fp32[1]["local"][n]) / 2 for n in fp32[0]["local"]}
    for r in fp32:
        assert r["bucket_dtypes"] == {torch.float32} and r["grad_is_none"]
        for n, g in r["reduced"].items():
            assert torch.equal(g, expected[n]), n
    bf16 = pools.run(2, main_grads, MIXED, None)[0]
    assert bf16["bucket_dtypes"] == {torch.bfloat16}
    worst = max(((bf16["reduced"][n] - e).abs().max() / e.abs().max()).item() for n, e in expected.items())
    assert worst > 1e-4, f"bf16 buckets matched the fp32 sum ({worst:.1e}): the check cannot tell them apart"


def mixed_precision_loop(spec: TrainSpec) -> RunRecord:
    """The mixed-precision recipe by hand on our DDP: bf16 model, fp32 main_grad buckets, an fp32
    master copy that clipping and AdamW update, copied back into the bf16 weights."""
    model = build_model(spec.cfg, spec.seed, torch.bfloat16)
    dp = DistributedDataParallel(model, bucket_cap_mb=0.004, reduce_dtype=torch.float32)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    optimizer = make_optimizer(master, spec.optimizer, spec.lr)
    names, data, losses, grads = [n for n, _ in model.named_parameters()], spec.data(), [], []
    for step in range(spec.steps):
        micro = local_micro_batches(data.global_batch(step, spec.global_batch), dist.get_rank(),
                                    dist.get_world_size(), spec.micro_batch)
        total = 0.0
        for i, tokens in enumerate(micro):
            inputs, targets = split_inputs_targets(tokens)
            with nullcontext() if i == len(micro) - 1 else dp.no_sync():
                loss = loss_fn(dp(inputs), targets) / len(micro)
                loss.backward()
            total += loss.item()
        for m, p in zip(master, model.parameters(), strict=True):
            m.grad = p.main_grad
        grads.append({n: m.grad.clone() for n, m in zip(names, master, strict=True)})
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(master, spec.clip_grad, foreach=False)
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters(), strict=True):
                p.copy_(m)
        dp.zero_grad()
    return RunRecord(losses, grads, {n: m.detach().clone() for n, m in zip(names, master, strict=True)})


def test_bf16_ddp_with_fp32_main_grad_follows_the_mixed_precision_reference(pools):
    diffs = differences(run_on_ranks(pools, MIXED, mixed_precision_loop), reference_record(MIXED),
                        MIXED.precision)
    assert max(diffs.values()) <= TOLERANCE["bf16-mixed"], diffs


# ---------------------------------------------------------------- the memory ledger: one copy

def gradient_storage(zero_grad: str) -> dict:
    """Three steps; after each backward and each zero_grad, where the gradients live."""
    model = build_model(TINY, 0, torch.float64)
    dp = DistributedDataParallel(model, bucket_cap_mb=0.004)
    optimizer = make_optimizer(model.parameters(), "adamw", 1e-3)
    buckets = [b.buffer for b in dp.buckets]
    same_place, one_copy, slots = [], [], {}
    for step in range(3):
        tokens = torch.randint(0, TINY.vocab_size, (2, 7), generator=torch.Generator().manual_seed(step))
        loss_fn(dp(tokens[:, :-1]), tokens[:, 1:]).backward()
        slots = slots or {n: p.grad.data_ptr() for n, p in model.named_parameters()}  # the first backward's
        grads = [p.grad for p in model.parameters()]
        same_place.append(all(p.grad.data_ptr() == slots[n] for n, p in model.named_parameters()))
        one_copy.append(storage_bytes([*grads, *buckets]) == storage_bytes(buckets))
        optimizer.step()
        {"set_to_none": optimizer.zero_grad, "ddp": dp.zero_grad}[zero_grad]()
        zeroed = [p.grad for p in model.parameters() if p.grad is not None]  # none, or the views
        one_copy.append(storage_bytes([*zeroed, *buckets]) == storage_bytes(buckets))
        same_place.append(all(p.grad is None or p.grad.data_ptr() == slots[n]
                              for n, p in model.named_parameters()))
    return {"same_place": same_place, "one_copy": one_copy, "bucket_bytes": storage_bytes(buckets),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


@pytest.mark.parametrize("zero_grad", ["set_to_none", "ddp"])
def test_gradients_are_views_of_the_buckets_so_the_ledger_counts_one_copy(pools, zero_grad):
    """After every backward and every zero_grad each param.grad is its bucket slot (or None):
    gradient_as_bucket_view, so the memory ledger's grads = the buckets = P·b is the real figure,
    and no second copy is allocated between steps."""
    for r in pools.run(2, gradient_storage, zero_grad):
        assert r["same_place"] == [True] * 6 and r["one_copy"] == [True] * 6, r
        assert r["bucket_bytes"] == r["param_bytes"]


# ---------------------------------------------------------------- broadcast_module broadcasts

class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("running", torch.zeros(4))

    def forward(self, x):
        return self.linear(x)


def broadcast_rank_dependent(members: list[int] | None, wrapper: str) -> tuple[dict, dict]:
    """Rank-dependent parameters and buffer, then broadcast_module (directly or by a wrapper's
    constructor) on the world or on the group of `members` (every rank creates the group)."""
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)
    module = WithBuffer()
    module.running.fill_(rank + 1.0)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    group = dist.new_group(members) if members else None
    if members is None or rank in members:
        {"broadcast_module": lambda: broadcast_module(module, group),
         "naive": lambda: NaiveDataParallel(module, group),
         "ddp": lambda: DistributedDataParallel(module, process_group=group)}[wrapper]()
    return before, module.state_dict()


@pytest.mark.parametrize("members, wrapper", [(None, "broadcast_module"), (None, "ddp"), (None, "naive"),
                                              ([1, 2], "broadcast_module")])
def test_broadcast_module_copies_parameters_and_buffers_from_the_first_rank(pools, members, wrapper):
    per_rank = pools.run(3, broadcast_rank_dependent, members, wrapper)
    source = per_rank[members[0] if members else 0][0]
    assert not torch.equal(per_rank[1][0]["linear.weight"], per_rank[2][0]["linear.weight"])
    for rank, (before, after) in enumerate(per_rank):
        expected = source if members is None or rank in members else before
        for key in ("linear.weight", "linear.bias", "running"):
            assert torch.equal(after[key], expected[key]), (rank, key)


# ---------------------------------------------------------------- small bugs fail at the stated tolerance

class ScaledGradient(DataParallelStrategy):
    """Toy broken strategy: the output head's averaged gradient is multiplied by `factor`."""

    def __init__(self, run, ctx, wrap, factor: float):
        super().__init__(run, ctx, wrap)
        self.factor = factor

    def forward_backward(self, micro_batches):
        loss = super().forward_backward(micro_batches)
        with torch.no_grad():
            self.weights.master[-1].grad.mul_(self.factor)
        return loss


def scaled_gradient_strategy(spec: TrainSpec, factor: float):
    return ScaledGradient(spec_run(spec, dp_validate, strategy="ddp", bucket_mb=25.0), init_distributed(),
                          STRATEGIES["ddp"], factor)


def all_reduce_through_float32(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """A float64 all-reduce that rounds through float32 on the way (the bug of a half-width wire)."""
    low = tensor.float()
    dist.all_reduce(low, op=op, group=group)
    tensor.copy_(low)
    return CompletedWork()


def float32_wire_strategy(spec: TrainSpec):
    run = spec_run(spec, dp_validate, strategy="ddp", bucket_mb=0.004)
    return DataParallelStrategy(run, init_distributed(), lambda model, r: DistributedDataParallel(
                                    model, bucket_cap_mb=r.options.bucket_mb,
                                    all_reduce=all_reduce_through_float32))


SMALL = TrainSpec(cfg=TINY, world_size=2, global_batch=4, micro_batch=1, seq_len=6, steps=2, optimizer="sgd")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_gradient_off_by_one_part_in_a_million_is_rejected(pools, optimizer):
    diffs = check_strategy_rejected(pools, with_spec(SMALL, optimizer=optimizer),
                                    scaled_gradient_strategy, 1 + 1e-6)
    assert diffs["grad"] == pytest.approx(1e-6, rel=1e-3)


def test_a_float64_ddp_whose_all_reduce_rounds_through_float32_is_rejected(pools):
    diffs = check_strategy_rejected(pools, SMALL, float32_wire_strategy)
    assert 1e-9 < diffs["grad"] < 1e-6, diffs  # float32's 2^-24 relative rounding, seen in float64


def test_the_helpers_apply_exactly_the_stated_tolerance(pools):
    """A bug of 0.9 × TOLERANCE passes check_strategy and 1.1 × fails it; the negative control's
    margin is exactly 10 × TOLERANCE the same way. A floored or loosened threshold cannot hide."""
    tol = TOLERANCE[SMALL.precision]
    check_strategy(pools, SMALL, scaled_gradient_strategy, 1 + 0.9 * tol)
    with pytest.raises(AssertionError, match="differs from single-device training"):
        check_strategy(pools, SMALL, scaled_gradient_strategy, 1 + 1.1 * tol)
    record = run_strategy(pools, SMALL, scaled_gradient_strategy, 1 + 1.1 * tol)
    with pytest.raises(AssertionError, match="differs from single-device training"):
        assert_matches_reference(record, SMALL)
    check_strategy_rejected(pools, SMALL, scaled_gradient_strategy, 1 + 11 * tol)
    with pytest.raises(AssertionError, match="a broken strategy passed"):
        check_strategy_rejected(pools, SMALL, scaled_gradient_strategy, 1 + 9 * tol)


# ---------------------------------------------------------------- a user's plain torch loop (nanoGPT's)

PLAIN_ROWS, PLAIN_CLIP = 12, 1.0  # 12 rows split evenly over 2 or 3 ranks; nanoGPT's clip


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def plain_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + micro)
    return (torch.randn(PLAIN_ROWS, 6, generator=g, dtype=torch.float64),
            3 * torch.randn(PLAIN_ROWS, 3, generator=g, dtype=torch.float64))  # norms above the clip


def max_relative_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)).item() for k in b)


def ddp_plain_loop(zero_grad: str, accumulate: str) -> dict:
    """Three steps of nanoGPT's loop on our DDP with torch's defaults: 2 backward passes per step
    (the first under no_sync(), or nanoGPT's `model.require_backward_grad_sync = last` toggle),
    torch's clip_grad_norm_(model.parameters(), 1.0), AdamW + LambdaLR, zero_grad by the model
    or the optimizer. A single-process replica trains on the whole batch alongside."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = plain_model()
    replica = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
            for m in (ddp, replica)]
    scheds = [LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3)) for opt in opts]
    rows = slice(rank * PLAIN_ROWS // world, (rank + 1) * PLAIN_ROWS // world)
    grads, norms, calls = [], [], []
    for step in range(3):
        for micro in range(2):
            x, y = plain_batch(step, micro)
            last = micro == 1
            if accumulate == "toggle":
                ddp.require_backward_grad_sync = last
            with CommMeter() as meter, nullcontext() if last or accumulate == "toggle" else ddp.no_sync():
                (F.mse_loss(ddp(x[rows]), y[rows]) / 2).backward()
            calls.append(meter.calls("all_reduce"))
            (F.mse_loss(replica(x), y) / 2).backward()
        grads.append(max_relative_diff({n: p.grad for n, p in model.named_parameters()},
                                       {n: p.grad for n, p in replica.named_parameters()}))
        norms.append([torch.nn.utils.clip_grad_norm_(m.parameters(), PLAIN_CLIP).item()
                      for m in (ddp, replica)])
        for opt, sched in zip(opts, scheds, strict=True):
            opt.step()
            sched.step()
        {"model": lambda: ddp.zero_grad(set_to_none=True),
         "model-in-place": lambda: ddp.zero_grad(set_to_none=False),
         "optimizer": lambda: opts[0].zero_grad(set_to_none=True)}[zero_grad]()
        opts[1].zero_grad(set_to_none=True)
    return {"grads": max(grads), "norms": norms, "keys": list(ddp.state_dict()), "calls": calls,
            "buckets": len(ddp.buckets),
            "module_keys": list(model.state_dict()),
            "params": max_relative_diff(dict(model.named_parameters()), dict(replica.named_parameters()))}


@pytest.mark.parametrize("world, zero_grad, accumulate", [(2, "model", "no_sync"), (3, "model", "toggle"),
                                                          (2, "model-in-place", "toggle"),
                                                          (3, "optimizer", "no_sync")])
def test_ddp_in_a_plain_torch_loop_equals_a_single_process_replica(pools, world, zero_grad, accumulate):
    """torch's contract, name by name: model.zero_grad(set_to_none=...), no_sync() and the
    require_backward_grad_sync toggle (the first micro-batch of a step communicates nothing),
    clip_grad_norm_ on model.parameters() (which really clips: every norm is above 1), an LR
    scheduler, and state_dict keys prefixed "module."."""
    for r in pools.run(world, ddp_plain_loop, zero_grad, accumulate):
        assert r["grads"] <= 1e-10 and r["params"] <= 1e-10, r
        assert r["calls"] == [0, r["buckets"]] * 3, r
        assert all(ref > PLAIN_CLIP and ours == pytest.approx(ref, rel=1e-10) for ours, ref in r["norms"]), r
        assert r["keys"] == ["module." + k for k in r["module_keys"]]


def buffers_against_torch_ddp() -> dict:
    """Three SGD steps of a model with BatchNorm (running statistics updated in forward, from each
    rank's own rows) through our DDP and through torch's, both with torch's defaults."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)).double()
    nets = [DistributedDataParallel(copy.deepcopy(model)),
            torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))]
    for net in nets:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()),
                            dtype=torch.float64) * (1 + dist.get_rank())
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    ours, theirs = (net.state_dict() for net in nets)
    del nets  # torch's DDP holds the process group: gone before the pool's next call
    return {k: (ours[k] - theirs[k]).abs().max().item() for k in theirs}


def test_broadcast_buffers_follows_torchs_ddp(pools):
    """torch's default broadcast_buffers=True: every forward starts from rank 0's buffers."""
    for diffs in pools.run(2, buffers_against_torch_ddp):
        assert max(diffs.values()) <= 1e-12 and "module.1.running_mean" in diffs, diffs


def refused(kind: str) -> None:
    model = nn.Linear(2, 2)
    {"device_ids": lambda: DistributedDataParallel(model, device_ids=[0]),
     "static_graph": lambda: DistributedDataParallel(model, static_graph=True)}[kind]()


@pytest.mark.parametrize("kind, message", [
    ("device_ids", r"device_ids=\[0\] but the module's parameters are on \['cpu'\]: move the module"),
    ("static_graph", r"does not implement static_graph: buckets are fixed at construction anyway: drop it")])
def test_torch_arguments_it_cannot_honour_fail_loudly(pools, kind, message):
    with pytest.raises(RankError, match=message):
        pools.run(1, refused, kind)
