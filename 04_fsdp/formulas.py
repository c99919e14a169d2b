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

HSDP (HYBRID_SHARD, _HYBRID_SHARD_ZERO2): s = the shard group (a node), r = the replicate group
(across nodes), P_u padded to a multiple of s; split by the group the bytes cross:

    intra-node  (s-1)/s · P_u·b_p per unshard + (s-1)/s · P_u·b_r per reduction (+ the clip scalar)
    inter-node  2(r-1)/r · (P_u/s)·b_r per reduction: the all-reduce of the reduced shard

Which of those bytes cross the network (`network_bytes`): in a flat ring over all n = s·r ranks
with each node's GPUs adjacent, only the r hops between nodes leave a node, and NCCL runs s rings
(channels) at once, each leaving through its own NIC (one per GPU). So FULL_SHARD sends one rank's
bytes, (n-1)/n · (2·P·b_p + P·b_r), out of each node per step, 1/s of it per NIC; HSDP sends
s · 2(r-1)/r · (P/s)·b_r = 2(r-1)/r · P·b_r per node. At b_p = b_r the cut is
1.5 · (n-1)/n · r/(r-1): 2.8× at r = 2, s = 8, and 1.5× as r grows. HSDP's larger wins are which
bytes leave the node (none of the all-gathers, 2/3 of the bytes, on the critical path and repeated
every micro-batch) and shorter rings (s and r ranks instead of n).

Pure functions of a description of the units (`UnitTraffic`, from `shard_layout()` or computed
without a model), so chapter 04's report and chapter 07's (which counts unshards per schedule
action) share one formula. Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from common.kernel.comm_bytes import ring_fraction

from .flat_param import UnitShard
from .wrap import ShardingStrategy, reshards_after_forward


class UnitTraffic(NamedTuple):
    """What one unit's communication depends on."""

    padded_numel: int  # P_u padded to a multiple of the group size
    full_bytes: int  # its gathered copy: padded_numel · b_p
    reduce_itemsize: int  # b_r
    is_root: bool  # the root unit stays gathered from forward to the end of backward
    shard_itemsize: int = 4  # the master shard's dtype (fp64 shards clip in fp64)


