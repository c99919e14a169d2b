"""FSDP's communication in closed form: the bytes one rank puts on the wire, from the units' sizes.

nccl-tests' conventions, n = the group size, per unit of padded size P_u (b_p = the gathered dtype's
bytes, b_r = the reduction's):

    all-gather      (n-1)/n · P_u·b_p     once per unshard
    reduce-scatter  (n-1)/n · P_u·b_r     once per reduction (NO_SHARD: all-reduce, 2(n-1)/n · P_u·b_r)

Per optimizer step of m micro-batches: a FULL_SHARD block is gathered twice per micro-batch
(forward, backward), the root unit and SHARD_GRAD_OP units once (they stay gathered from forward
to the end of backward); each unit is reduced once per micro-batch, or once per step under
no_sync(); clipping all-reduces one scalar (fp64 when the shards are, else fp32). With every
parameter in blocks, FULL_SHARD moves (n-1)/n · (2·P·b_p + P·b_r): 1.5× DDP's 2(n-1)/n · P·b.

Pure functions of a description of the units (`UnitTraffic`, from `shard_layout()` or computed
without a model), so chapter 04's report and chapter 07's (which counts unshards per schedule
action) share one formula. Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from .flat_param import UnitShard
from .wrap import ShardingStrategy


class UnitTraffic(NamedTuple):
    """What one unit's communication depends on."""

    padded_numel: int  # P_u padded to a multiple of the group size
    full_bytes: int  # its gathered copy: padded_numel · b_p
    reduce_itemsize: int  # b_r
    is_root: bool  # the root unit stays gathered from forward to the end of backward
    shard_itemsize: int = 4  # the master shard's dtype (fp64 shards clip in fp64)


def unit_traffic(layout: Iterable[UnitShard]) -> list[UnitTraffic]:
    """The description of each unit of `FullyShardedDataParallel.shard_layout()`."""
    return [UnitTraffic(u.padded_numel, u.full_bytes, u.reduce_dtype.itemsize, u.name == "",
                        u.flat_param.element_size()) for u in layout]


def ring(n: int, factor: float = 1.0) -> float:
    """factor · (n-1)/n: the share of a tensor one rank sends in a ring collective (0 alone)."""
    return factor * (n - 1) / n if n > 1 else 0.0


def unit_comm_bytes(unit: UnitTraffic, group_size: int, sharding_strategy: ShardingStrategy,
                    gathers: int, reductions: int) -> float:
    """One unit's bytes for `gathers` unshards and `reductions` gradient reductions."""
    reduced = unit.padded_numel * unit.reduce_itemsize
    if sharding_strategy == ShardingStrategy.NO_SHARD:
        return reductions * ring(group_size, 2) * reduced
    return gathers * ring(group_size) * unit.full_bytes + reductions * ring(group_size) * reduced


def unshards_per_micro_batch(unit: UnitTraffic, sharding_strategy: ShardingStrategy) -> int:
    """FULL_SHARD blocks: forward and backward; the root and SHARD_GRAD_OP: forward only."""
    full_shard = sharding_strategy == ShardingStrategy.FULL_SHARD
    return 2 if full_shard and not unit.is_root else 1


def fsdp_comm_bytes(units: Iterable[UnitTraffic], group_size: int, sharding_strategy: ShardingStrategy,
                    micro_batches: int = 1, no_sync: bool = False, clip: bool = False) -> float:
    """Accounted wire bytes of one optimizer step on one rank (see the module docstring)."""
    units = list(units)
    reductions = 1 if no_sync else micro_batches
    total = sum(unit_comm_bytes(u, group_size, sharding_strategy,
                                micro_batches * unshards_per_micro_batch(u, sharding_strategy), reductions)
                for u in units)
    if clip and sharding_strategy != ShardingStrategy.NO_SHARD:
        total += ring(group_size, 2) * (8 if any(u.shard_itemsize == 8 for u in units) else 4)
    return total
