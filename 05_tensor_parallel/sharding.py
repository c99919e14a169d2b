"""How each parameter of a tensor-parallel module relates to the reference's full tensor, and the
collectives that use it: cut this rank's piece from a full tensor (to materialize a model split on
the meta device), gather the full tensor (for checks and checkpoints), and which rank counts a
piece in the true global gradient norm (common.kernel.clip), so that every element is counted once.

A `TPShard` says: the full tensor is cut along `dim` into `num_shards` equal pieces (the last one
zero-padded to `full_size` when the size does not divide), and rank r of the TP `group` holds piece
r // (t / num_shards), i.e. each piece is held by t / num_shards consecutive ranks ("copies").
dim=None means replicated: every rank holds the whole tensor (copies = t).

    ‖g‖² = Σ_params Σ_{ranks r with r % copies = 0} ‖g_local‖²     (one all-reduce over the TP group)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.collectives import all_gather_single


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

    @property
    def counted_here(self) -> bool:
        """Whether this rank's piece enters a global norm: one rank of each piece's copies."""
        return group_rank(self.group) % self.copies == 0


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
    all_gather_single(out, front, group=spec.group)
    pieces = out.chunk(n)[::spec.copies]  # one copy of each distinct piece, in order
    return torch.cat(pieces).narrow(0, 0, spec.full_size).movedim(0, spec.dim)


def gather_full(tensors: dict[str, torch.Tensor], specs: dict[str, TPShard]) -> dict[str, torch.Tensor]:
    """Gather every named tensor (parameters or gradients) to the reference's full shape."""
    return {name: gather_tensor(t, specs[name]) for name, t in tensors.items()}
