"""Point-to-point plans replayed under NCCL's semantics, and the P2P groups real code posts.

A *plan* is what each rank of one communicator posts, in order: a list of groups, each group the
sends and receives of one `batch_isend_irecv` (a lone `isend`/`irecv` is a group of one). Under
NCCL (ProcessGroupNCCL, one stream per communicator):

    1. a rank's groups run one after another, in the order it issued them;
    2. the k-th send from a to b is matched by the k-th receive at b from a (FIFO per pair);
    3. an op completes only while both it and its match are in their ranks' *current* groups
       (a send does not complete by itself: it waits for the receive to run), and a group ends
       when all its ops have completed.

gloo buffers sends, so a plan that breaks rule 3 passes on CPU and hangs on GPUs. `find_deadlock`
replays a plan under the three rules and returns the first stuck state (the waiting groups and
what each waits for), or None when every group completes. `P2PRecorder` records, on one rank, the
groups that running code really posts, so that the suite replays the code as well as the plan.
(NCCL may complete a small send early from its internal buffers; real activations do not fit.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.kernel.patch import patch_dist


@dataclass(frozen=True)
class PlannedOp:
    """One send or receive of a group: `peer` is the other rank (in the plan's numbering),
    `nbytes` the message size (a matched pair must agree), `label` says what it carries."""

    kind: str  # "send" or "recv"
    peer: int
    nbytes: int = 0
    label: str = ""

    def __str__(self) -> str:
        arrow = "→" if self.kind == "send" else "←"
        return f"{self.kind}{arrow}{self.peer}" + (f" {self.label}" if self.label else "")


Group = Sequence[PlannedOp]
Plan = dict[int, Sequence[Group]]  # rank -> its groups, in issue order


def as_op(op) -> PlannedOp:
    """A PlannedOp from a PlannedOp, an object with kind/peer/nbytes, or a (kind, peer[, nbytes
    [, label]]) tuple: the core files of 02 and 06 describe plans in plain tuples (torch only)."""
    if isinstance(op, PlannedOp):
        return op
    if isinstance(op, tuple):
        return PlannedOp(*op)
    return PlannedOp(op.kind, op.peer, getattr(op, "nbytes", 0), getattr(op, "label", ""))


def normalize(plan: dict[int, Iterable[Iterable]]) -> dict[int, list[tuple[PlannedOp, ...]]]:
    return {rank: [tuple(as_op(op) for op in group) for group in groups] for rank, groups in plan.items()}


@dataclass
class Deadlock:
    """A replay that stopped: `stuck[rank] = (group index, the group, its unfinished ops)`;
    `waits` says, per stuck rank, which rank and group the first unfinished op waits for."""

    stuck: dict[int, tuple[int, tuple[PlannedOp, ...], list[PlannedOp]]]
    waits: dict[int, str]
    reason: str = "deadlock"

    def __str__(self) -> str:
        lines = [f"{self.reason}:"]
        for rank, (index, group, pending) in sorted(self.stuck.items()):
            lines.append(f"  rank {rank} group {index} [{', '.join(map(str, group))}] "
                         f"waits on {', '.join(map(str, pending))}: {self.waits.get(rank, '')}")
        return "\n".join(lines)


def _match(plan: dict[int, list[tuple[PlannedOp, ...]]]) -> tuple[dict, list[str]]:
    """FIFO matching per (src, dst): {(rank, group, op index): (peer, group, op index)}."""
    queues: dict[tuple[int, int, str], list[tuple[int, int, int]]] = defaultdict(list)
    for rank, groups in plan.items():
        for g, group in enumerate(groups):
            for i, op in enumerate(group):
                src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                queues[(src, dst, op.kind)].append((rank, g, i))
    match, errors = {}, []
    for (src, dst, kind), ops in queues.items():
        if kind != "send":
            continue
        recvs = queues.get((src, dst, "recv"), [])
        if len(recvs) != len(ops):
            errors.append(f"{len(ops)} sends {src}→{dst} but {len(recvs)} receives")
        for send, recv in zip(ops, recvs, strict=False):
            s_op, r_op = plan[send[0]][send[1]][send[2]], plan[recv[0]][recv[1]][recv[2]]
            if s_op.nbytes != r_op.nbytes:
                errors.append(f"send {src}→{dst} of {s_op.nbytes} B (group {send[1]}) meets a receive "
                              f"of {r_op.nbytes} B (group {recv[1]})")
            match[send], match[recv] = recv, send
    for (src, dst, kind), recvs in queues.items():
        if kind == "recv" and (src, dst, "send") not in queues:
            errors.append(f"{len(recvs)} receives {src}→{dst} but no send")
    return match, errors


def find_deadlock(plan: dict[int, Iterable[Iterable]]) -> Deadlock | None:
    """Replay `plan` under NCCL's rules (module docstring). None when every rank finishes; else
    the stuck groups. Unmatched ops or size mismatches are reported as a Deadlock too (they hang
    or corrupt on NCCL), with `reason` saying which."""
    groups = normalize(plan)
    match, errors = _match(groups)
    if errors:
        return Deadlock({}, {}, reason="unmatched plan: " + "; ".join(errors[:4]))
    current = {rank: 0 for rank in groups}
    done: set[tuple[int, int, int]] = set()
    progress = True
    while progress:
        progress = False
        for rank, gs in groups.items():
            while current[rank] < len(gs):
                g = current[rank]
                for i in range(len(gs[g])):
                    peer, pg, pi = match[(rank, g, i)]
                    if (rank, g, i) not in done and current[peer] == pg:
                        done.update({(rank, g, i), (peer, pg, pi)})
                if not all((rank, g, i) in done for i in range(len(gs[g]))):
                    break
                current[rank], progress = g + 1, True
    if all(current[rank] == len(gs) for rank, gs in groups.items()):
        return None
    stuck, waits = {}, {}
    for rank, gs in groups.items():
        g = current[rank]
        if g == len(gs):
            continue
        pending = [op for i, op in enumerate(gs[g]) if (rank, g, i) not in done]
        stuck[rank] = (g, gs[g], pending)
        first = next(i for i in range(len(gs[g])) if (rank, g, i) not in done)
        peer, pg, _ = match[(rank, g, first)]
        waits[rank] = (f"its match is in rank {peer}'s group {pg}, which is still at group "
                       f"{current[peer]}" + (f" [{', '.join(map(str, groups[peer][current[peer]]))}]"
                                             if current[peer] < len(groups[peer]) else " (finished)"))
    return Deadlock(stuck, waits)


class P2PRecorder:
    """Records the P2P groups this process posts, per communicator: `groups[ranks]` is the list of
    groups posted on the process group whose global ranks are `ranks`, each a tuple of PlannedOp
    with global peer ranks (P2POp's `peer` and isend's `dst` are global in torch 2.6+) and bytes.
    A context manager around `dist.batch_isend_irecv`, `dist.isend` and `dist.irecv` (wrapping
    from outside with common/kernel/patch.py's patch_dist, like the comm meter; nestable with it)."""

    def __init__(self) -> None:
        self.groups: dict[tuple[int, ...], list[tuple[PlannedOp, ...]]] = defaultdict(list)
        self._patched = ExitStack()
        self._in_batch = False

    @staticmethod
    def _ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))

    def _wrap_batch(self, fn):
        def recorded(p2p_op_list):
            if p2p_op_list:
                ops = tuple(PlannedOp("send" if getattr(p.op, "__name__", "") == "isend" else "recv",
                                      p.peer, p.tensor.numel() * p.tensor.element_size())
                            for p in p2p_op_list)
                self.groups[self._ranks(p2p_op_list[0].group)].append(ops)
            self._in_batch = True  # gloo's batch calls isend/irecv per op: one group, not many
            try:
                return fn(p2p_op_list)
            finally:
                self._in_batch = False
        return recorded

    def _wrap_single(self, kind: str, fn):
        peer_key = "dst" if kind == "send" else "src"

        def recorded(*args, **kwargs):
            if not self._in_batch:
                named = dict(zip(("tensor", peer_key, "group"), args, strict=False)) | kwargs
                group, peer = named.get("group"), named.get(peer_key)
                if peer is None and named.get(f"group_{peer_key}") is not None:
                    peer = dist.get_global_rank(group or dist.group.WORLD, named[f"group_{peer_key}"])
                tensor = named["tensor"]
                self.groups[self._ranks(group)].append(
                    (PlannedOp(kind, peer, tensor.numel() * tensor.element_size()),))
            return fn(*args, **kwargs)
        recorded.__name__ = fn.__name__
        return recorded

    def __enter__(self) -> P2PRecorder:
        self._patched.enter_context(patch_dist({"batch_isend_irecv": self._wrap_batch}))
        self._patched.enter_context(patch_dist({"isend": partial(self._wrap_single, "send"),  # P2POp
                                                "irecv": partial(self._wrap_single, "recv")},  # checks
                                               also=(c10d,)))  # `op in [c10d.isend, c10d.irecv]`
        return self

    def __exit__(self, *exc) -> None:
        self._patched.close()


def plan_from_records(records: Sequence[dict[tuple[int, ...], list]]) -> dict[tuple[int, ...], Plan]:
    """Merge per-rank recordings (`P2PRecorder.groups` of every rank) into one plan per
    communicator, keyed by its global ranks."""
    plans: dict[tuple[int, ...], Plan] = defaultdict(dict)
    for rank, groups in enumerate(records):
        for ranks, posted in groups.items():
            plans[ranks][rank] = list(posted)
    return dict(plans)
