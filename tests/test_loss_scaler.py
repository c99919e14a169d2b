"""common/loss_scaler.py against torch.amp.GradScaler on the same gradients, and what it is for:
fp16 gradients that underflow without a scale come back with one."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from common.data import SyntheticTokens, split_inputs_targets
from common.kernel.model import build_model, get_config, loss_fn
from common.loss_scaler import DynamicLossScaler, LossScaling


def gradient_sequence(seed: int, steps: int, overflow: list[bool]) -> list[list[torch.Tensor]]:
    """`steps` fp32 gradients of two tensors; where `overflow[i]`, one element is inf, -inf or nan
    (cycled), as an fp16 backward's overflow leaves it after the cast to the masters."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        grads = [torch.randn(5, 3, generator=gen) * 1e3, torch.randn(7, generator=gen)]
        if overflow[i]:
            grads[i % 2].view(-1)[i % 5] = (math.inf, -math.inf, math.nan)[i % 3]
        out.append(grads)
    return out


def torch_run(settings_: LossScaling, seq: list[list[torch.Tensor]]) -> list[tuple]:
    """torch's GradScaler on `seq`: unscale_, step (SGD, lr 1), update; per step the scale used,
    whether the step ran, and the unscaled gradients."""
    params = [torch.zeros_like(g, requires_grad=True) for g in seq[0]]
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = torch.amp.GradScaler("cpu", settings_.init_scale, settings_.growth_factor,
                                  settings_.backoff_factor, settings_.growth_interval)
    scaler.scale(torch.ones(()))  # torch's scale and tracker are made by the first scale()
    ran, out = [], []
    opt.step = (lambda step: lambda *a, **k: (ran.append(True), step(*a, **k))[1])(opt.step)
    for grads in seq:
        scale, before = scaler.get_scale(), len(ran)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        scaler.unscale_(opt)
        unscaled = [p.grad.clone() for p in params]
        scaler.step(opt)
        scaler.update()
        out.append((scale, len(ran) > before, unscaled))
    return out


def our_run(settings_: LossScaling, seq: list[list[torch.Tensor]]) -> list[tuple]:
    scaler, out = DynamicLossScaler(settings_), []
    for grads in seq:
        scale, grads = scaler.get_scale(), [g.clone() for g in grads]
        scaler.unscale_(grads)
        scaler.agree_(None)
        skipped = scaler.should_skip()
        scaler.update()
        out.append((scale, not skipped, grads))
    return out


def same_runs(a: list[tuple], b: list[tuple]) -> bool:
    return all(sa == sb and ra == rb and all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in
                                              zip(ga, gb, strict=True))
               for (sa, ra, ga), (sb, rb, gb) in zip(a, b, strict=True))


@settings(max_examples=12, deadline=None)
@example(seed=0, overflow=[False] * 12, init=3.0e38, interval=1, growth=2.0, backoff=0.5)
@example(seed=1, overflow=[True, False] * 6, init=1000.0, interval=1, growth=1.5, backoff=0.3)
@given(seed=st.integers(0, 2**16), overflow=st.lists(st.booleans(), min_size=12, max_size=12),
       init=st.sampled_from([2.0**16, 2.0**-3, 3.0e38, 1000.0]), interval=st.integers(1, 4),
       growth=st.sampled_from([2.0, 3.0, 1.5]), backoff=st.sampled_from([0.5, 0.25, 0.3]))
def test_scales_and_skipped_steps_equal_torch_grad_scaler(seed, overflow, init, interval, growth, backoff):
    """The same gradient sequence (infs and nans included) through both scalers: the same scale at
    every step (bit for bit), the same steps skipped, the same unscaled gradients. 3e38 · growth
    overflows fp32: torch keeps the scale, resets the tracker, and so must we."""
    settings_ = LossScaling(init, growth, backoff, interval)
    seq = gradient_sequence(seed, len(overflow), overflow)
    assert same_runs(our_run(settings_, seq), torch_run(settings_, seq))


@pytest.mark.parametrize("broken", ["never_backs_off", "grows_one_step_late", "unscale_after_check_only"])
def test_scaler_comparison_rejects_a_broken_scaler(broken, monkeypatch):
    """Negative control: a scaler that keeps its scale after an overflow, grows one good step late,
    or forgets to unscale differs from torch's on the same sequence."""
    if broken == "never_backs_off":
        settings_ = LossScaling(2.0**16, 2.0, 0.999999, 2)
        reference = LossScaling(2.0**16, 2.0, 0.5, 2)
    elif broken == "grows_one_step_late":
        settings_, reference = LossScaling(2.0**16, 2.0, 0.5, 3), LossScaling(2.0**16, 2.0, 0.5, 2)
    else:
        settings_ = reference = LossScaling(2.0**16, 2.0, 0.5, 2)
        monkeypatch.setattr(torch.Tensor, "mul_", lambda self, other: self)
    seq = gradient_sequence(0, 8, [False, True, False, False, False, True, False, False])
    ours = our_run(settings_, seq)
    monkeypatch.undo()
    assert not same_runs(ours, torch_run(reference, seq))


def tiny_fp16_gradients(scale: float, loss_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat gradient of `tiny` (fp16 compute) of loss_factor · loss, backward from scale ·
    that, divided by scale in fp32; and the float64 model's exact gradient of the same."""
    cfg = get_config("tiny")
    tokens = SyntheticTokens(cfg.vocab_size, 16, seed=0).global_batch(0, 4)
    inputs, targets = split_inputs_targets(tokens)
    flat = {}
    for dtype in (torch.float16, torch.float64):
        model = build_model(cfg, seed=0, dtype=dtype)
        loss = loss_fn(model(inputs), targets) * loss_factor
        (loss * (scale if dtype == torch.float16 else 1.0)).backward()
        flat[dtype] = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    return flat[torch.float16] / scale, flat[torch.float64]


def test_underflowing_fp16_gradients_recovered_by_loss_scaling():
    """`tiny` in fp16 with its loss / 256 (what a 256× larger batch's mean does to each
    sequence's share): unscaled, 12% of the gradient elements flush to zero in fp16 and the
    gradient is 4.7% off the float64 one in norm; backward from s = 2¹⁶ · loss, then ÷ s in fp32,
    none is lost and the error is fp16's rounding, 1e-3 (measured 2026: 4.7e-2 and 9.5e-4)."""
    plain, exact = tiny_fp16_gradients(1.0, 1 / 256)
    scaled, _ = tiny_fp16_gradients(2.0**16, 1 / 256)
    err = lambda g: ((g - exact).norm() / exact.norm()).item()  # noqa: E731
    lost = lambda g: ((g == 0) & (exact != 0)).double().mean().item()  # noqa: E731
    assert torch.isfinite(scaled).all()
    assert lost(plain) > 0.1 and err(plain) > 3e-2, (lost(plain), err(plain))
    assert lost(scaled) < 1e-4 and err(scaled) < 2e-3, (lost(scaled), err(scaled))
