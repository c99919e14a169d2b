"""Communication meter: calls and bytes per collective, per rank, counted from outside.

`with CommMeter() as meter:` wraps the functions of `torch.distributed` in counting layers
(common/kernel/patch.py's patch_dist: they nest with any other wrapper and come off on exit, exception
or not), so the strategies' code stays plain `dist.all_reduce(...)`.
Bytes are what this rank puts on the wire, by nccl-tests' conventions (S = the full tensor, n =
the group size):

    all_reduce                          2(n-1)/n · S
    all_gather_*, reduce_scatter_*      (n-1)/n · S
    all_to_all_single                   (n-1)/n · S; with input splits: the rows sent to the others
    broadcast                           S            (0 when n = 1)
    send, isend                         S
    recv, irecv                         S received   (listed, but not in `bytes_sent`)

so a ring all-reduce built from sends totals the same as `dist.all_reduce`. A collective's bytes
and a batched send's are also counted per group (by its global ranks): `bytes_over(group)`, e.g.
HSDP's intra-node (shard group) and inter-node (replicate group) traffic, a pipeline's sends.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.kernel.comm_bytes import ring_fraction
from common.kernel.patch import patch_dist


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _arg(args, kwargs, index: int, name: str, default=None):
    return args[index] if len(args) > index else kwargs.get(name, default)


def _all_to_all_bytes(args, kwargs) -> float:
    """Even: (n-1)/n · S; uneven (input_split_sizes): S less the rows this rank keeps for itself."""
    x, group, splits = _arg(args, kwargs, 1, "input"), _arg(args, kwargs, 4, "group"), _arg(
        args, kwargs, 3, "input_split_sizes")
    if not splits:
        return ring_fraction(_group_size(group), 1.0) * _nbytes(x)
    return (sum(splits) - splits[dist.get_rank(group)]) * _nbytes(x) / max(sum(splits), 1)


# op name → (args, kwargs) ↦ bytes this rank sends
_COST: dict[str, Callable] = {
    "all_reduce": lambda a, k: ring_fraction(_group_size(_arg(a, k, 2, "group")), 2.0)
    * _nbytes(_arg(a, k, 0, "tensor")),
    "all_gather_into_tensor": lambda a, k: ring_fraction(_group_size(_arg(a, k, 2, "group")), 1.0)
    * _nbytes(_arg(a, k, 0, "output_tensor")),
    "all_gather_single": lambda a, k: ring_fraction(_group_size(_arg(a, k, 2, "group")), 1.0)
    * _nbytes(_arg(a, k, 0, "output_tensor")),
    "reduce_scatter_tensor": lambda a, k: ring_fraction(_group_size(_arg(a, k, 3, "group")), 1.0)
    * _nbytes(_arg(a, k, 1, "input")),
    "reduce_scatter_single": lambda a, k: ring_fraction(_group_size(_arg(a, k, 3, "group")), 1.0)
    * _nbytes(_arg(a, k, 1, "input")),
    "all_to_all_single": _all_to_all_bytes,
    "all_gather": lambda a, k: (_group_size(_arg(a, k, 2, "group")) - 1)
    * _nbytes(_arg(a, k, 1, "tensor")),
    "broadcast": lambda a, k: _nbytes(_arg(a, k, 0, "tensor"))
    * (_group_size(_arg(a, k, 2, "group")) > 1),
    "send": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "isend": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "recv": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "irecv": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "barrier": lambda a, k: 0.0,
}
RECEIVES = ("recv", "irecv")
_GROUP_AT = {"all_reduce": 2, "all_gather_into_tensor": 2, "all_gather_single": 2, "all_gather": 2,
             "reduce_scatter_tensor": 3, "reduce_scatter_single": 3, "all_to_all_single": 4,
             "broadcast": 2}  # where a collective takes its group (args index; keyword "group")


def _ranks(group) -> tuple[int, ...]:
    """A group's global ranks (None: the world's)."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


class CommMeter:
    """Counts calls and wire bytes per op while active. One meter at a time per process."""

    _active: CommMeter | None = None

    def __init__(self) -> None:
        self.stats: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "bytes": 0.0})
        self.by_group: dict[tuple[int, ...], float] = defaultdict(float)  # collectives' bytes per group
        self._patched = ExitStack()
        self._inside = threading.local()
        self._lock = threading.Lock()

    @property
    def bytes_sent(self) -> float:
        return sum(s["bytes"] for op, s in self.stats.items() if op not in RECEIVES)

    def bytes_over(self, group) -> float:
        """Bytes of the collectives over `group` (matched by its global ranks; None: the world)."""
        return self.by_group.get(_ranks(group), 0.0)

    def calls(self, op: str) -> int:
        return int(self.stats[op]["calls"]) if op in self.stats else 0

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {op: dict(s) for op, s in sorted(self.stats.items())}

    def _record(self, op: str, nbytes: float) -> None:
        with self._lock:
            self.stats[op]["calls"] += 1
            self.stats[op]["bytes"] += nbytes

    def _wrap(self, op: str, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            if getattr(self._inside, "active", False):  # torch calling itself: count once
                return fn(*args, **kwargs)
            nbytes = _COST[op](args, kwargs)
            self._record(op, nbytes)
            if op in _GROUP_AT:
                with self._lock:
                    self.by_group[_ranks(_arg(args, kwargs, _GROUP_AT[op], "group"))] += nbytes
            self._inside.active = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside.active = False

        counted.__name__ = fn.__name__
        return counted

    def _wrap_batch(self, fn: Callable) -> Callable:
        def counted(p2p_op_list):
            for p2p in p2p_op_list:
                send = getattr(p2p.op, "__name__", "") == "isend"
                # batch_isend_irecv tests `op.op is isend` against the (now wrapped) module global
                p2p.op = c10d.isend if send else c10d.irecv
                self._record("isend" if send else "irecv", _nbytes(p2p.tensor))
                if send:
                    with self._lock:
                        self.by_group[_ranks(p2p.group)] += _nbytes(p2p.tensor)
            self._inside.active = True
            try:
                return fn(p2p_op_list)
            finally:
                self._inside.active = False

        return counted

    def __enter__(self) -> CommMeter:
        if CommMeter._active is not None:
            raise RuntimeError("a CommMeter is already active in this process")
        p2p = ("isend", "irecv")  # P2POp checks `op in [c10d.isend, c10d.irecv]`: wrap both names
        self._patched.enter_context(patch_dist({op: partial(self._wrap, op) for op in _COST if op not in p2p}
                                               | {"batch_isend_irecv": self._wrap_batch}))
        self._patched.enter_context(patch_dist({op: partial(self._wrap, op) for op in p2p}, also=(c10d,)))
        CommMeter._active = self
        return self

    def __exit__(self, *exc) -> None:
        CommMeter._active = None
        self._patched.close()

