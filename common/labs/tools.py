"""Tools for a lab's properties, shared so that each chapter's check module reads as its list of
properties (common/labs/grader.py runs them).

On the ranks: seeded tensors every rank and the grader draw alike (`rand`), the world cut into
process groups other than the world (`split`: a lab's `group=` argument must be used), every
rank's agreement (`agree`: all go on, or none), this rank's rows of a global batch, and the
collectives a piece posts (`collectives`, the outermost call only).

In the grader: the one-device training a lab is compared with (`one_device`, cached: the same
run serves every property and every planted bug of a test session), the groups of a
configuration (`group_of`, `members`) and where a rank sits (`where`).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, partial

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.data import SyntheticTokens, local_micro_batches, split_inputs_targets
from common.kernel.model import LlamaConfig
from common.kernel.patch import patch_dist
from common.reference import make_reference

# --- on the ranks ------------------------------------------------------------------------------


def rand(tag: str, *shape: int, rank: int = 0) -> torch.Tensor:
    """Standard normal float64 values, a pure function of (tag, rank)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{tag}/{rank}".encode()))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def everyone(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (pickled: any size, None included)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree(ok: bool) -> bool:
    """True on every rank when `ok` is true on every rank: all go on, or none does."""
    return all(everyone(bool(ok)))


@dataclass(frozen=True)
class Group:
    """This rank's process group (None: the whole world), its rank in it, its size, and the
    global rank of its member 0."""

    group: object
    rank: int
    size: int
    first: int


def group_of(sizes: Sequence[int], rank: int) -> tuple[int, int, int]:
    """(rank in its group, the group's size, the group's first global rank) of global `rank` when
    the world is cut into consecutive groups of `sizes`: the grader's side of `split`."""
    first = 0
    for size in sizes:
        if rank < first + size:
            return rank - first, size, first
        first += size
    raise ValueError(f"rank {rank} is beyond groups of {list(sizes)}")


def members(config: dict) -> list[list[int]]:
    """The global ranks of each group of a configuration (`groups`: sizes; default the world)."""
    sizes, out = config.get("groups") or [config["world"]], []
    for size in sizes:
        out.append(list(range(sum(map(len, out)), sum(map(len, out)) + size)))
    return out


def split(sizes: Sequence[int] | None = None) -> Group:
    """The world cut into consecutive groups of `sizes` (None: the world itself); every rank
    makes every group, in the same order, and gets its own."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = list(sizes or [world])
    if sum(sizes) != world:
        raise ValueError(f"groups of {sizes} do not cut a world of {world}")
    if sizes == [world]:
        return Group(None, rank, world, 0)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    groups = [dist.new_group(list(range(s, s + n))) for s, n in zip(starts, sizes, strict=True)]
    mine, size, first = group_of(sizes, rank)
    return Group(groups[starts.index(first)], mine, size, first)


def local_rows(step: int, group_rank: int, group_size: int, batch: int, cfg: LlamaConfig, seq: int,
               micro: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of global batch `step`, in `micro` micro-batches, as (inputs, targets)."""
    tokens = SyntheticTokens(cfg.vocab_size, seq, seed=0).global_batch(step, batch)
    rows = local_micro_batches(tokens, group_rank, group_size, batch // group_size // micro)
    return [split_inputs_targets(t) for t in rows]


ALIASES = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
           "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}
REDUCE_OPS = (dist.ReduceOp, dist.ReduceOp.RedOpType)
COUNTED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather", "reduce_scatter_tensor",
           "reduce_scatter_single", "reduce_scatter", "broadcast", "all_to_all_single", "reduce", "send",
           "recv", "isend", "irecv", "batch_isend_irecv")


@dataclass(frozen=True)
class Posted:
    """One collective: its name (all-gathers and reduce-scatters under one name each), the
    elements of its largest tensor argument, its group's size, and its ReduceOp (or '')."""

    op: str
    numel: int
    group: int
    reduce: str = ""

    def __str__(self) -> str:
        return f"{self.op}({self.numel:,}{', ' + self.reduce if self.reduce not in ('', 'SUM') else ''})"


@contextmanager
def collectives(*modules) -> Iterator[list[Posted]]:
    """The collectives posted inside, in order (the outermost call only: an old name that calls
    the new one counts once), wrapped by common.kernel.patch.patch_dist on torch.distributed, its
    distributed_c10d aliases and `modules` where they hold torch.distributed's own functions."""
    posted: list[Posted] = []
    depth = [0]

    def wrap(name, fn):
        def call(*args, **kwargs):
            if depth[0] == 0:
                values = [*args, *kwargs.values()]
                sizes = [sum(t.numel() for t in a) if isinstance(a, (list, tuple)) else a.numel()
                         for a in values if torch.is_tensor(a) or (isinstance(a, (list, tuple)) and a
                                                                    and all(map(torch.is_tensor, a)))]
                group = next((a for a in values if isinstance(a, dist.ProcessGroup)), None)
                op = next((a for a in values if isinstance(a, REDUCE_OPS)), None)
                reduce = str(op).split(".")[-1] if op is not None else ("SUM" if "reduce" in name else "")
                posted.append(Posted(ALIASES.get(name, name), max(sizes, default=0),
                                     dist.get_world_size(group), reduce))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    with patch_dist({name: partial(wrap, name) for name in COUNTED}, also=(c10d, *modules)):
        yield posted


# --- in the grader -----------------------------------------------------------------------------


@dataclass(frozen=True)
class OneDevice:
    """The one-device run: per step the loss, the gradients (before clipping), their norm; the
    parameters before the first step (params[0]) and after each (params[k + 1])."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    norms: list[float]
    params: list[dict[str, torch.Tensor]]


@cache
def one_device(cfg: LlamaConfig, steps: int, batch: int, seq: int, optimizer: str, lr: float,
               clip: float | None = None) -> OneDevice:
    """common.reference's trainer on the same global batches (seed 0), float64."""
    trainer = make_reference(cfg, 0, torch.float64, optimizer, lr, clip_grad=clip)
    data = SyntheticTokens(cfg.vocab_size, seq, seed=0)
    out = OneDevice([], [], [], [{n: t.clone() for n, t in trainer.parameters().items()}])
    for step in range(steps):
        loss, grads = trainer.step(data.global_batch(step, batch))
        out.losses.append(loss)
        out.grads.append(grads)
        out.norms.append(float(torch.stack([g.norm() for g in grads.values()]).norm()))
        out.params.append({n: t.clone() for n, t in trainer.parameters().items()})
    return out


def where(config: dict, rank: int) -> str:
    """A rank in words: its world, its group (when the world is cut) and its rank."""
    sizes = config.get("groups")
    if not sizes:
        return f"world {config['world']}, rank {rank}"
    mine, size, _ = group_of(sizes, rank)
    return f"world {config['world']} cut into groups {list(sizes)}: rank {rank} (rank {mine} of {size})"
