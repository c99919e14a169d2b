"""Chapter 03's ZeroOptimizer dropped into a user's own training loop: a plain torch.nn model, param
groups (no weight decay on norms and biases), an LR scheduler, clipping, a state_dict round trip
into a fresh optimizer; equal to single-device torch training in float64. Whole-parameter
ownership makes a shape-dependent optimizer (Adafactor) exact; slice ownership refuses it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR

from tests.harness import RankError
from zero import ZeroOptimizer

HAS_ADAFACTOR = hasattr(torch.optim, "Adafactor")  # torch >= 2.5
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}),
              "adafactor": (getattr(torch.optim, "Adafactor", None), {"lr": 1e-2, "weight_decay": 0.1})}
SCHEDULERS = {"lambda": lambda opt: LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3)),
              "cosine": lambda opt: CosineAnnealingLR(opt, T_max=6, eta_min=1e-3)}
BATCH, CLIP = 12, 0.5  # 12 rows split evenly over 1-4 ranks; CLIP below the first steps' norms


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 3)).double()


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on the matrices only (not on the norm's weight and the biases)."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 3, generator=g, dtype=torch.float64))


def build(model: nn.Module, zero: dict | None, optimizer: str, scheduler: str):
    """The optimizer (ZeroOptimizer when `zero` is given, else torch's own) and its scheduler,
    the no-decay group added afterwards with add_param_group."""
    cls, defaults = OPTIMIZERS[optimizer]
    decay, no_decay = param_groups(model)
    first = decay["params"]
    opt = ZeroOptimizer(first, cls, **zero, **defaults) if zero else cls(first, **defaults)
    opt.add_param_group(no_decay)
    return opt, SCHEDULERS[scheduler](opt)


def train_steps(model, opt, sched, steps, rank: int, world: int) -> None:
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for step in steps:
        x, y = batch(step)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        if isinstance(opt, ZeroOptimizer):
            opt.clip_grad_norm_(CLIP)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()


def max_relative_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)).item() for k in b)


def user_loop(stage: int, ownership: str, optimizer: str, scheduler: str) -> dict:
    """3 steps, a consolidated state_dict into a fresh model + optimizer + scheduler, 3 more;
    single-device torch alongside (every rank runs it on the whole batch)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(0)
    reference = copy.deepcopy(model)
    zero = {"stage": stage, "ownership": ownership}
    opt, sched = build(model, zero, optimizer, scheduler)
    ref_opt, ref_sched = build(reference, None, optimizer, scheduler)
    train_steps(model, opt, sched, range(3), rank, world)
    train_steps(reference, ref_opt, ref_sched, range(3), 0, 1)

    saved, ref_saved = opt.state_dict(), ref_opt.state_dict()
    assert saved["param_groups"] == ref_saved["param_groups"]  # settings, lr, initial_lr: torch's
    state_diff = max(max_relative_diff(saved["state"][i], ref_saved["state"][i]) for i in ref_saved["state"])

    resumed = make_model(1)  # other values: everything must come from the checkpoints
    resumed.load_state_dict(model.state_dict())
    opt, sched2 = build(resumed, zero, optimizer, scheduler)
    opt.load_state_dict(saved)
    sched2.load_state_dict(sched.state_dict())
    train_steps(resumed, opt, sched2, range(3, 6), rank, world)
    train_steps(reference, ref_opt, ref_sched, range(3, 6), 0, 1)
    return {"state": state_diff, "lr": [g["lr"] for g in opt.param_groups],
            "ref_lr": [g["lr"] for g in ref_opt.param_groups],
            "params": max_relative_diff(dict(resumed.named_parameters()), dict(reference.named_parameters()))}


@pytest.mark.parametrize("world, stage, ownership, optimizer, scheduler", [
    (2, 1, "slice", "adamw", "lambda"),
    (3, 2, "slice", "adamw", "cosine"),
    pytest.param(3, 2, "parameter", "adafactor", "cosine",
                 marks=pytest.mark.skipif(not HAS_ADAFACTOR, reason="torch.optim.Adafactor: torch >= 2.5")),
    pytest.param(2, 1, "parameter", "adafactor", "lambda",
                 marks=pytest.mark.skipif(not HAS_ADAFACTOR, reason="torch.optim.Adafactor: torch >= 2.5")),
])
def test_zero_optimizer_in_a_users_loop_equals_single_device(pools, world, stage, ownership, optimizer,
                                                             scheduler):
    for result in pools.run(world, user_loop, stage, ownership, optimizer, scheduler):
        assert result["state"] <= 1e-10 and result["params"] <= 1e-10, result
        assert result["lr"] == result["ref_lr"], result


def slice_adafactor() -> None:
    ZeroOptimizer(make_model(0).parameters(), torch.optim.Adafactor, stage=2, lr=1e-2)


@pytest.mark.skipif(not HAS_ADAFACTOR, reason="torch.optim.Adafactor: torch >= 2.5")
def test_slice_ownership_refuses_a_shape_dependent_optimizer(pools):
    with pytest.raises(RankError, match=r"Adafactor is not element-wise.*ownership='parameter'") as info:
        pools.run(2, slice_adafactor)
    assert sorted(info.value.errors) == [0, 1]
