"""ZeRO stage 3: a unit's parameters exist in full only while that unit computes.

A unit is a module the engine's `unit_policy` picks, with every parameter below it (a transformer
block), or a module left outside the picked ones with its own parameters (embedding, final norm,
output head): `flat.module_units`. One flat buffer per unit, so one all-gather per block and pass
instead of one per Linear (FSDP wraps the same blocks).

    forward   pre-hook:  all-gather unit i (or wait for its prefetch), prefetch unit i+1
              post-hook: free unit i                       (storage resized to 0 bytes)
    backward  hook on unit i's output gradient: all-gather unit i again, prefetch unit i-1
              grads of unit i accumulated: free it, reduce-scatter its gradient (optimizer.py)

so each parameter crosses the wire three times per micro-batch, (N-1)/N·Ψ·b each: two
all-gathers and one reduce-scatter, 1.5× data parallelism's all-reduce. The order of the units is
recorded during the first forward (DeepSpeed's trace); later passes prefetch along it (backward
along its reverse), and fall back to gathering on demand where the model takes another path.
Freeing works on the storage, not the tensor (`untyped_storage().resize_(0)`, as torch's FSDP1):
the tensors autograd saved for backward keep pointing at the same storage, which the backward
pre-hook fills again before they are read. Depends only on torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .flat import FlatGroup
    from .optimizer import ZeroOptimizer


class ParameterPartitioner:
    """The hooks of stage 3 on every unit's module (DeepSpeed's `DeepSpeedZeRoOffload` /
    partitioned-parameter coordinator, in miniature)."""

    def __init__(self, module: nn.Module, units: list[tuple[nn.Module, FlatGroup]], optimizer: ZeroOptimizer):
        self.optimizer = optimizer
        self.groups: dict[nn.Module, list[FlatGroup]] = {}
        for mod, g in units:
            self.groups.setdefault(mod, []).append(g)
        self.trace: list[nn.Module] = []
        self.traced, self.backward, self.cursor = False, False, 0
        self.fetched_for_backward: set[nn.Module] = set()
        module.register_forward_pre_hook(self._root_pre_forward)
        module.register_forward_hook(self._root_post_forward)
        optimizer.end_of_backward_hooks.append(self.end_of_backward)
        for mod in self.groups:
            mod.register_forward_pre_hook(self._pre_forward)
            mod.register_forward_hook(self._post_forward)

    def _sharded(self, mod: nn.Module) -> list[FlatGroup]:
        return [g for g in self.groups[mod] if not g.persistent]

    # --- the pass's order ---------------------------------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        self.backward, self.cursor = False, 0

    def _root_post_forward(self, module, args, output) -> None:
        if not self.traced:
            self.traced = True
            order, seen = [], set()
            for mod in reversed(self.trace):  # backward finishes units in about this order
                for g in self.groups[mod]:
                    if id(g) not in seen:
                        seen.add(id(g))
                        order.append(g)
            rest = [g for g in self.optimizer.flat_groups if id(g) not in seen]
            self.optimizer.reduce_order = order + rest
        self.backward, self.cursor = True, 0

    def _fetch(self, mod: nn.Module) -> None:
        """Gather `mod`'s shards (issue first, so it leads on the wire), prefetch the next unit
        of the trace, then wait for `mod`'s own."""
        group = self.optimizer.group
        for g in self._sharded(mod):
            g.gather(group)
        if not self.traced:
            self.trace.append(mod)
        else:
            order = self.trace[::-1] if self.backward else self.trace
            if self.cursor + 1 < len(order) and order[self.cursor] is mod:
                for g in self._sharded(order[self.cursor + 1]):
                    g.gather(group)
            self.cursor += 1
        for g in self._sharded(mod):
            g.wait_gather()

    # --- hooks --------------------------------------------------------------------------------
    def _pre_forward(self, mod: nn.Module, args) -> None:
        self._fetch(mod)

    def _post_forward(self, mod: nn.Module, args, output) -> None:
        """Free the unit, and hook its outputs: the gradient w.r.t. an output is computed just
        before the unit's own backward needs its parameters (DeepSpeed's pre-backward hook)."""
        for g in self._sharded(mod):
            g.free()
        if torch.is_grad_enabled():
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outputs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, mod=mod: self._pre_backward(mod))

    def _pre_backward(self, mod: nn.Module) -> None:
        self.optimizer.ensure_end_of_backward_callback()
        if mod not in self.fetched_for_backward:  # once per unit per backward, whichever output
            self.fetched_for_backward.add(mod)
            self._fetch(mod)

    def end_of_backward(self) -> None:
        """Free whatever is still gathered (a prefetch the model did not use)."""
        for g in self.optimizer.flat_groups:
            g.wait_gather()
            g.free()
        self.backward, self.cursor = False, 0
        self.fetched_for_backward.clear()
