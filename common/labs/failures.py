"""How the grader reports a job that did not answer: a rank that raised, died or hung, and a
send/recv plan that would hang on NCCL.

Each rank of a graded job appends every collective and send/recv it posts to `rank<r>` in the
job's trace folder before posting it, and a rank that raises writes `error<r>` (what raised,
where: common/labs/rank.raised) before ending its process. From those files: the first cause
among the ranks that raised (a gloo abort is a consequence: another rank stopped first), the
first collective the ranks posted differently, and each rank's last posted call (what a hung rank
waits in). `replay` runs every communicator's recorded plan under NCCL's rules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from common.kernel.p2p_plan import find_deadlock, plan_from_records
from common.labs.diagnosis import explain_error
from common.rank_pool import RankError

MISMATCH = ("the ranks posted different collectives (a rank waits in one its peers never post, or "
            "they disagree on its size): every rank must post the same collectives, same sizes, same order")
GLOO_ABORT = ("doesn't match expected size", "Connection reset by peer", "Connection closed by peer")
DIED = ("a process that ends without a Python exception: os._exit, or an abort or segfault inside a "
        "torch op or gloo; the lines above show how far each rank got")
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


def _traces(trace_dir: str, world: int) -> list[list[str]]:
    """Per rank, every collective and send/recv it posted, in order."""
    paths = [Path(trace_dir) / f"rank{rank}" for rank in range(world)]
    return [path.read_text().splitlines() if path.exists() else [] for path in paths]


def _last_ops(trace_dir: str, world: int, ranks: Sequence[int] | None = None) -> list[str]:
    """Per rank, the last collective or send/recv it posted (what a hung rank waits in)."""
    traces = _traces(trace_dir, world)
    ranks = range(world) if ranks is None else ranks
    return [f"rank {r}: last posted {traces[r][-1]} ({len(traces[r])} calls in all)" if traces[r]
            else f"rank {r}: posted no collective or send/recv" for r in ranks]


def _communicator(line: str, world: int) -> tuple[int, ...] | None:
    """The global ranks a traced collective runs on: the group it names ("group of 2 [2, 3]"),
    else the world; None for sends, receives and all_to_all_single (their sizes differ by design)."""
    if line.split("(")[0] in (*P2P, "all_to_all_single"):
        return None
    named = re.search(r"group of \d+ \[([\d, ]+)\]", line)
    return tuple(int(r) for r in named[1].split(", ")) if named else tuple(range(world))


def _diverging(traces: list[list[str]], world: int) -> str | None:
    """The first collective that the ranks of one group (the world first, then each subgroup)
    posted differently (another op or size), or None when on every group each rank's collectives
    are a prefix of the others'."""
    groups = {key for lines in traces for line in lines if (key := _communicator(line, world))}
    for group in sorted(groups, key=lambda g: (len(g) != world, g)):
        ops = {r: [line for line in traces[r] if _communicator(line, world) == group]
               for r in group if r < len(traces)}
        for k in range(max(map(len, ops.values()), default=0)):
            posted = {rank: mine[k] for rank, mine in ops.items() if k < len(mine)}
            if len(set(posted.values())) > 1:
                on = "" if len(group) == world else f" on the group of ranks {list(group)}"
                return f"collective {k + 1}{on} differs: " + ", ".join(f"rank {r} posted {op}"
                                                                       for r, op in posted.items())
    return None


def _hang_notes(trace_dir: str, world: int) -> list[str]:
    diverging = _diverging(_traces(trace_dir, world), world)
    return [diverging] * (diverging is not None) + _last_ops(trace_dir, world)


def _raised(trace_dir: str, world: int) -> dict[int, dict]:
    """rank → what it raised (common/labs/rank.raised), for the ranks that wrote one."""
    paths = {rank: Path(trace_dir) / f"error{rank}" for rank in range(world)}
    return {rank: json.loads(path.read_text()) for rank, path in paths.items() if path.exists()}


def unformed(trace_dir: str, world: int) -> bool:
    """Whether the job failed while gloo was still forming a process group (every error a failed
    rendezvous, before any collective): the machine's doing, not the lab's."""
    errors = _raised(trace_dir, world)
    return bool(errors) and all("connectFullMesh" in e["message"] for e in errors.values()) and \
        not any(_traces(trace_dir, world))


