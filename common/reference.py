"""The single-device trainer: ground truth for every equivalence check in the course.

Same init (seeded, identical on every rank before any sharding), the same global batch for each
step, the same optimizer. A strategy is exact when, step by step, its loss, its gradients (gathered
to full shape, after backward and before the optimizer) and, at the end, its parameters match this
trainer's within the dtype's tolerance. Gradients are compared because AdamW hides scale bugs: its
update m/sqrt(v) is nearly unchanged when every gradient is multiplied by the same constant.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from common.data import split_inputs_targets
from common.model import LlamaConfig, build_model, loss_fn

# How far a strategy may be from the reference, per dtype: TOLERANCE[dtype] in METRIC[dtype].
# "max":    max over tensors of max |a - b| / max |b|   (float64: only the summation order differs)
# "global": ||a - b|| / ||b|| over all tensors as one vector (float32, bfloat16)
# Losses are always compared as |a - b| / |b|. Reduced precision needs the global norm because
# (1) AdamW's update lr·m/(sqrt(v)+eps) has slope up to lr/eps in g, so an element whose gradient
# is within rounding of zero moves by up to 2·lr whatever the strategy does, and (2) tensors whose
# gradients are tiny at init (wq, wk: near-uniform attention) are all rounding noise in bfloat16.
# In float64 rounding (~1e-17) is far below eps = 1e-8 and every tensor is checked element-wise.
# A strategy bug (a missing 1/n, a skipped bucket, a wrong shard) moves whole tensors by O(1).
TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
}
METRIC: dict[torch.dtype, str] = {torch.float64: "max", torch.float32: "global", torch.bfloat16: "global"}


def make_optimizer(params: Iterable[nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """AdamW(foreach=False, weight_decay=0.1) or plain SGD: the two optimizers of the suite."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False)
    raise ValueError(f"unknown optimizer {name!r}: use 'adamw' or 'sgd'")


def relative_diff(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                  metric: str = "max") -> float:
    """The distance of `tensors` from `reference` in METRIC's sense ("max" or "global"),
    computed in float64 (the scale guard keeps an all-zero reference finite)."""
    if tensors.keys() != reference.keys():
        raise ValueError(f"names differ from the reference's: {sorted(tensors.keys() ^ reference.keys())}")
    worst, diff_sq, ref_sq = 0.0, 0.0, 0.0
    for name, b in reference.items():
        a, b = tensors[name].detach().double().cpu(), b.detach().double().cpu()
        if a.shape != b.shape:
            raise ValueError(f"{name}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}")
        if not b.numel():
            continue
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
        diff_sq += (a - b).pow(2).sum().item()
        ref_sq += b.pow(2).sum().item()
    return worst if metric == "max" else (diff_sq / max(ref_sq, 1e-60)) ** 0.5


class ReferenceTrainer:
    """Plain training on one device: the whole global batch in one forward and backward."""

    def __init__(self, cfg: LlamaConfig, seed: int, dtype: torch.dtype, optimizer: str = "adamw",
                 lr: float = 1e-3, device: torch.device | str = "cpu"):
        self.model = build_model(cfg, seed, dtype, device)
        self.optimizer = make_optimizer(self.model.parameters(), optimizer, lr)
        self.device = torch.device(device)

    def step(self, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        """One optimizer step on the global batch; returns (loss, the gradients it applied)."""
        inputs, targets = split_inputs_targets(tokens.to(self.device))
        loss = loss_fn(self.model(inputs), targets)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), grads

    def parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}


@dataclass
class EquivalenceCheck:
    """Running maxima of the relative differences between a strategy and the reference."""

    dtype: torch.dtype
    reference_losses: list[float] = field(default_factory=list)
    max_loss_diff: float = 0.0
    max_grad_diff: float = 0.0
    max_param_diff: float = 0.0

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]

    def compare_grads(self, grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor]) -> None:
        self.max_grad_diff = max(self.max_grad_diff, relative_diff(grads, ref_grads, METRIC[self.dtype]))

    def compare_losses(self, losses: list[float]) -> None:
        for loss, ref in zip(losses, self.reference_losses, strict=True):
            self.max_loss_diff = max(self.max_loss_diff, abs(loss - ref) / max(abs(ref), 1e-30))

    def compare_parameters(self, params: dict[str, torch.Tensor],
                           ref_params: dict[str, torch.Tensor]) -> None:
        self.max_param_diff = max(self.max_param_diff,
                                  relative_diff(params, ref_params, METRIC[self.dtype]))

    @property
    def passed(self) -> bool:
        return max(self.max_loss_diff, self.max_grad_diff, self.max_param_diff) <= self.tolerance

    def summary(self) -> dict:
        return {
            "reference_losses": self.reference_losses,
            "max_loss_diff": self.max_loss_diff,
            "max_grad_diff": self.max_grad_diff,
            "max_param_diff": self.max_param_diff,
            "tolerance": self.tolerance,
            "check_passed": self.passed,
        }


class LockstepReference:
    """`--check` on rank 0: after each distributed step, train the reference on the same global
    batch and compare the (gathered) gradients; at the end compare losses and parameters.

    In float64 the reference runs free for the whole run. In float32 and bfloat16 it is first set
    to the strategy's parameters at every step (teacher forcing): training a small LM with AdamW
    is chaotic, and a 1e-7 rounding difference grows to O(1e-1) within ten steps whatever the
    strategy does, so each step is checked from the same starting point instead."""

    def __init__(self, cfg: LlamaConfig, seed: int, dtype: torch.dtype, optimizer: str, lr: float,
                 device: torch.device | str = "cpu"):
        self.trainer = ReferenceTrainer(cfg, seed, dtype, optimizer, lr, device)
        self.check = EquivalenceCheck(dtype)
        self.teacher_forced = dtype != torch.float64

    def step(self, tokens: torch.Tensor, grads: dict[str, torch.Tensor],
             params: dict[str, torch.Tensor]) -> None:
        """`grads` and `params` (before the optimizer step) gathered to full shape."""
        if self.teacher_forced:
            with torch.no_grad():
                for name, p in self.trainer.model.named_parameters():
                    p.copy_(params[name])
        ref_loss, ref_grads = self.trainer.step(tokens)
        self.check.reference_losses.append(ref_loss)
        self.check.compare_grads(grads, ref_grads)

    def finish(self, losses: list[float], params: dict[str, torch.Tensor]) -> dict:
        self.check.compare_losses(losses)
        self.check.compare_parameters(params, self.trainer.parameters())
        return self.check.summary() | {"teacher_forced": self.teacher_forced}
