"""Lab 02's properties: what `make lab-check N=2` runs on your lab.py (common/grader.py runs them).

Rank r's tensor is x_r[i] = (i + 1) · 10^r in float64, so a sum over ranks spells its members in
decimal digits: element i of the full sum on 4 ranks is 1111 · (i + 1), and a chunk that holds
only ranks 1 and 2 shows 0110 · (i + 1). That is how a wrong chunk is named ("holds the data of
ranks [1, 2] only"). Each run uses lengths 12 (2, 3 and 4 divide it), 10 (uneven at 3 and 4) and 3
(uneven at 2, and at 4 one chunk is empty) on 2, 3 and 4 ranks. The truth is torch's sum of the
same tensors (dist.all_reduce for the all-reduce), and the bytes each rank sends are counted from
its batch_isend_irecv calls (common/p2p_plan.P2PRecorder).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from itertools import pairwise

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.data import SyntheticTokens, local_micro_batches, split_inputs_targets
from common.diagnosis import explain, first_difference, uneven_pattern
from common.grader import Property
from common.model import build_model, get_config, loss_fn
from common.p2p_plan import P2PRecorder
from common.patch import patch_dist
from common.reference import make_optimizer, make_reference

TITLE = "ring reduce-scatter, all-gather and all-reduce"
LENGTHS = (12, 10, 3)
WORLDS = [{"world": 2}, {"world": 3}, {"world": 4}]
TOLERANCE = 1e-12  # the data are integers: sums are exact in float64; AVG may differ by an ulp
CFG = get_config("tiny", n_layers=2)
BATCH, SEQ, LR, CAP_MB = 6, 8, 1e-2, 0.01  # 0.01 MiB: several DDP buckets, of uneven lengths
SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG

RS_RULE = ("the chunk index rule: what rank r sends at step s, rank r+1 must receive at step s, and "
           "chunk r's last hop (step s = n-2) must end at rank r; draw the n = 3 ring on paper and "
           "follow chunk 0 from the rank that sends it first")
AG_RULE = ("the all-gather's chunk rule: rank r starts with the complete chunk r, sends it at step 0, "
           "then at step s passes on the chunk it received at step s-1, and stores each arriving "
           "chunk at that chunk's place in the output")


# --- the data and the layout -------------------------------------------------------------------

def data(rank: int, length: int) -> torch.Tensor:
    return (torch.arange(length, dtype=torch.float64) + 1) * 10.0**rank


def bounds(length: int, n: int) -> list[tuple[int, int]]:
    """torch.tensor_split's cut: the layout every rank, and torch, agree on."""
    sizes = [len(t) for t in torch.arange(length).tensor_split(n)]
    return [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(n)]


def total(length: int, n: int) -> torch.Tensor:
    return torch.stack([data(r, length) for r in range(n)]).sum(0)


