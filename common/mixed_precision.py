"""fp32 master weights for a model that computes in bf16: the one copy every whole-tensor strategy uses.

    forward/backward in bf16 (the model's parameters θ_bf16)      grads g (bf16, or fp32 main_grad)
    master.grad = float32(g)                                      grads_to_master()
                 (or += per micro-batch, as backward produces g)  accumulate_in_backward()
    optimizer.step() on the masters θ_32                          (clip them first)
    θ_bf16 ← bf16(θ_32)                                           copy_to_model()

Rounding θ to bf16 after every step without a master would lose updates smaller than θ·2⁻⁸ (bf16
keeps 8 significant bits); the master keeps them. Bytes: 4 per parameter, beside AdamW's 8.
When `enabled` is False the masters *are* the model's parameters and every method is a no-op
(one code path for float32/float64 training). Sharded strategies (ZeRO, FSDP) keep their master as
their own fp32 shard instead. Imports only torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial

import torch
from torch import nn


class MasterWeights:
    """Masters of `params` in `dtype` (float32); `.master[i]` pairs with `params[i]`."""

    def __init__(self, params: Iterable[nn.Parameter], enabled: bool, dtype: torch.dtype = torch.float32):
        self.params = list(params)
        self.enabled = enabled
        self.master = ([p.detach().to(dtype).clone().requires_grad_() for p in self.params]
                       if enabled else self.params)

    @torch.no_grad()
    def grads_to_master(self, grads: Sequence[torch.Tensor | None] | None = None) -> None:
        """master.grad = float32(g) for each model grad (default: `p.grad`, which is then freed;
        pass `grads` for e.g. DDP's fp32 main_grad buckets, which are used in place, no copy)."""
        if not self.enabled:
            return
        own = grads is None
        grads = [p.grad for p in self.params] if own else grads
        for m, p, g in zip(self.master, self.params, grads, strict=True):
            if g is None:
                continue
            m.grad = g.to(m.dtype)
            if own:
                p.grad = None

    def accumulate_in_backward(self) -> None:
        """From now on, as soon as a backward has finished a parameter's bf16 gradient, add it
        into its master's fp32 grad and free it (Megatron's main_grad): k micro-batches are summed
        in fp32, the bf16 grads never outlive their backward. A hook per parameter."""
        if not self.enabled:
            return
        for m, p in zip(self.master, self.params, strict=True):
            p.register_post_accumulate_grad_hook(partial(_add_into, m))

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """θ_bf16 ← round(θ_32), after the optimizer stepped the masters."""
        if self.enabled:
            for m, p in zip(self.master, self.params, strict=True):
                p.copy_(m)

    def zero_grad(self) -> None:
        """Drop the masters' grads (the model's own, and all grads when disabled, are the
        strategy's business: DDP's grads are bucket views that must stay)."""
        if self.enabled:
            for m in self.master:
                m.grad = None


@torch.no_grad()
def _add_into(master: torch.Tensor, p: torch.Tensor) -> None:
    g = p.grad.to(master.dtype)
    master.grad = g if master.grad is None else master.grad.add_(g)
    p.grad = None
