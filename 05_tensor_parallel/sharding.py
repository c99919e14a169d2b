"""How each parameter of a tensor-parallel module relates to the reference's full tensor, and the
collectives that use it: cut this rank's piece from a full tensor (to materialize a model split on
the meta device), gather the full tensor (for checks and checkpoints), and the true global
gradient norm for clipping, with every replicated element counted once.

A `TPShard` says: the full tensor is cut along `dim` into `num_shards` equal pieces (the last one
zero-padded to `full_size` when the size does not divide), and rank r of the TP `group` holds piece
r // (t / num_shards), i.e. each piece is held by t / num_shards consecutive ranks ("copies").
dim=None means replicated: every rank holds the whole tensor (copies = t).

    ‖g‖² = Σ_params Σ_ranks ‖g_local‖² / copies       (one all-reduce over the TP group)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


@dataclass(frozen=True)
class TPShard:
    """dim: the split dim (None: replicated); num_shards: distinct pieces; group: the TP group;
    full_size: the reference tensor's size along dim (trims the padding after a gather)."""

    dim: int | None
    num_shards: int
    group: object
    full_size: int

    @property
    def copies(self) -> int:
        """How many ranks of the group hold each piece."""
        return group_size(self.group) // self.num_shards

    @property
    def replicated(self) -> bool:
        return self.dim is None


def tp_shard_specs(module: nn.Module, group, prefix: str = "") -> dict[str, TPShard]:
    """{parameter name: TPShard} for every parameter of `module` (a model, a block, a list of
    blocks): the parallel layers describe their own weights, everything else is replicated over
    `group`. Names are `module.named_parameters()`'s (the reference's, after parallelize_*)."""
    specs: dict[str, TPShard] = {}
    for name, sub in module.named_modules(prefix=prefix):
        if hasattr(sub, "tp_specs"):
            for pname, spec in sub.tp_specs().items():
                specs[f"{name}.{pname}" if name else pname] = spec
    for name, p in module.named_parameters(prefix=prefix):
        specs.setdefault(name, TPShard(None, 1, group, p.shape[0] if p.dim() else 1))
    return specs


def local_piece(full: torch.Tensor, spec: TPShard) -> torch.Tensor:
    """This rank's piece of the full tensor (gather_tensor's inverse, no collective): piece
    rank // copies of `full` cut along spec.dim into num_shards, the last one zero-padded."""
    if spec.replicated:
        return full
    rows = -(-spec.full_size // spec.num_shards)
    index = group_rank(spec.group) // spec.copies
    front = full.movedim(spec.dim, 0)
    out = front.new_zeros((rows, *front.shape[1:]))
    part = front[index * rows:(index + 1) * rows]
    out[:part.shape[0]] = part
    return out.movedim(0, spec.dim).contiguous()


def gather_tensor(local: torch.Tensor, spec: TPShard) -> torch.Tensor:
    """The full tensor on every rank of spec.group (a collective for sharded tensors)."""
    n = group_size(spec.group)
    if spec.replicated or n == 1:
        return local.detach()
    front = local.detach().movedim(spec.dim, 0).contiguous()
    out = front.new_empty((n * front.shape[0], *front.shape[1:]))
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, front, group=spec.group)
    pieces = out.chunk(n)[::spec.copies]  # one copy of each distinct piece, in order
    return torch.cat(pieces).narrow(0, 0, spec.full_size).movedim(0, spec.dim)


def gather_full(tensors: dict[str, torch.Tensor], specs: dict[str, TPShard]) -> dict[str, torch.Tensor]:
    """Gather every named tensor (parameters or gradients) to the reference's full shape."""
    return {name: gather_tensor(t, specs[name]) for name, t in tensors.items()}


def local_sq_norm(tensors: dict[str, torch.Tensor], specs: dict[str, TPShard]) -> torch.Tensor:
    """This rank's share of the global ‖·‖²: Σ ‖t‖² / copies (float64). Summed over the TP group
    (and over whatever other dimension shards the same tensors), it counts each element once."""
    total = torch.zeros((), dtype=torch.float64, device=next(iter(tensors.values())).device)
    for name, t in tensors.items():
        total += t.detach().double().pow(2).sum() / specs[name].copies
    return total


def clip_grad_norm_(params: dict[str, nn.Parameter], specs: dict[str, TPShard], max_norm: float,
                    group) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the full (unsharded) model: total = sqrt(Σ over the
    TP group of local_sq_norm); grads *= min(1, max_norm / (total + 1e-6)). Returns total."""
    grads = {n: p.grad for n, p in params.items() if p.grad is not None}
    sq = local_sq_norm(grads, specs)
    if group_size(group) > 1:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    total = sq.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads.values():
        g.mul_(coef.to(g.dtype))
    return total
