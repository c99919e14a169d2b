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

# max |a - b| / max |b| per tensor. float64: only summation order differs, so differences are
# ~1e-14; float32 and bfloat16 differ by rounding that AdamW's 1/sqrt(v) can amplify for small
# gradients over a few steps.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
}


def make_optimizer(params: Iterable[nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """AdamW(foreach=False, weight_decay=0.1) or plain SGD: the two optimizers of the suite."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False)
    raise ValueError(f"unknown optimizer {name!r}: use 'adamw' or 'sgd'")


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, computed in float64 (the scale guard keeps all-zero b finite)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs reference {tuple(b.shape)}")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


def max_relative_diff(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    if tensors.keys() != reference.keys():
        raise ValueError(f"names differ from the reference's: {sorted(tensors.keys() ^ reference.keys())}")
    return max((relative_diff(tensors[k], reference[k]) for k in reference), default=0.0)


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
        self.max_grad_diff = max(self.max_grad_diff, max_relative_diff(grads, ref_grads))

    def compare_losses(self, losses: list[float]) -> None:
        for loss, ref in zip(losses, self.reference_losses, strict=True):
            self.max_loss_diff = max(self.max_loss_diff, abs(loss - ref) / max(abs(ref), 1e-30))

    def compare_parameters(self, params: dict[str, torch.Tensor],
                           ref_params: dict[str, torch.Tensor]) -> None:
        self.max_param_diff = max(self.max_param_diff, max_relative_diff(params, ref_params))

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
    batch and compare the (gathered) gradients; at the end compare losses and parameters."""

    def __init__(self, cfg: LlamaConfig, seed: int, dtype: torch.dtype, optimizer: str, lr: float,
                 device: torch.device | str = "cpu"):
        self.trainer = ReferenceTrainer(cfg, seed, dtype, optimizer, lr, device)
        self.check = EquivalenceCheck(dtype)

    def step(self, tokens: torch.Tensor, grads: dict[str, torch.Tensor]) -> None:
        ref_loss, ref_grads = self.trainer.step(tokens)
        self.check.reference_losses.append(ref_loss)
        self.check.compare_grads(grads, ref_grads)

    def finish(self, losses: list[float], params: dict[str, torch.Tensor]) -> dict:
        self.check.compare_losses(losses)
        self.check.compare_parameters(params, self.trainer.parameters())
        return self.check.summary()
