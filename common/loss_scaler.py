"""Dynamic loss scaling for fp16, written from scratch: torch.amp.GradScaler's rule, step for step.

fp16 keeps 11 significant bits but only 5 exponent bits: its smallest subnormal is 2⁻²⁴ ≈ 6e-8,
and a fifth of a small LLaMA's gradient elements lie below its smallest normal 2⁻¹⁴ ≈ 6e-5.
Backward multiplies the loss's gradient through every layer, so multiplying the loss by s shifts
every gradient up by log₂ s binades, out of the underflow zone; the fp32 masters take g·s / s = g:

    backward of s·L                 fp16 gradients of s·L (inf/nan where s·g overflowed 65504)
    unscale_(grads)                 found_inf = any(!isfinite(g)) on this rank;  g ← g · (1/s)
    skip_step(group)                found_inf ← Σ over the ranks holding parts of the gradient > 0
    step() unless found_inf         clip (unscaled), optimizer step; else skip the step
    update()                        found_inf: s ← s·backoff, good ← 0
                                    else good ← good + 1; good = interval: s ← s·growth, good ← 0

The scale and the tracker are device tensors updated with tensor ops, as torch's are; the only
host read is `should_skip()`'s, once per step. The agreement is what a sharded run needs: under ZeRO
or FSDP each rank checks only its shard of the reduced gradient, so an overflow in one element
reaches one rank, and without the all-reduce that rank would skip while the others stepped.
Imports only torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class LossScaling:
    """The scaler's settings, torch.amp.GradScaler's names and defaults."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1):
            raise ValueError(f"{self}: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                             "and growth_interval >= 1 (torch's GradScaler: 65536, 2, 0.5, 2000)")


class DynamicLossScaler:
    """GradScaler's dynamic loss scaling on explicit gradient lists (the fp32 masters' gradients,
    or a sharded optimizer's gradient shards), with the overflow flag agreed across ranks."""

    def __init__(self, settings: LossScaling = LossScaling(), device: torch.device | str = "cpu"):
        self.settings, self.device = settings, torch.device(device)
        self.scale = torch.full((), settings.init_scale, dtype=torch.float32, device=self.device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=self.device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        self.skipped_steps = 0  # counted on the host by should_skip()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """s · loss (the loss is fp32: model.loss_fn upcasts fp16 logits)."""
        return loss * self.scale.to(loss.device)

    @torch.no_grad()
    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> torch.Tensor:
        """found_inf ← any non-finite element of `grads` (checked before the multiply, as torch's
        `_amp_foreach_non_finite_check_and_unscale_`), then g ← g · fp32(1 / fp64(s)) in place.
        Returns this rank's flag (1.0 or 0.0), not yet agreed."""
        inv_scale = self.scale.double().reciprocal().float()
        self.found_inf.zero_()
        for g in grads:
            if g is None or g.numel() == 0:
                continue
            self.found_inf.logical_or_(~torch.isfinite(g).all())
            g.mul_(inv_scale.to(g.dtype))
        return self.found_inf

    def agree_(self, group=None) -> torch.Tensor:
        """found_inf ← 1 if any rank of `group` found one (SUM of the flags, then > 0): every rank
        then skips or steps together. `group` None is the world; a group of one rank is a no-op."""
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(self.found_inf, op=dist.ReduceOp.SUM, group=group)
            self.found_inf.copy_(self.found_inf > 0)
        return self.found_inf

    def skip_step(self, group=None) -> bool:
        """`agree_(group)`, then `should_skip()`: what every rank of a distributed step calls."""
        self.agree_(group)
        return self.should_skip()

    def should_skip(self) -> bool:
        """Whether this step's optimizer step is skipped (one host read of the flag; counted)."""
        skip = bool(self.found_inf.item())
        self.skipped_steps += skip
        return skip

    @torch.no_grad()
    def update(self) -> None:
        """Back off after an overflow, grow after `growth_interval` good steps in a row (a growth
        that would overflow fp32 is dropped, the tracker reset all the same: torch's
        `_amp_update_scale_`)."""
        s, found = self.settings, self.found_inf > 0
        good = torch.where(found, torch.zeros_like(self.growth_tracker), self.growth_tracker + 1)
        grow = good == s.growth_interval
        times = lambda factor: (self.scale.double() * factor).float()  # noqa: E731  (float × double, as torch's)
        grown = times(s.growth_factor)
        new_scale = torch.where(found, times(s.backoff_factor),
                                torch.where(grow & torch.isfinite(grown), grown, self.scale))
        self.scale.copy_(new_scale)
        self.growth_tracker.copy_(torch.where(grow, torch.zeros_like(good), good))

    def get_scale(self) -> float:
        return self.scale.item()

    def state_dict(self) -> dict:
        """GradScaler's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker."""
        s = self.settings
        return {"scale": self.get_scale(), "growth_factor": s.growth_factor,
                "backoff_factor": s.backoff_factor, "growth_interval": s.growth_interval,
                "_growth_tracker": int(self.growth_tracker.item())}

    def load_state_dict(self, state: dict) -> None:
        """The scale and the tracker from `state` (the settings must be this scaler's)."""
        s = self.settings
        theirs = (state["growth_factor"], state["backoff_factor"], state["growth_interval"])
        if theirs != (s.growth_factor, s.backoff_factor, s.growth_interval):
            raise ValueError(f"state with growth_factor, backoff_factor, growth_interval {theirs} into a "
                             f"scaler with {(s.growth_factor, s.backoff_factor, s.growth_interval)}")
        self.scale.fill_(state["scale"])
        self.growth_tracker.fill_(state["_growth_tracker"])


def agreement_bytes(n: int) -> float:
    """Accounted wire bytes per rank of agreeing the flag among n ranks: one fp32 all-reduce,
    2(n-1)/n · 4 (per step, beside a chapter's gradient traffic)."""
    return 2 * (n - 1) / n * 4


def make_scaler(mixed_precision: str, settings: LossScaling,
                device: torch.device | str) -> DynamicLossScaler | None:
    """The scaler of a run: fp16 has one, every other precision none."""
    return DynamicLossScaler(settings, device) if mixed_precision == "fp16" else None
