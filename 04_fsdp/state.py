"""Gradients and state of a sharded model: its shard layout, clipping across shards, full and
sharded state dicts.

Mixed into FullyShardedDataParallel (the root). Every function that gathers is a collective over
the FSDP process group (every rank of the group calls it); names are the original parameter names
of the wrapped module, without the wrappers' `_fsdp_wrapped_module` segments, so a full state dict
loads into the unwrapped model. Clipping follows torch.nn.utils.clip_grad_norm_ (common/clip.py):

    total = sqrt(Σ_ranks Σ_shard g²)          (each element once: shards are disjoint)
    g    *= min(1, max_norm / (total + 1e-6))

Depends only on torch and common/clip.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from common.clip import accumulate_dtype, clip_grad_norm_

from .flat_param import FlatParamHandle, UnitShard
from .wrap import ShardingStrategy

WRAPPED = "_fsdp_wrapped_module"


def clean_name(name: str) -> str:
    """Drop the wrapper's segments: '_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.w' → 'layers.0.w'."""
    return ".".join(part for part in name.split(".") if part and part != WRAPPED)


class ShardedStateMixin:
    """Methods of the root FullyShardedDataParallel over all of its units' flat parameters."""

    def _handles(self) -> list[FlatParamHandle]:
        """The flat-parameter handle of every unit that has parameters (root first); private:
        `shard_layout()` is the public description of what a rank holds."""
        return [u._handle for u in self.units() if u._handle is not None]

    def shard_layout(self) -> list[UnitShard]:
        """Every unit under this root that has parameters (root first), as this rank holds it:
        its flat shard, its sizes, its dtypes (from its MixedPrecision config) and, for every
        original parameter, the piece this rank holds (ParamShard)."""
        out = []
        for unit in self.units():
            h = unit._handle
            if h is None:
                continue
            mp, dtype = unit.mixed_precision, h.flat_param.dtype
            prefix = f"{unit.unit_name}." if unit.unit_name else ""
            out.append(UnitShard(
                name=unit.unit_name, flat_param=h.flat_param, params=h.param_shards(prefix, clean_name),
                numel=h.numel, padded_numel=h.padded, shard_numel=h.shard_numel, shard_rank=h.shard_rank,
                shard_world=h.shard_world, param_dtype=mp.param_dtype or dtype,
                reduce_dtype=mp.reduce_dtype or mp.param_dtype or dtype, full=h.full, aliased=h.alias))
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's clip_grad_norm_ over the whole (sharded) model: total = ||all grads||, each
        element counted once (shards are summed over the group; NO_SHARD grads are replicated);
        grads *= min(1, max_norm / (total + 1e-6)). Returns the total norm (collective)."""
        flats = [h.flat_param for h in self._handles()]
        sharded = self.sharding_strategy != ShardingStrategy.NO_SHARD
        return clip_grad_norm_([p.grad for p in flats], max_norm, norm_type=norm_type,
                               groups=(self.process_group or dist.group.WORLD,) if sharded else (),
                               device=flats[0].device, dtype=accumulate_dtype(flats))

    def _gather_named(self, tensor_of: Callable[[UnitShard], torch.Tensor | None],
                      rank0_only: bool) -> dict[str, torch.Tensor] | None:
        out: dict[str, torch.Tensor] = {}
        for unit, h in zip(self.shard_layout(), self._handles(), strict=True):
            full = h.gather(tensor_of(unit))
            pieces = full[: unit.numel].split([p.shape.numel() for p in unit.params])
            out.update({p.name: t.view(p.shape).clone() for p, t in zip(unit.params, pieces, strict=True)})
        if rank0_only and dist.get_rank(self.process_group) != 0:
            return None
        order = self._original_order
        return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
        """{original parameter name: full tensor (the shard's dtype, i.e. the fp32 master in
        mixed precision)} plus the buffers, on group rank 0 (every rank if not rank0_only).
        A collective over the group: every rank calls it."""
        out = self._gather_named(lambda u: u.flat_param, rank0_only)
        if out is not None:
            out.update({clean_name(n): b.detach().clone() for n, b in self.module.named_buffers()})
        return out

    def full_gradients(self, rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
        """The shards' `.grad` gathered to full shape under the original names (collective)."""
        return self._gather_named(lambda u: u.flat_param.grad, rank0_only)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Every rank passes the full tensors; each keeps its own slice (no collective)."""
        with torch.no_grad():
            for unit in self.shard_layout():
                for p in unit.params:
                    piece = state_dict[p.name].detach().reshape(-1)[p.offset : p.offset + p.numel]
                    unit.flat_param[p.shard_offset : p.shard_offset + p.numel].copy_(piece)

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards: {"<unit>._flat_param": 1-d tensor} (root: "_flat_param")."""
        return {(f"{u.name}." if u.name else "") + "_flat_param": u.flat_param.detach()
                for u in self.shard_layout()}

    def load_sharded_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, shard in self.sharded_state_dict().items():
                shard.copy_(state_dict[key])