def _raised_verdict(errors: dict[int, dict], trace_dir: str, world: int, label: str, extra_hints) -> tuple:
    """(status, detail, hint, notes) for the ranks that raised: the first cause, not a gloo abort."""
    rank = min(errors, key=lambda r: (any(w in errors[r]["message"] for w in GLOO_ABORT), r))
    e = errors[rank]
    if e["type"] == "NotImplementedError":
        return "todo", f"not implemented: {e['message'] or '(no message)'}", "", []
    where = ", ".join(x for x in (f"step {e['step']}" if e.get("step") else "", e.get("phase") or "") if x)
    inside = (f" in your {e['lab_frame']}" if e.get("lab_frame") else
              f" in the grader's {e['frame']}, reading what your code returned" if e.get("frame") else "")
    at = f"{where}, " if where else ""
    detail = f"{at}{label}, rank {rank} raised {e['type']}: {e['message']}{inside}"
    text = f"{e['type']}: {e['message']}"
    hint = next((h for words, h in extra_hints if any(w in text for w in words)), "") or explain_error(text)
    others = [r for r in range(world) if r not in errors]
    waiting = [f"ranks {sorted(errors)} raised; the others were then waiting:",
               *_last_ops(trace_dir, world, others)]
    notes = waiting if others else [f"every rank raised ({world})"] if len(errors) > 1 else []
    return "raised", detail, hint, notes


def crash(error: Exception, trace_dir: str, world: int, label: str, extra_hints) -> tuple:
    """(status, detail, hint, notes) of a job that did not answer: collectives the ranks posted
    differently (a hang: whatever raised after is a consequence), a rank that raised (the first
    cause: a gloo abort is what its peers see when a rank stops), a rank that ended without an
    exception (died), or no answer at all (a hang)."""
    errors, traces = _raised(trace_dir, world), _traces(trace_dir, world)
    dead = re.search(r"rank (\d+) of \d+ died", str(error))
    if _diverging(traces, world) is not None:
        raised = [f"rank {r} then raised {e['type']}: {e['message'][:120]}"
                  for r, e in sorted(errors.items())]
        notes = [*_hang_notes(trace_dir, world), *raised]
        return "hang", f"mismatched collectives at {label}", MISMATCH, notes
    if causes := {r: e for r, e in errors.items() if not any(w in e["message"] for w in GLOO_ABORT)}:
        return _raised_verdict(causes, trace_dir, world, label, extra_hints)
    if isinstance(error, RankError):  # not from the lab's code: a result that could not travel back
        rank = min(error.errors)
        return "raised", f"{label}, rank {rank}: {error.errors[rank]}", \
            "what a rank returns must pickle (tensors, numbers, lists, dicts)", []
    if dead is None:
        return "hang", f"no answer within the deadline at {label}", MISMATCH, \
            _hang_notes(trace_dir, world)
    if not (silent := set(range(world)) - set(errors)):  # every rank stopped on a gloo abort: none died
        return _raised_verdict(errors, trace_dir, world, label, extra_hints)
    first = min(silent)  # no error of its own: it stopped first, the others saw it stop
    p2p = any(line.split("(")[0] in P2P for lines in traces for line in lines)
    hint = DIED + ("; with send/recv: gloo aborts a process whose receive gets a message of another "
                   "size (sender and receiver must agree on every message's size)" if p2p else "")
    return "died", f"rank {first} died at {label} (a crash in native code or os._exit)", hint, \
        _last_ops(trace_dir, world)


def replay(records: list[dict], world: int) -> tuple[str, str, str, list[str]] | None:
    """Every communicator's recorded plan replayed under NCCL's rules: None, or the deadlock."""
    for ranks, plan in plan_from_records(records).items():
        if (deadlock := find_deadlock(plan)) is None:
            continue
        note = [f"on the communicator of ranks {list(ranks)}, {deadlock}"]
        if "unmatched plan" in str(deadlock):
            return "deadlock", f"at world {world}: sends and receives do not pair up", \
                ("the k-th send from a to b meets b's k-th receive from a, and both must have the same "
                 "size: sender and receiver disagree on what moves (which chunk, which peer, how many "
                 "messages)"), note
        return "deadlock", f"at world {world}: would hang on NCCL", \
            ("a send completes only when its receive runs in the peer's current group: post each send in "
             "one batch_isend_irecv with the receive it waits for, in the same order on both ranks"), note
    return None


