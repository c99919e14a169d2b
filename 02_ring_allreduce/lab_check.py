"""Lab 02's properties: what `make lab-check N=2` runs on your lab.py (common/labs/grader.py runs them).

Rank r of a group holds x_r[i] = (i + 1) · 10^r in float64, so a sum over ranks spells its
members in decimal digits: element i of the full sum on 4 ranks is 1111 · (i + 1), and a chunk
that holds only ranks 1 and 2 shows 0110 · (i + 1) ("holds the data of ranks [1, 2] only"). Each
run uses lengths 12 (2, 3 and 4 divide it), 10 (uneven at 3 and 4) and 3 (uneven at 2; at 4 one
chunk is empty) on 2, 3 and 4 ranks, and on a world of 4 cut into groups of 1 and 3 (your
`group=`: ranks 1–3 form a ring of 3, rank 0 a ring of 1). The truth is torch's sum of the same
tensors, and the bytes each rank sends are counted from its batch_isend_irecv calls
(common/kernel/p2p_plan.P2PRecorder): what the ring is for is (n-1)/n·S bytes per phase, whatever n.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import pairwise

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.kernel.model import build_model, get_config, loss_fn
from common.kernel.p2p_plan import P2PRecorder
from common.kernel.patch import patch_dist
from common.labs.diagnosis import amount_hint, explain, first_difference, uneven_pattern
from common.labs.grader import Fail, Property
from common.labs.rank import at
from common.labs.tools import group_of, local_rows, one_device, split, where
from common.reference import make_optimizer
from ring_allreduce.lab_hints import bounds, data, diagnose_all_reduce, diagnose_chunk, diagnose_gather

TITLE = "ring reduce-scatter, all-gather and all-reduce"
LENGTHS = (12, 10, 3)
WORLDS = [{"world": 2}, {"world": 3}, {"world": 4}, {"world": 4, "groups": [1, 3]}]
CFG = get_config("tiny", n_layers=2)
BATCH, SEQ, LR, CAP_MB = 6, 8, 1e-2, 0.01  # 0.01 MiB: several DDP buckets, of uneven lengths
SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
BLOCKING = ("dist.send and dist.recv block until the peer has answered: on NCCL a ring of them waits for "
            "ever. Post each step's send and receive as P2POps in one dist.batch_isend_irecv group")
ERROR_HINTS = [(("dist.send and dist.recv block",), BLOCKING.split(": ", 1)[1])]


# --- on every rank -------------------------------------------------------------------------------

def layouts(lab, world: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Your chunk_bounds for a few lengths and world sizes."""
    return {(length, n): [tuple(int(x) for x in b) for b in lab.chunk_bounds(length, n)]
            for length in (10, 12, 3, 13, 1, 0) for n in (1, 2, 3, 4, 5)}


@contextmanager
def calling(name: str, length: int | None = None):
    """Around one call of yours: marked (where an exception is reported), blocking send/recv
    refused, the send/recv groups recorded (for the bytes)."""
    def refused(*args, **kwargs):
        raise RuntimeError(BLOCKING)

    at(phase=name + (f" on {length} elements" if length is not None else ""))
    with patch_dist({"send": lambda _: refused, "recv": lambda _: refused}, also=(c10d,)), \
            P2PRecorder() as recorder:
        yield recorder


def sent_bytes(recorder: P2PRecorder) -> int:
    return sum(op.nbytes for groups in recorder.groups.values() for group in groups for op in group
               if op.kind == "send")


def require_layout(lab, n: int) -> None:
    """Every rank stops at once, with the same message, if chunk_bounds is not tensor_split's cut
    (a layout that differs between sender and receiver would hang the ring)."""
    for length in LENGTHS:
        yours = [tuple(int(x) for x in b) for b in lab.chunk_bounds(length, n)]
        if yours != bounds(length, n):
            raise ValueError(f"chunk_bounds({length}, {n}) = {yours}, but torch.tensor_split cuts "
                             f"{bounds(length, n)}: mend chunk_bounds first (the first property)")


def posted(lab, world: int, groups: list[int] | None = None, length: int = 10) -> None:
    """The three functions once each; the grader records (not sends) what they post. A function
    you have not written yet is left out (the data properties will say so)."""
    g, todo = split(groups), []
    start, stop = bounds(length, g.size)[g.rank]
    x = data(g.rank, length)
    calls = {"ring_reduce_scatter": lambda: lab.ring_reduce_scatter(x.clone(), g.group),
             "ring_all_gather": lambda: lab.ring_all_gather(x[start:stop].clone(), length, g.group),
             "ring_all_reduce": lambda: lab.ring_all_reduce(x.clone(), SUM, g.group)}
    for name, call in calls.items():
        try:
            with calling(name, length):
                call()
        except NotImplementedError as error:
            todo.append(error)
    if len(todo) == len(calls):
        raise todo[0]