def unit_traffic(layout: Iterable[UnitShard], group_size: int | None = None) -> list[UnitTraffic]:
    """The description of each unit of `FullyShardedDataParallel.shard_layout()`; with
    `group_size`, as if padded for a group of that size (another sharding of the same units)."""
    out = []
    for u in layout:
        padded = u.padded_numel if group_size is None else -(-u.numel // group_size) * group_size
        out.append(UnitTraffic(padded, padded * u.param_dtype.itemsize, u.reduce_dtype.itemsize,
                               u.name == "", u.flat_param.element_size()))
    return out


def unit_comm_bytes_by_group(unit: UnitTraffic, group_size: int, sharding_strategy: ShardingStrategy,
                             gathers: int, reductions: int, replicate_size: int = 1) -> tuple[float, float]:
    """One unit's bytes for `gathers` unshards and `reductions` gradient reductions, as (over the
    shard group of `group_size`, over the replicate group of `replicate_size`: HSDP only)."""
    reduced = unit.padded_numel * unit.reduce_itemsize
    if sharding_strategy == ShardingStrategy.NO_SHARD:
        return reductions * ring_fraction(group_size, 2) * reduced, 0.0
    ring = ring_fraction(group_size)
    intra = gathers * ring * unit.full_bytes + reductions * ring * reduced
    return intra, reductions * ring_fraction(replicate_size, 2) * reduced / group_size


def unit_comm_bytes(unit: UnitTraffic, group_size: int, sharding_strategy: ShardingStrategy,
                    gathers: int, reductions: int, replicate_size: int = 1) -> float:
    """One unit's bytes for `gathers` unshards and `reductions` gradient reductions (both groups)."""
    return sum(unit_comm_bytes_by_group(unit, group_size, sharding_strategy, gathers, reductions,
                                        replicate_size))


def unshards_per_micro_batch(unit: UnitTraffic, sharding_strategy: ShardingStrategy) -> int:
    """FULL_SHARD and HYBRID_SHARD blocks: forward and backward; the root, SHARD_GRAD_OP and
    _HYBRID_SHARD_ZERO2: forward only."""
    return 2 if reshards_after_forward(sharding_strategy) and not unit.is_root else 1


def fsdp_comm_bytes_by_group(units: Iterable[UnitTraffic], group_size: int,
                             sharding_strategy: ShardingStrategy, micro_batches: int = 1,
                             no_sync: bool = False, clip: bool = False,
                             replicate_size: int = 1) -> dict[str, float]:
    """Accounted wire bytes of one optimizer step on one rank, {"intra": over the shard group (the
    clipping norm's all-reduce too), "inter": over the replicate group} (see the module docstring)."""
    units = list(units)
    reductions = 1 if no_sync else micro_batches
    intra = inter = 0.0
    for u in units:
        a, b = unit_comm_bytes_by_group(u, group_size, sharding_strategy,
                                        micro_batches * unshards_per_micro_batch(u, sharding_strategy),
                                        reductions, replicate_size)
        intra, inter = intra + a, inter + b
    if clip and sharding_strategy != ShardingStrategy.NO_SHARD:
        intra += ring_fraction(group_size, 2) * (8 if any(u.shard_itemsize == 8 for u in units) else 4)
    return {"intra": intra, "inter": inter}


def fsdp_comm_bytes(units: Iterable[UnitTraffic], group_size: int, sharding_strategy: ShardingStrategy,
                    micro_batches: int = 1, no_sync: bool = False, clip: bool = False,
                    replicate_size: int = 1) -> float:
    """Accounted wire bytes of one optimizer step on one rank, both groups together."""
    return sum(fsdp_comm_bytes_by_group(units, group_size, sharding_strategy, micro_batches, no_sync, clip,
                                        replicate_size).values())


def network_bytes(units: Iterable[UnitTraffic], ranks_per_node: int, nodes: int,
                  sharding_strategy: ShardingStrategy, micro_batches: int = 1,
                  no_sync: bool = False) -> dict[str, float]:
    """Where one optimizer step's bytes travel on `nodes` nodes (r) of `ranks_per_node` GPUs (s),
    one NIC per GPU, nccl-tests' accounting, n = s·r. HYBRID_SHARD / _HYBRID_SHARD_ZERO2 shard over
    a node and all-reduce across nodes; any other strategy shards over all n ranks in one ring
    whose r inter-node hops carry, summed over NCCL's s channels, one rank's bytes per node.
    `units`: padded as for the group they shard over (`unit_traffic(layout, group_size)`).

        "network_gather", "network_reduce"   bytes leaving one node over the network, per step
        "network_per_nic"                    their sum / s: what one NIC carries
        "nvlink_per_gpu"                     what one GPU sends inside its node
        "shard_ring", "replicate_ring"       ranks in the rings the collectives run over
    """
    units, s, r = list(units), ranks_per_node, nodes
    hybrid = sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    group, replicate = (s, r) if hybrid else (s * r, 1)
    reductions = 1 if no_sync else micro_batches
    gather = reduce = inter = 0.0
    for u in units:
        gathers = micro_batches * unshards_per_micro_batch(u, sharding_strategy)
        gather += unit_comm_bytes_by_group(u, group, sharding_strategy, gathers, 0, replicate)[0]
        intra, across = unit_comm_bytes_by_group(u, group, sharding_strategy, 0, reductions, replicate)
        reduce, inter = reduce + intra, inter + across
    if hybrid:  # gathers and reduce-scatters stay in the node; each GPU all-reduces its shard across
        out = {"network_gather": 0.0, "network_reduce": s * inter, "nvlink_per_gpu": gather + reduce}
    else:  # one ring over every rank: per node, one rank's bytes leave; each GPU's NIC carries 1/s
        out = {"network_gather": gather, "network_reduce": reduce,
               "nvlink_per_gpu": (gather + reduce) * (s - 1) / s}
    out["network_per_nic"] = (out["network_gather"] + out["network_reduce"]) / s
    return {**out, "shard_ring": group, "replicate_ring": replicate}
