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
from common.kernel.model import LlamaConfig, build_model, loss_fn
from common.loss_scaler import DynamicLossScaler, LossScaling

# How far a strategy may be from the reference, per dtype: TOLERANCE[dtype] in METRIC[dtype].
# "max":    max over tensors of max |a - b| / max |b|   (float64: only the summation order differs)
# "global": ||a - b|| / ||b|| over all tensors as one vector (float32, bfloat16)
# Losses are always compared as |a - b| / |b|. Reduced precision needs the global norm because
# (1) AdamW's update lr·m/(sqrt(v)+eps) has slope up to lr/eps in g, so an element whose gradient
# is within rounding of zero moves by up to 2·lr whatever the strategy does, and (2) tensors whose
# gradients are tiny at init (wq, wk: near-uniform attention) are all rounding noise in bfloat16.
# In float64 rounding (~1e-17) is far below eps = 1e-8 and every tensor is checked element-wise.
# A strategy bug (a missing 1/n, a skipped bucket, a wrong shard) moves whole tensors by O(1).
TOLERANCE: dict[torch.dtype | str, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
    # bf16 compute, fp32 master weights, fp32 gradient reduction, fp32 optimizer state: against
    # MixedPrecisionReferenceTrainer (same casts), teacher-forced. Each micro-batch's bf16 matmuls
    # round differently from the reference's whole batch, and the fp32 sum of the micro-batches'
    # bf16 gradients is not the bf16 gradient of their sum: measured ~1e-2 in the global norm.
    "bf16-mixed": 5e-2,
    # the same recipe in fp16 with dynamic loss scaling (MixedPrecisionReferenceTrainer with the
    # same scaler, its state teacher-forced): 3 more mantissa bits than bf16
    "fp16-mixed": 1e-2,
}
METRIC: dict[torch.dtype | str, str] = {torch.float64: "max", torch.float32: "global",
                                        torch.bfloat16: "global", "bf16-mixed": "global",
                                        "fp16-mixed": "global"}


def precision_key(dtype: torch.dtype, mixed_precision: str = "none") -> torch.dtype | str:
    """The row of TOLERANCE/METRIC: the dtype, or "bf16-mixed" / "fp16-mixed" for --mixed-precision."""
    return f"{mixed_precision}-mixed" if mixed_precision in ("bf16", "fp16") else dtype