def ring_runs(lab, world: int, phase: str, groups: list[int] | None = None) -> list[dict]:
    """This rank's result and bytes sent for each length (and op), on its group."""
    g, rows = split(groups), []
    require_layout(lab, g.size)
    for length in LENGTHS:
        start, stop = bounds(length, g.size)[g.rank]
        for op in ("SUM", "AVG") if phase == "all_reduce" else (None,):
            x = data(g.rank, length)
            with calling(f"ring_{phase}" + (f"(op={op})" if op else ""), length) as recorder:
                if phase == "reduce_scatter":
                    got = lab.ring_reduce_scatter(x, g.group)
                elif phase == "all_gather":
                    got = lab.ring_all_gather(x[start:stop].clone(), length, g.group)
                else:
                    lab.ring_all_reduce(x, SUM if op == "SUM" else AVG, g.group)
                    got = x
            rows.append({"length": length, "op": op, "got": got, "sent": sent_bytes(recorder),
                         "changed": phase == "reduce_scatter" and not torch.equal(x, data(g.rank, length))})
    return rows


def ddp_step(lab, world: int) -> dict:
    """Chapter 01's DistributedDataParallel with your ring_all_reduce as its all_reduce: one
    backward and one SGD step on this rank's slice of the batch."""
    from data_parallel import DistributedDataParallel

    class Done:
        def wait(self, *_) -> bool:
            return True

    def all_reduce(tensor, op=SUM, group=None, async_op=False):
        with calling("ring_all_reduce (as DDP's all_reduce)"):
            lab.ring_all_reduce(tensor, op, group)
        return Done() if async_op else None

    model = build_model(CFG, seed=0, dtype=torch.float64)
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB, all_reduce=all_reduce)
    opt = make_optimizer(model.parameters(), "sgd", LR)
    ((inputs, targets),) = local_rows(0, dist.get_rank(), world, BATCH, CFG, SEQ)
    loss_fn(ddp(inputs), targets).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return {"grads": grads, "buckets": [b.buffer.numel() for b in ddp.buckets]}


# --- in the grader's process ---------------------------------------------------------------------

def check_layouts(runs) -> Fail | str:
    """chunk_bounds(L, n) for L in 0, 1, 3, 10, 12, 13 and n = 1 … 5 is torch.tensor_split's cut."""
    got = runs[0].ranks[0]
    wrong = [(key, got[key]) for key in got if got[key] != bounds(*key)]
    if not wrong:
        return f"{len(got)} (length, n) pairs, as torch.tensor_split cuts"
    (length, n), yours = wrong[0]
    sizes, want = [b - a for a, b in yours], [b - a for a, b in bounds(length, n)]
    detail = f"chunk_bounds({length}, {n}) = {yours}, expected {bounds(length, n)}"
    if len(yours) != n:
        return Fail(detail, f"n chunks, always (some empty when length < n): you returned {len(yours)}")
    if any(a != b for (_, a), (b, _) in pairwise(yours)) or yours[0][0] != 0:
        return Fail(detail, "the chunks tile the tensor: chunk i starts where chunk i-1 stops, from 0")
    if sorted(sizes) == sorted(want):
        return Fail(detail, "the longer chunks come FIRST: the first length % n (torch.tensor_split's cut)")
    passing = [key for key in got if got[key] == bounds(*key)]
    return Fail(detail, uneven_pattern([k[::-1] for k, _ in wrong], [k[::-1] for k in passing], length)
                or "chunk i has length // n elements, plus one when i < length % n")


def _check_cases(runs, diagnose) -> Fail | None:
    """Every rank of every case (config, length[, op]): the first rank whose result is wrong."""
    failing, passing, first = [], [], None
    for run in runs:
        sizes = run.config.get("groups") or [run.world]
        for case, row in enumerate(run.ranks[0]):
            found = None
            for rank, rows in enumerate(run.ranks):
                r, n, _ = group_of(sizes, rank)
                if (bad := diagnose(rows[case], n, row["length"], r, run.world)) is not None:
                    found = (rank, n, bad)
                    break
            (failing if found else passing).append(((found or (0, run.world))[1], row["length"]))
            if found and first is None:
                op = f", op {row['op']}" if row["op"] else ""
                label = f"length {row['length']}{op}, {where(run.config, found[0])}"
                first = (label, row["length"], found[2])
    if first is None:
        return None
    label, length, (detail, hint) = first
    return Fail(f"{label}: {detail}", uneven_pattern(failing, passing, length) or hint)


