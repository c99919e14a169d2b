"""Gradients and state of a sharded model: clipping across shards, full and sharded state dicts.

Mixed into FullyShardedDataParallel (the root). Every function that gathers is a collective over
the FSDP process group (every rank of the group calls it); names are the original parameter names
of the wrapped module, without the wrappers' `_fsdp_wrapped_module` segments, so a full state dict
loads into the unwrapped model. Clipping follows torch.nn.utils.clip_grad_norm_:

    total = sqrt(Σ_ranks Σ_shard g²)          (each element once: shards are disjoint)
    g    *= min(1, max_norm / (total + 1e-6))

Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .flat_param import FlatParamHandle
from .wrap import ShardingStrategy

WRAPPED = "_fsdp_wrapped_module"


def clean_name(name: str) -> str:
    """Drop the wrapper's segments: '_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.w' → 'layers.0.w'."""
    return ".".join(part for part in name.split(".") if part and part != WRAPPED)


class ShardedStateMixin:
    """Methods of the root FullyShardedDataParallel over all of its units' flat parameters."""

    def handles(self) -> list[FlatParamHandle]:
        """The flat-parameter handle of every unit that has parameters (root first)."""
        return [u._handle for u in self.units() if u._handle is not None]

    def grad_norm_squared_local(self) -> torch.Tensor:
        """Σ g² over this rank's shards (a 0-d tensor, no collective)."""
        grads = [h.flat_param.grad for h in self.handles() if h.flat_param.grad is not None]
        if not grads:
            flat = self.handles()[0].flat_param  # the dtype the other ranks all-reduce
            return torch.zeros((), dtype=flat.dtype, device=flat.device)
        return torch.stack([g.pow(2).sum() for g in grads]).sum()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's clip_grad_norm_ over the whole (sharded) model: total = ||all grads||, each
        element counted once (shards are summed over the group; NO_SHARD grads are replicated);
        grads *= min(1, max_norm / (total + 1e-6)). Returns the total norm (collective)."""
        handles = self.handles()
        grads = [h.flat_param.grad for h in handles if h.flat_param.grad is not None]
        sharded = self.sharding_strategy != ShardingStrategy.NO_SHARD and dist.get_world_size(
            self.process_group) > 1
        if norm_type == float("inf"):
            flat = handles[0].flat_param  # a rank without gradients still joins the all-reduce
            total = (torch.stack([g.abs().max() for g in grads]).max() if grads
                     else torch.zeros((), dtype=flat.dtype, device=flat.device))
            if sharded:
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.process_group)
        elif norm_type == 2.0:
            total = self.grad_norm_squared_local()
            if sharded:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.process_group)
            total = total.sqrt()
        else:
            raise ValueError(f"norm_type={norm_type}: only 2.0 and inf are implemented")
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def _gather_named(self, tensor_of: Callable[[FlatParamHandle], torch.Tensor | None],
                      rank0_only: bool) -> dict[str, torch.Tensor] | None:
        out: dict[str, torch.Tensor] = {}
        for unit in self.units():
            if unit._handle is None:
                continue
            full = unit._handle.gather(tensor_of(unit._handle))
            prefix = f"{unit.unit_name}." if unit.unit_name else ""
            out.update({prefix + n: t.clone() for n, t in unit._handle.unflatten(full).items()})
        if rank0_only and dist.get_rank(self.process_group) != 0:
            return None
        order = self._original_order
        return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
        """{original parameter name: full tensor (the shard's dtype, i.e. the fp32 master in
        mixed precision)} plus the buffers, on group rank 0 (every rank if not rank0_only).
        A collective over the group: every rank calls it."""
        out = self._gather_named(lambda h: h.flat_param, rank0_only)
        if out is not None:
            out.update({clean_name(n): b.detach().clone() for n, b in self.module.named_buffers()})
        return out

    def full_gradients(self, rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
        """The shards' `.grad` gathered to full shape under the original names (collective)."""
        return self._gather_named(lambda h: h.flat_param.grad, rank0_only)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Every rank passes the full tensors; each keeps its own slice (no collective)."""
        for unit in self.units():
            if unit._handle is not None:
                prefix = f"{unit.unit_name}." if unit.unit_name else ""
                unit._handle.load_full({n: state_dict[prefix + n] for n in unit._handle.names})

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards: {"<unit>._flat_param": 1-d tensor} (root: "_flat_param")."""
        return {(f"{u.unit_name}." if u.unit_name else "") + "_flat_param": u._handle.flat_param.detach()
                for u in self.units() if u._handle is not None}

    def load_sharded_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, shard in self.sharded_state_dict().items():
                shard.copy_(state_dict[key])