def members(got: torch.Tensor, start: int, n: int) -> list[int] | None:
    """How many times each rank's data is in `got` (elements start … of a sum of x_r), or None
    when `got` is not such a sum (garbage, a scaled sum, the wrong positions)."""
    if got.numel() == 0:
        return None
    m = got / (torch.arange(start, start + got.numel(), dtype=torch.float64) + 1)
    code = float(m[0])
    if not (torch.isfinite(m).all() and torch.allclose(m, torch.full_like(m, code), rtol=0, atol=1e-6)
            and abs(code - round(code)) < 1e-6 and 0 <= round(code) < 10**n):
        return None
    return [round(code) // 10**k % 10 for k in range(n)]


def who(counts: list[int]) -> str:
    ranks = [k for k, c in enumerate(counts) if c]
    twice = [k for k, c in enumerate(counts) if c > 1]
    return f"the data of ranks {ranks}" + (f", rank {twice[0]}'s {counts[twice[0]]} times" if twice else "")


# --- on every rank -------------------------------------------------------------------------------

def layouts(lab, world: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Your chunk_bounds for a few lengths and world sizes."""
    return {(length, n): [tuple(int(x) for x in b) for b in lab.chunk_bounds(length, n)]
            for length in (10, 12, 3, 13, 1, 0) for n in (1, 2, 3, 4, 5)}


@contextmanager
def calling(name: str, world: int, length: int | None) -> Iterator[P2PRecorder]:
    """Around one call of yours: blocking send/recv refused, the send/recv groups recorded (for the
    bytes), and any error but NotImplementedError re-raised naming the call, world and length."""
    def refused(*args, **kwargs):
        raise RuntimeError("dist.send and dist.recv block until the peer has answered: on NCCL a ring of "
                           "them waits for ever. Post each step's send and receive as P2POps in one "
                           "dist.batch_isend_irecv group")

    try:
        with patch_dist({"send": lambda _: refused, "recv": lambda _: refused}, also=(c10d,)), \
                P2PRecorder() as recorder:
            yield recorder
    except NotImplementedError:
        raise
    except Exception as error:
        where = "" if length is None else f" on {length} elements (chunk sizes " \
            f"{[b - a for a, b in bounds(length, world)]})"
        raise RuntimeError(f"{name}{where} at world {world}, rank {dist.get_rank()}: "
                           f"{type(error).__name__}: {error}") from error


def sent_bytes(recorder: P2PRecorder) -> int:
    ops = [op for groups in recorder.groups.values() for group in groups for op in group]
    return sum(op.nbytes for op in ops if op.kind == "send")


def require_layout(lab, world: int) -> None:
    """Every rank stops at once, with the same message, if chunk_bounds is not tensor_split's cut
    (a layout that differs between sender and receiver would hang the ring)."""
    for length in LENGTHS:
        yours = [tuple(int(x) for x in b) for b in lab.chunk_bounds(length, world)]
        if yours != bounds(length, world):
            raise ValueError(f"chunk_bounds({length}, {world}) = {yours}, but torch.tensor_split cuts "
                             f"{bounds(length, world)}: mend chunk_bounds first (the first property)")


def gathered(rows: list[dict]) -> list[list[dict]]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, rows)
    return out


def posted(lab, world: int, length: int = 10) -> None:
    """The three functions once each; the grader records (not sends) what they post. A function
    you have not written yet is left out (the data properties will say so)."""
    rank, todo = dist.get_rank(), []
    start, stop = bounds(length, world)[rank]
    calls = {"ring_reduce_scatter": lambda: lab.ring_reduce_scatter(data(rank, length)),
             "ring_all_gather": lambda: lab.ring_all_gather(data(rank, length)[start:stop], length),
             "ring_all_reduce": lambda: lab.ring_all_reduce(data(rank, length))}
    for name, call in calls.items():
        try:
            with calling(name, world, length):
                call()
        except NotImplementedError as error:
            todo.append(error)
    if len(todo) == len(calls):
        raise todo[0]


def reduce_scatter_runs(lab, world: int) -> list[list[dict]]:
    rank, rows = dist.get_rank(), []
    require_layout(lab, world)
    for length in LENGTHS:
        x = data(rank, length)
        with calling("ring_reduce_scatter", world, length) as recorder:
            got = lab.ring_reduce_scatter(x)
        rows.append({"length": length, "got": got, "changed": not torch.equal(x, data(rank, length)),
                     "sent": sent_bytes(recorder)})
    return gathered(rows)


def all_gather_runs(lab, world: int) -> list[list[dict]]:
    rank, rows = dist.get_rank(), []
    require_layout(lab, world)
    for length in LENGTHS:
        start, stop = bounds(length, world)[rank]
        with calling("ring_all_gather", world, length) as recorder:
            got = lab.ring_all_gather(data(rank, length)[start:stop].clone(), length)
        rows.append({"length": length, "got": got, "sent": sent_bytes(recorder)})
    return gathered(rows)


def all_reduce_runs(lab, world: int) -> list[list[dict]]:
    rank, rows = dist.get_rank(), []
    require_layout(lab, world)
    for length in LENGTHS:
        for op in ("SUM", "AVG"):
            x, want = data(rank, length), data(rank, length)
            dist.all_reduce(want, op=SUM)
            if op == "AVG":
                want /= world
            with calling(f"ring_all_reduce(op={op})", world, length) as recorder:
                lab.ring_all_reduce(x, SUM if op == "SUM" else AVG)
            rows.append({"op": op, "length": length, "got": x, "want": want, "sent": sent_bytes(recorder)})
    return gathered(rows)


class _Done:
    def wait(self, *_) -> bool:
        return True


def ddp_step(lab, world: int) -> dict:
    """Chapter 01's DistributedDataParallel with your ring_all_reduce as its all_reduce: one
    backward and one SGD step on this rank's slice of the batch."""
    from data_parallel import DistributedDataParallel

    def all_reduce(tensor, op=SUM, group=None, async_op=False):
        lab.ring_all_reduce(tensor, op, group)
        return _Done() if async_op else None

    model = build_model(CFG, seed=0, dtype=torch.float64)
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB, all_reduce=all_reduce)
    opt = make_optimizer(model.parameters(), "sgd", LR)
    tokens = SyntheticTokens(CFG.vocab_size, SEQ, seed=0).global_batch(0, BATCH)
    shard = local_micro_batches(tokens, dist.get_rank(), world, BATCH // world)[0]
    inputs, targets = split_inputs_targets(shard)
    with calling("ring_all_reduce (as DDP's all_reduce)", world, None):
        loss_fn(ddp(inputs), targets).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buckets": [b.buffer.numel() for b in ddp.buckets]}


# --- in the grader's process -------------------------------------------------------------------

def check_layouts(runs) -> tuple[bool, str, str]:
    got = runs[0][1]
    wrong = [(key, got[key]) for key in got if got[key] != bounds(*key)]
    if not wrong:
        return True, f"{len(got)} (length, n) pairs, as torch.tensor_split cuts", ""
    (length, n), yours = wrong[0]
    sizes, want = [b - a for a, b in yours], [b - a for a, b in bounds(length, n)]
    detail = f"chunk_bounds({length}, {n}) = {yours}, expected {bounds(length, n)}"
    if len(yours) != n:
        return False, detail, f"n chunks, always (some empty when length < n): you returned {len(yours)}"
    if any(a != b for (_, a), (b, _) in pairwise(yours)) or yours[0][0] != 0:
        return False, detail, "the chunks tile the tensor: chunk i starts where chunk i-1 stops, from 0"
    if sorted(sizes) == sorted(want):
        return False, detail, "the longer chunks come FIRST: the first length % n (torch.tensor_split's cut)"
    passing = [key for key in got if got[key] == bounds(*key)]
    return False, detail, uneven_pattern([k[::-1] for k, _ in wrong], [k[::-1] for k in passing], length) or \
        "chunk i has length // n elements, plus one when i < length % n"


def as_tensor(got) -> torch.Tensor | None:
    return got.detach().double().cpu().reshape(-1) if isinstance(got, torch.Tensor) else None


def diagnose_chunk(row: dict, n: int, length: int, rank: int) -> tuple[str, str] | None:
    """(what is wrong, hint) when rank `rank`'s reduce-scatter output is not chunk `rank` of the sum."""
    start, stop = bounds(length, n)[rank]
    want, got, where = total(length, n)[start:stop], as_tensor(row["got"]), f"chunk {rank} [{start}:{stop}]"
    if got is None:
        return f"returned {type(row['got']).__name__}, not a tensor", "return this rank's chunk of the sum"
    if got.numel() != want.numel():
        return f"returned {got.numel()} elements, {where} has {want.numel()}", \
            "return chunk r, cut by chunk_bounds"
    if torch.allclose(got, want, rtol=TOLERANCE, atol=0):
        return ("your input tensor changed", "ring_reduce_scatter leaves its input as it was: work on "
                "clones of its chunks") if row["changed"] else None
    for j, (a, b) in enumerate(bounds(length, n)):
        if j != rank and b - a == got.numel() and torch.equal(got, total(length, n)[a:b]):
            return f"returned chunk {j} of the sum, expected {where}", \
                f"the complete chunk lands at the wrong rank (rank {rank} has chunk {j}): {RS_RULE}"
    counts = members(got, start, n)
    if counts is None:
        finding = first_difference({where: got}, {where: want}, TOLERANCE)
        return f"{where}: {finding}", explain(finding, n, "results")
    detail = f"{where} holds {who(counts)}, expected every rank's once"
    if max(counts) > 1:
        return detail, "a partial was added twice: add each arriving chunk once, into a copy no receive " \
            "writes"
    if counts == [int(k == rank) for k in range(n)]:
        return detail, f"chunk {rank} never arrived at rank {rank} (or you returned your input's): {RS_RULE}"
    if counts == [int(k == (rank + 1) % n) for k in range(n)]:
        return detail, ("each arriving partial replaced your copy instead of being added to it: receive "
                        "into a fresh buffer (torch.empty_like), then add it to your chunk")
    if n > 2 and counts == [int(k in (rank, (rank - 1) % n)) for k in range(n)]:
        return detail, ("every step sent your own data: from step 1 on, send the partial you added at "
                        "the step before (the chunk that just arrived, plus yours)")
    return detail, f"a chunk must visit every rank once, n-1 hops, adding at each: {RS_RULE}"


def diagnose_gather(row: dict, n: int, length: int, rank: int) -> tuple[str, str] | None:
    """(what is wrong, hint) when rank `rank`'s all-gather output is not every rank's chunk in place."""
    want = torch.cat([data(j, length)[a:b] for j, (a, b) in enumerate(bounds(length, n))])
    got = as_tensor(row["got"])
    if got is None:
        return f"returned {type(row['got']).__name__}, not a tensor", "return the gathered tensor"
    if got.numel() != length:
        return f"returned {got.numel()} elements, expected {length}", "the output has `length` elements"
    for j, (a, b) in enumerate(bounds(length, n)):
        if torch.equal(got[a:b], want[a:b]):
            continue
        where, counts = f"chunk {j} [{a}:{b}]", members(got[a:b], a, n)
        if counts is not None and sum(counts) == 0:
            return f"{where} is all zeros, never received", f"n-1 receives, each into its place: {AG_RULE}"
        if counts is not None and sum(counts) == 1:
            return f"{where} holds rank {counts.index(1)}'s chunk {j}, expected rank {j}'s", \
                f"another rank's data at chunk {j}'s place: {AG_RULE}"
        if counts is not None:
            return f"{where} holds {who(counts)} added up", \
                "the all-gather stores each arriving chunk (its receive lands in place); it adds nothing"
        detail = f"{where} holds no rank's chunk ({float(got[a]):.3g} where rank {j}'s has " \
                 f"{float(want[a]):g})"
        if j == rank:
            return detail, f"your own chunk {j} was overwritten by a receive: {AG_RULE}"
        return detail, f"never received, or passed on by a rank that did not have it yet: {AG_RULE}"
    return None


def diagnose_all_reduce(row: dict, n: int, length: int, rank: int) -> tuple[str, str] | None:
    """(what is wrong, hint) when rank `rank`'s tensor is not what dist.all_reduce gives."""
    got, want = as_tensor(row["got"]), row["want"]
    if torch.allclose(got, want, rtol=TOLERANCE, atol=0):
        return None
    if torch.equal(got, data(rank, length)):
        return "the tensor is unchanged", \
            "ring_all_reduce works in place, like dist.all_reduce: copy the result into `tensor`"
    i = int(((got - want).abs() > TOLERANCE * want.abs()).nonzero()[0])
    chunk = next(j for j, (a, b) in enumerate(bounds(length, n)) if a <= i < b)
    counts = members(got[i:i + 1], i, n) if row["op"] == "SUM" else None
    finding = first_difference({"tensor": got}, {"tensor": want}, TOLERANCE)
    return f"element {i} (chunk {chunk}) is {float(got[i]):g}{f' ({who(counts)})' if counts else ''}, " \
           f"dist.all_reduce gives {float(want[i]):g}; {finding}", explain(finding, n, "results")


def ring_bytes(phase: str, n: int, length: int, rank: int) -> list[int]:
    """What rank `rank` sends, in bytes of float64: every chunk but its own in the reduce-scatter,
    every chunk but its right (or, in a ring turning the other way, left) neighbour's in the
    all-gather; ≈ (n-1)/n · S each."""
    sizes = [b - a for a, b in bounds(length, n)]
    rs, ag = length - sizes[rank], [length - sizes[(rank + 1) % n], length - sizes[(rank - 1) % n]]
    elements = {"reduce_scatter": [rs], "all_gather": ag, "all_reduce": [rs + x for x in ag]}[phase]
    return [8 * e for e in elements]


def check_cases(runs, diagnose, phase: str, summary: str) -> tuple[bool, str, str]:
    """Every rank of every case (world, length[, op]) right, then every rank's bytes as the ring's."""
    failing, passing, first = [], [], None
    for config, per_rank in runs:
        n = config["world"]
        for case, row in enumerate(per_rank[0]):
            label = f"world {n}, length {row['length']}" + (f", op {row['op']}" if "op" in row else "")
            diagnoses = ((r, diagnose(per_rank[r][case], n, row["length"], r)) for r in range(n))
            found = next(((r, d) for r, d in diagnoses if d is not None), None)
            (failing if found else passing).append((n, row["length"]))
            if found and first is None:
                first = (label, row["length"], *found)
    if first is not None:
        label, length, rank, (detail, hint) = first
        return False, f"{label}, rank {rank}: {detail}", uneven_pattern(failing, passing, length) or hint
    for config, per_rank in runs:
        n = config["world"]
        for rank, rows in enumerate(per_rank):
            for row in rows:
                want = ring_bytes(phase, n, row["length"], rank)
                if row["sent"] not in want:
                    return False, f"world {n}, length {row['length']}, rank {rank}: sent {row['sent']} B, " \
                                  f"the ring sends {want[0]} B", bytes_hint(row["sent"], phase)
    return True, summary, ""


def bytes_hint(sent: int, phase: str) -> str:
    if sent == 0:
        return ("no bytes went through dist.batch_isend_irecv: build the ring from P2POps and "
                "dist.batch_isend_irecv (the grader counts what they send), not from torch's collectives")
    return (f"the ring ({phase.replace('_', '-')}) sends one chunk per step, n-1 steps per phase: every "
            "chunk but one, once per phase. More means whole tensors, or a chunk sent twice")


def check_ddp(runs) -> tuple[bool, str, str]:
    (config, got), = runs
    world = config["world"]
    trainer = make_reference(CFG, 0, torch.float64, "sgd", LR)
    want = trainer.step(SyntheticTokens(CFG.vocab_size, SEQ, seed=0).global_batch(0, BATCH))[1]
    if finding := first_difference(got["grads"], want, 1e-10):
        return False, f"world {world}, rank 0: grad of {finding}", explain(finding, world)
    if finding := first_difference(got["params"], trainer.parameters(), 1e-10):
        return False, f"world {world}: parameter {finding} after the step", \
            "the gradients were right: is every rank's tensor left with the same values?"
    sizes = got["buckets"]
    return True, f"every gradient and parameter within 1e-10 at world {world}, {len(sizes)} buckets " \
                 f"of {min(sizes)} … {max(sizes)} elements", ""


PROPERTIES = [
    Property("chunk_bounds: torch.tensor_split's cut, any length", [{"world": 1}], layouts, check_layouts),
    Property("NCCL order: your sends and receives replay without deadlock", [
        {"world": 2}, {"world": 3}, {"world": 4}], posted, plan=True),
    Property("reduce-scatter: rank r gets chunk r of the sum", WORLDS, reduce_scatter_runs, partial(
        check_cases, diagnose=diagnose_chunk, phase="reduce_scatter", summary=f"exact at world [2, 3, 4], "
        f"lengths {list(LENGTHS)}; rank r sent (L - c_r) · 8 B: (n-1)/n·S when n divides L")),
    Property("all-gather: every rank gets every rank's chunk", WORLDS, all_gather_runs, partial(
        check_cases, diagnose=diagnose_gather, phase="all_gather", summary=f"exact at world [2, 3, 4], "
        f"lengths {list(LENGTHS)}; rank r sent (L - c_(r+1)) · 8 B: (n-1)/n·S when n divides L")),
    Property("all-reduce = reduce-scatter + all-gather = dist.all_reduce, 2(n-1)/n·S B", WORLDS,
             all_reduce_runs, partial(check_cases, diagnose=diagnose_all_reduce, phase="all_reduce",
                                      summary="= dist.all_reduce at world [2, 3, 4], SUM and AVG; sent "
                                      "2(n-1)/n·S = 144 B per rank for S = 96 B, n = 4")),
    Property("DDP on your ring: one SGD step equals one device (3 ranks)", [{"world": 3}], ddp_step,
             check_ddp),
]