def check_reduce_scatter(runs) -> Fail | str:
    """Rank r (of its group) gets chunk r of the sum over the group's tensors, which stay unchanged."""
    return _check_cases(runs, diagnose_chunk) or "exact at world [2, 3, 4] and in groups [1, 3]"


def check_all_gather(runs) -> Fail | str:
    """Every rank gets every rank's chunk, in its place."""
    return _check_cases(runs, diagnose_gather) or "exact at world [2, 3, 4] and in groups [1, 3]"


def check_all_reduce(runs) -> Fail | str:
    """ring_all_reduce(tensor, SUM or AVG, group) leaves what dist.all_reduce gives, in place."""
    return _check_cases(runs, diagnose_all_reduce) or "= dist.all_reduce, SUM and AVG"


def ring_bytes(phase: str, n: int, length: int, rank: int) -> list[int]:
    """What rank `rank` sends, in bytes of float64: every chunk but its own in the reduce-scatter,
    every chunk but its right (or, in a ring turning the other way, left) neighbour's in the
    all-gather; ≈ (n-1)/n · S each."""
    sizes = [b - a for a, b in bounds(length, n)]
    rs, ag = length - sizes[rank], [length - sizes[(rank + 1) % n], length - sizes[(rank - 1) % n]]
    elements = {"reduce_scatter": [rs], "all_gather": ag, "all_reduce": [rs + x for x in ag]}[phase]
    return [8 * e for e in elements]


def check_ring_bytes(runs) -> Fail | str:
    """What the ring is for: each rank sends every chunk but one per phase, (n-1)/n·S bytes when n
    divides L, counted from its batch_isend_irecv calls."""
    phase = next(p for p in ("reduce_scatter", "all_gather", "all_reduce")
                 if runs[0].config.get("phase", "all_reduce") == p)
    for run in runs:
        sizes = run.config.get("groups") or [run.world]
        for rank, rows in enumerate(run.ranks):
            r, n, _ = group_of(sizes, rank)
            for row in rows:
                if row["sent"] in (want := ring_bytes(phase, n, row["length"], r)):
                    continue
                detail = (f"length {row['length']}, {where(run.config, rank)}: sent {row['sent']} B, "
                          f"the ring sends {want[0]} B")
                if row["sent"] == 0:
                    return Fail(detail, "no bytes went through dist.batch_isend_irecv: build the ring from "
                                        "P2POps and dist.batch_isend_irecv, not from torch's collectives")
                amount = amount_hint(row["sent"], want[0], "bytes sent")
                return Fail(detail, (amount + ". " if amount else "") +
                            f"the ring ({phase.replace('_', '-')}) sends one chunk per step, n-1 "
                                    "steps per phase: every chunk but one, once per phase. More means "
                                    "whole tensors, or a chunk sent twice")
    return f"rank r sent (n-1)/n·S per phase: {ring_bytes(phase, 4, 12, 0)[0]} B of S = 96 B at n = 4"


def check_ddp(runs) -> Fail | str:
    """Chapter 01's DDP with your ring_all_reduce as its all_reduce: one SGD step's gradients on
    every rank equal one device's (1e-10)."""
    run = runs[0]
    want = one_device(CFG, 1, BATCH, SEQ, "sgd", LR).grads[0]
    for rank, got in enumerate(run.ranks):
        if finding := first_difference(got["grads"], want):
            return Fail(f"{where(run.config, rank)}: grad of {finding}", explain(finding, run.world))
    sizes = run.ranks[0]["buckets"]
    return f"every rank's gradients within 1e-10 at world {run.world}, {len(sizes)} buckets of " \
           f"{min(sizes)} … {max(sizes)} elements"


def _phase(configs: list[dict], phase: str) -> list[dict]:
    return [{**c, "phase": phase} for c in configs]


PROPERTIES = [
    Property("chunk_bounds: torch.tensor_split's cut, any length", [{"world": 1}], layouts, [check_layouts]),
    Property("NCCL order: your sends and receives replay without deadlock",
             [{"world": 2}, {"world": 3}, {"world": 4}, {"world": 4, "groups": [1, 3]}], posted, plan=True),
    Property("reduce-scatter: rank r gets chunk r of the sum", _phase(WORLDS, "reduce_scatter"), ring_runs,
             [check_reduce_scatter, check_ring_bytes]),
    Property("all-gather: every rank gets every rank's chunk", _phase(WORLDS, "all_gather"), ring_runs,
             [check_all_gather, check_ring_bytes]),
    Property("all-reduce = reduce-scatter + all-gather = dist.all_reduce, 2(n-1)/n·S B",
             _phase(WORLDS, "all_reduce"), ring_runs, [check_all_reduce, check_ring_bytes]),
    Property("DDP on your ring: one SGD step equals one device (3 ranks)", [{"world": 3}], ddp_step,
             [check_ddp]),
]