def make_optimizer(params: Iterable[nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """AdamW(foreach=False, weight_decay=0.1) or plain SGD: the two optimizers of the suite."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False)
    raise ValueError(f"unknown optimizer {name!r}: use 'adamw' or 'sgd'")


# "max" floors each tensor's denominator at SCALE_FLOOR × the largest |b| of any tensor: a tensor
# whose exact values are zero (wq/wk gradients when every sequence has one position, so softmax is
# constant) holds only rounding noise in both runs, and noise / noise is no verdict. Any real
# discrepancy of a tensor is still measured against at least 1e-4 of the model's scale.
SCALE_FLOOR = 1e-4


def relative_diff(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                  metric: str = "max") -> float:
    """The distance of `tensors` from `reference` in METRIC's sense, computed in float64:
    "max":    max over tensors t of max|a_t - b_t| / max(max|b_t|, SCALE_FLOOR · max_u max|b_u|)
    "global": ||a - b|| / ||b|| over all tensors as one vector."""
    if tensors.keys() != reference.keys():
        raise ValueError(f"names differ from the reference's: {sorted(tensors.keys() ^ reference.keys())}")
    pairs = []
    for name, b in reference.items():
        a, b = tensors[name].detach().double().cpu(), b.detach().double().cpu()
        if a.shape != b.shape:
            raise ValueError(f"{name}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}")
        if b.numel():
            pairs.append((a, b))
    if not pairs:
        return 0.0
    scales = [b.abs().max().item() for _, b in pairs]
    floor = max(SCALE_FLOOR * max(scales), 1e-30)  # 1e-30: an all-zero reference stays finite
    worst = max((a - b).abs().max().item() / max(scale, floor)
                for (a, b), scale in zip(pairs, scales, strict=True))
    if metric == "max":
        return worst
    diff_sq = sum((a - b).pow(2).sum().item() for a, b in pairs)
    ref_sq = sum(b.pow(2).sum().item() for _, b in pairs)
    return (diff_sq / max(ref_sq, 1e-60)) ** 0.5


class ReferenceTrainer:
    """Plain training on one device: the whole global batch in one forward and backward, then
    (optionally) `torch.nn.utils.clip_grad_norm_`, then the optimizer."""

    def __init__(self, cfg: LlamaConfig, seed: int, dtype: torch.dtype, optimizer: str = "adamw",
                 lr: float = 1e-3, device: torch.device | str = "cpu", clip_grad: float | None = None):
        self.model = build_model(cfg, seed, dtype, device)
        self.optimizer = make_optimizer(self.model.parameters(), optimizer, lr)
        self.device = torch.device(device)
        self.clip_grad = clip_grad

    def step(self, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        """One optimizer step on the global batch; returns (loss, the gradients before clipping)."""
        inputs, targets = split_inputs_targets(tokens.to(self.device))
        loss = loss_fn(self.model(inputs), targets)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self._apply()
        return loss.item(), grads

    def _apply(self) -> None:
        if self.clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad, foreach=False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def load_parameters(self, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])


class MixedPrecisionReferenceTrainer(ReferenceTrainer):
    """The mixed-precision recipe on one device: fp32 master weights (what the optimizer updates
    and `parameters()` returns), cast to a bf16 (or fp16) copy for forward and backward; the
    gradients are cast to fp32 before clipping and the fp32 AdamW step. Every chapter's
    `--mixed-precision` follows exactly these casts, so the two differ only by where bf16 rounds.
    fp16 adds `scaler` (`loss_scaling`): backward from s·loss, unscale the fp32 gradients, skip
    the step on an inf or nan, update s (common/loss_scaler.py)."""

    def __init__(self, cfg: LlamaConfig, seed: int, dtype: torch.dtype = torch.float32,
                 optimizer: str = "adamw", lr: float = 1e-3, device: torch.device | str = "cpu",
                 clip_grad: float | None = None, compute_dtype: torch.dtype = torch.bfloat16,
                 loss_scaling: LossScaling | None = None):
        super().__init__(cfg, seed, torch.float32, optimizer, lr, device, clip_grad)
        self.compute = build_model(cfg, seed, compute_dtype, device)
        self.scaler = (DynamicLossScaler(loss_scaling or LossScaling(), device)
                       if compute_dtype == torch.float16 else None)

    def step(self, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        inputs, targets = split_inputs_targets(tokens.to(self.device))
        with torch.no_grad():
            for c, m in zip(self.compute.parameters(), self.model.parameters(), strict=True):
                c.copy_(m)
        loss = loss_fn(self.compute(inputs), targets)
        (loss if self.scaler is None else self.scaler.scale_loss(loss)).backward()
        for c, m in zip(self.compute.parameters(), self.model.parameters(), strict=True):
            m.grad, c.grad = c.grad.float(), None
        if self.scaler is not None:
            self.scaler.unscale_([m.grad for m in self.model.parameters()])
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self._apply()
        return loss.item(), grads

    def _apply(self) -> None:
        if self.scaler is not None and self.scaler.should_skip():
            self.optimizer.zero_grad(set_to_none=True)
        else:
            super()._apply()
        if self.scaler is not None:
            self.scaler.update()


def make_reference(cfg: LlamaConfig, seed: int, dtype: torch.dtype, optimizer: str = "adamw",
                   lr: float = 1e-3, device: torch.device | str = "cpu", clip_grad: float | None = None,
                   mixed_precision: str = "none",
                   loss_scaling: LossScaling | None = None) -> ReferenceTrainer:
    if mixed_precision in ("bf16", "fp16"):
        compute = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
        return MixedPrecisionReferenceTrainer(cfg, seed, dtype, optimizer, lr, device, clip_grad, compute,
                                              loss_scaling)
    return ReferenceTrainer(cfg, seed, dtype, optimizer, lr, device, clip_grad)


@dataclass
class EquivalenceCheck:
    """Running maxima of the relative differences between a strategy and the reference."""

    dtype: torch.dtype | str  # a row of TOLERANCE (precision_key)
    reference_losses: list[float] = field(default_factory=list)
    max_loss_diff: float = 0.0
    max_grad_diff: float = 0.0
    max_param_diff: float = 0.0
    # fp16: steps whose loss-scaler state or skip decision differed from the reference's (exact)
    loss_scale_mismatches: list[int] = field(default_factory=list)

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

    def compare_loss_scale(self, state: dict | None, reference: DynamicLossScaler | None) -> None:
        """fp16: the strategy's scaler state (scale, good steps) must be the reference's, exactly."""
        if reference is not None and state != reference.state_dict():
            self.loss_scale_mismatches.append(len(self.reference_losses) - 1)  # the step that led here

    @property
    def passed(self) -> bool:
        return (max(self.max_loss_diff, self.max_grad_diff, self.max_param_diff) <= self.tolerance
                and not self.loss_scale_mismatches)

    def summary(self) -> dict:
        scaled = {"loss_scale_mismatches": self.loss_scale_mismatches} if self.dtype == "fp16-mixed" else {}
        return {
            "reference_losses": self.reference_losses,
            "max_loss_diff": self.max_loss_diff,
            "max_grad_diff": self.max_grad_diff,
            "max_param_diff": self.max_param_diff,
            "tolerance": self.tolerance,
            "check_passed": self.passed,
            **scaled,
        }


class LockstepReference:
    """`--check` on rank 0: after each distributed step, train the reference on the same global
    batch and compare the (gathered) gradients; at the end compare losses and parameters.

    The verdict comes from a reference that is set to the strategy's parameters before every step
    (teacher forcing), so each step is checked from the same starting point: training a small LM
    with AdamW is chaotic, and a 1e-7 float32 rounding difference grows to O(1e-1) within ten
    steps whatever the strategy does. In float64 a second reference also runs free for the whole
    run; its figures are reported as `free_running` (they grow slowly with the number of steps,
    as a different summation order compounds through AdamW: CONTRIBUTING.md, "the same numbers")."""

    def __init__(self, cfg: LlamaConfig, seed: int, dtype: torch.dtype, optimizer: str, lr: float,
                 device: torch.device | str = "cpu", clip_grad: float | None = None,
                 mixed_precision: str = "none", loss_scaling: LossScaling | None = None):
        make = lambda: make_reference(cfg, seed, dtype, optimizer, lr, device, clip_grad,  # noqa: E731
                                      mixed_precision, loss_scaling)
        self.trainer = make()
        self.free = make() if dtype == torch.float64 and mixed_precision == "none" else None
        key = precision_key(dtype, mixed_precision)
        self.check, self.free_check = EquivalenceCheck(key), EquivalenceCheck(key)

    def step(self, tokens: torch.Tensor, grads: dict[str, torch.Tensor],
             params: dict[str, torch.Tensor], scaler_state: dict | None = None) -> None:
        """`grads` and `params` (before the optimizer step) gathered to full shape. `params` are
        also compared with where the reference's previous step (from the strategy's previous
        parameters) went, so every step's update is checked, not only the last one. fp16: the
        strategy's loss-scaler state is compared and forced the same way (a step skipped on one
        side only shows there: backed off against grown), and a skipped step's gradients are not."""
        scaler = getattr(self.trainer, "scaler", None)
        if self.check.reference_losses:
            self.check.compare_parameters(params, self.trainer.parameters())
            self.check.compare_loss_scale(scaler_state, scaler)
        self.trainer.load_parameters(params)
        if scaler is not None and scaler_state is not None:
            scaler.load_state_dict(scaler_state)
        ref_loss, ref_grads = self.trainer.step(tokens)
        self.check.reference_losses.append(ref_loss)
        if scaler is None or not scaler.found_inf.item():  # a skipped step's gradients are never applied
            self.check.compare_grads(grads, ref_grads)
        if self.free is not None:
            ref_loss, ref_grads = self.free.step(tokens)
            self.free_check.reference_losses.append(ref_loss)
            self.free_check.compare_grads(grads, ref_grads)

    def finish(self, losses: list[float], params: dict[str, torch.Tensor],
               scaler_state: dict | None = None) -> dict:
        self.check.compare_losses(losses)
        self.check.compare_parameters(params, self.trainer.parameters())
        self.check.compare_loss_scale(scaler_state, getattr(self.trainer, "scaler", None))
        report = self.check.summary() | {"teacher_forced": True}
        if self.free is not None:
            self.free_check.compare_losses(losses)
            self.free_check.compare_parameters(params, self.free.parameters())
            free = self.free_check.summary()
            report["free_running"] = {k: free[k] for k in
                                      ("max_loss_diff", "max_grad_diff", "max_param_diff")}
        return report
