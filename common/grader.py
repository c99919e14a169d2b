"""The labs' grader: a chapter's equivalence properties run on the student's lab file, one verdict each.

    make lab-check N=1              # grade 01_data_parallel/lab.py (the file you edit)
    make lab-check N=1 SOLUTION=1   # grade the reference, lab_solution.py: the grader is fair
    python -m common.grader 1 --file my_ddp.py

Each chapter's `lab_check.py` lists its PROPERTIES. A property runs a function on every rank of a
fresh gloo job (forked, ~0.1 s) with the student's module loaded from its file, then checks what
rank 0 brought back against one device, in the grader's process:

    ✓ name                                   the deciding figure
    ✗ name                                   where it differs (step, rank, tensor, by how much, world)
        hint: what that symptom usually means
    ⏱ name                                   no answer within the deadline
        rank r: the last collective or send/recv it posted
    ✗ name                                   rank r died: its process ended without an exception
        rank r: the last collective or send/recv it posted
    · (optional) name                        an extra part not written yet: reported, never failing

No run hangs: every job has a deadline, and each rank writes every collective and send/recv it
posts to a trace file first, so a hang is reported per rank. Labs with point-to-point code run the
student's sends and receives once without moving data (`record_p2p_plan`) and replay them under
NCCL's rules (common/p2p_plan.find_deadlock) before any real run: an order that gloo would run
but NCCL would hang on is reported as a deadlock, not discovered on a GPU. A `NotImplementedError`
stops the grading at once, naming what is left to write.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from common.lab_rank import _on_rank
from common.p2p_plan import find_deadlock, plan_from_records
from common.rank_pool import RankError, RankPool, RankTimeoutError

PACKAGES = {1: "data_parallel", 2: "ring_allreduce", 3: "zero", 4: "fsdp", 5: "tensor_parallel",
            6: "pipeline", 7: "parallel3d"}
TIMEOUT_S = float(os.environ.get("PFS_LAB_TIMEOUT", 20))
CLOSE_GRACE_S = 0.2  # a graded job's ranks are not reused: killed if still tearing down (~1 s each)
MISMATCH = ("the ranks posted different collectives (a rank waits in one its peers never post, or "
            "they disagree on its size): every rank must post the same collectives, same sizes, same order")
GLOO_MISMATCH = ("doesn't match expected size", "Connection reset by peer", "Connection closed by peer")
DIED = ("a process that ends without a Python exception: os._exit, or an abort or segfault inside a "
        "torch op or gloo; the lines above show how far each rank got")
P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


# --- a property and its verdict ---------------------------------------------------------------

@dataclass(frozen=True)
class Property:
    """`run(lab, **config)` runs on every rank of a job of `config["world"]` ranks; `check(runs)`
    gets [(config, rank 0's result)] and returns (passed, detail, hint). A `plan` property runs
    `run` under `record_p2p_plan` instead (no data moves) and passes when the sends and receives
    every rank posted replay to the end under NCCL's rules; list it before the real runs. There
    `run` may return what it posted, [[(kind, global peer, label), ...] per group], to name each
    op in a deadlock report. An `optional` property (an extra part of the lab) is reported, but
    left unwritten (its NotImplementedError) it neither fails the lab nor stops the grading; list
    it last."""

    name: str
    configs: Sequence[dict[str, Any]]
    run: Callable[..., Any]
    check: Callable[[list[tuple[dict, Any]]], tuple[bool, str, str]] | None = None
    timeout_s: float = TIMEOUT_S
    plan: bool = False
    optional: bool = False


@dataclass
class Verdict:
    name: str
    status: str  # "pass", "fail", "hang", "deadlock", "todo" (NotImplementedError), "skipped"
    detail: str = ""
    hint: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # printed under the verdict (per rank, a plan)
    optional: bool = False

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def failed(self) -> bool:
        """Fails the lab: anything but a pass, except an optional part left unwritten or not run."""
        return not self.passed and not (self.optional and self.status in ("todo", "skipped"))

    def lines(self) -> list[str]:
        mark = {"pass": "✓", "fail": "✗", "hang": "⏱", "deadlock": "✗", "todo": "✗", "skipped": "·"}
        name = f"(optional) {self.name}" if self.optional else self.name
        mark = {**mark, "todo": "·"} if self.optional else mark
        out = [f"{mark[self.status]} {name:<58} {self.detail}".rstrip()]
        out += [f"    {line}" for note in self.notes for line in note.splitlines()]
        if self.hint:
            out.append(f"    hint: {self.hint}")
        return out


# --- the grader's side -------------------------------------------------------------------------

def _last_ops(trace_dir: str, world: int) -> list[str]:
    """Per rank, the last collective or send/recv it posted (what a hung rank waits in)."""
    out = []
    for rank in range(world):
        path = Path(trace_dir) / f"rank{rank}"
        lines = path.read_text().splitlines() if path.exists() else []
        out.append(f"rank {rank}: last posted {lines[-1]} ({len(lines)} calls in all)" if lines
                   else f"rank {rank}: posted no collective or send/recv")
    return out


def _traces(trace_dir: str, world: int) -> list[list[str]]:
    """Per rank, every collective and send/recv it posted, in order."""
    paths = [Path(trace_dir) / f"rank{rank}" for rank in range(world)]
    return [path.read_text().splitlines() if path.exists() else [] for path in paths]


def _diverging(traces: list[list[str]], world: int) -> str | None:
    """The first collective on the whole group that the ranks posted differently (another op or
    size), or None when each rank's collectives are a prefix of the others' (a rank that stopped
    early). Sends and receives, all_to_all_single (its splits may differ) and collectives on
    subgroups differ by design: not compared."""
    def whole(line: str) -> bool:
        return line.split("(")[0] not in (*P2P, "all_to_all_single") and all(
            int(n) == world for n in re.findall(r"group of (\d+)", line))

    ops = [[line for line in lines if whole(line)] for lines in traces]
    for k in range(max(map(len, ops), default=0)):
        posted = {rank: mine[k] for rank, mine in enumerate(ops) if k < len(mine)}
        if len(set(posted.values())) > 1:
            return f"collective {k + 1} differs: " + ", ".join(f"rank {r} posted {op}"
                                                                for r, op in posted.items())
    return None


def _hang_notes(trace_dir: str, world: int) -> list[str]:
    """Under a hang: the first collective the ranks posted differently, if any, then each rank's last."""
    diverging = _diverging(_traces(trace_dir, world), world)
    return [diverging] * (diverging is not None) + _last_ops(trace_dir, world)


def _died(error: RankTimeoutError, trace_dir: str, world: int) -> tuple[str, str, str, list[str]] | None:
    """A rank whose process died: a crash ("fail"), or "hang" where the trace shows the ranks
    posted mismatched collectives (gloo may abort on those). None when no rank died."""
    if (dead := re.search(r"rank (\d+) of \d+ died", str(error))) is None:
        return None
    traces, notes = _traces(trace_dir, world), _last_ops(trace_dir, world)
    if _diverging(traces, world) is not None:
        return "hang", f"rank {dead[1]} died at world {world} after mismatched collectives", MISMATCH, \
            _hang_notes(trace_dir, world)
    p2p = any(line.split("(")[0] in P2P for lines in traces for line in lines)
    hint = DIED + ("; with send/recv: gloo aborts a process whose receive gets a message of another "
                   "size (sender and receiver must agree on every message's size)" if p2p else "")
    return "fail", f"rank {dead[1]} died at world {world} (a crash in native code or os._exit)", hint, notes


def _not_implemented(error: RankError) -> str | None:
    """The message of a NotImplementedError some rank raised, or None."""
    for last in error.errors.values():
        if last.startswith("NotImplementedError"):
            return last.removeprefix("NotImplementedError").removeprefix(":").strip() or "(no message)"
    return None


def _replay(records: list[dict]) -> tuple[bool, str]:
    """Every communicator's recorded plan replayed under NCCL's rules: (ok, what happened)."""
    plans = plan_from_records(records)
    groups = sum(len(g) for plan in plans.values() for g in plan.values())
    for ranks, plan in plans.items():
        if (deadlock := find_deadlock(plan)) is not None:
            return False, f"on the communicator of ranks {list(ranks)}, {deadlock}"
    return True, f"{groups} send/recv groups on {len(plans)} communicator(s) replay to the end"


class Pools:
    """One job of each world size for a whole grading, reused property after property (a job
    costs ~1 s to start and stop on 2 cores); a job that failed is dropped and the next use starts
    a fresh one, so a broken or hung lab cannot leak into the next property."""

    def __init__(self) -> None:
        self.jobs: dict[int, RankPool] = {}

    def __call__(self, world: int) -> RankPool:
        if world not in self.jobs or self.jobs[world].broken:
            self.jobs[world] = RankPool(world)
        return self.jobs[world]

    def drop(self, world: int) -> None:
        if world in self.jobs:
            self.jobs.pop(world).close(grace_s=CLOSE_GRACE_S)

    def close(self) -> None:
        for world in list(self.jobs):
            self.drop(world)


def grade_property(package: str, prop: Property, lab_path: str, pools: Pools | None = None) -> Verdict:
    """Run `prop` on each of its configs; the first failure decides the verdict."""
    start, runs = time.perf_counter(), []
    own = pools is None
    pools = pools or Pools()

    def verdict(status: str, detail: str, hint: str = "", notes: list[str] | None = None) -> Verdict:
        return Verdict(prop.name, status, detail, hint, time.perf_counter() - start, notes or [])

    for config in prop.configs:
        world = config["world"]
        with tempfile.TemporaryDirectory(prefix="pfs-lab-") as trace_dir:
            pool, ok = pools(world), False
            try:
                results = pool.run(_on_rank, package, prop.name, lab_path, config, trace_dir,
                                   timeout=prop.timeout_s)
            except RankTimeoutError as error:
                if error.errors:  # some ranks raised; the others waited for them in vain
                    first = min(error.errors)
                    return verdict("fail", f"rank {first} raised at world {world}: {error.errors[first]}",
                                   "the other ranks then waited for its messages until the deadline",
                                   _last_ops(trace_dir, world))
                if (died := _died(error, trace_dir, world)) is not None:
                    return verdict(*died)
                return verdict("hang", f"no answer within {prop.timeout_s:.0f} s at world {world}",
                               MISMATCH, _hang_notes(trace_dir, world))
            except RankError as error:
                if (todo := _not_implemented(error)) is not None:
                    return verdict("todo", f"not implemented: {todo}")
                if any(sign in e for e in error.errors.values() for sign in GLOO_MISMATCH):
                    return verdict("hang", f"gloo aborted a mismatched collective at world {world}",
                                   MISMATCH, _hang_notes(trace_dir, world))
                first = min(error.errors)
                return verdict("fail", f"rank {first} raised at world {world}: {error.errors[first]}",
                               notes=[] if prop.plan else _last_ops(trace_dir, world))
            else:
                ok = True
            finally:
                if own or not ok:
                    pools.drop(world)
        if not prop.plan:
            runs.append((config, results[0]))
            continue
        ok, detail = _replay(results)
        if not ok and "unmatched plan" in detail:
            return verdict("deadlock", f"at world {world}: sends and receives do not pair up",
                           "the k-th send from a to b meets b's k-th receive from a, and both must have "
                           "the same size: sender and receiver disagree on what moves (which chunk, "
                           "which peer, how many messages)", [detail])
        if not ok:
            return verdict("deadlock", f"at world {world}: would hang on NCCL",
                           "a send completes only when its receive runs in the peer's current group: "
                           "post each send in one batch_isend_irecv with the receive it waits for, "
                           "in the same order on both ranks", [detail])
    if prop.plan:
        return verdict("pass", detail)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the one-device references are tiny: more threads only contend with the ranks
    try:
        passed, detail, hint = prop.check(runs)
    finally:
        torch.set_num_threads(threads)
    return verdict("pass" if passed else "fail", detail, "" if passed else hint)


def grade(chapter: int, path: str | Path | None = None, solution: bool = False,
          only: str | None = None, out: Callable[[str], None] = print) -> list[Verdict]:
    """Grade chapter `chapter`'s lab: `path` (default: the chapter's lab.py, or with
    `solution=True` its lab_solution.py). Prints a verdict per property; returns them."""
    torch.set_num_threads(1)  # the reference runs here, beside the ranks: one core's worth each
    package = PACKAGES[chapter]
    lab_check = importlib.import_module(f"{package}.lab_check")
    folder = Path(lab_check.__file__).parent
    lab_path = str(Path(path) if path else folder / ("lab_solution.py" if solution else "lab.py"))
    out(f"lab {chapter:02d} · {lab_check.TITLE} · grading {os.path.relpath(lab_path)}")
    pools = Pools()
    try:
        verdicts = _grade_all(lab_check, package, lab_path, only, out, pools)
    finally:
        pools.close()
    passed = sum(v.passed for v in verdicts if not v.optional)
    extra = [v for v in verdicts if v.optional]
    extras = f"; optional: {sum(v.passed for v in extra)}/{len(extra)} pass" if extra else ""
    out(f"{passed}/{len(verdicts) - len(extra)} properties pass{extras} "
        f"({sum(v.seconds for v in verdicts):.1f} s)")
    return verdicts


def _grade_all(lab_check: ModuleType, package: str, lab_path: str, only: str | None,
               out: Callable[[str], None], pools: Pools) -> list[Verdict]:
    verdicts: list[Verdict] = []
    stop = ""
    for prop in lab_check.PROPERTIES:
        if only is not None and only not in prop.name:
            continue
        verdict = (Verdict(prop.name, "skipped", stop) if stop
                   else grade_property(package, prop, lab_path, pools))
        verdict.optional = prop.optional
        if verdict.status == "todo" and not prop.optional:
            stop = "not run: write what is not implemented first"
        elif verdict.status == "deadlock":
            stop = "not run: the send/recv plan above would hang on NCCL"
        elif verdict.status == "hang":
            stop = "not run: mend the hang above first"
        verdicts.append(verdict)
        for line in verdict.lines():
            out(line)
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapter", type=int, choices=sorted(PACKAGES))
    parser.add_argument("--solution", action="store_true", help="grade lab_solution.py (the reference)")
    parser.add_argument("--file", default=None, help="grade this file instead of the chapter's lab.py")
    parser.add_argument("--only", default=None, help="only the properties whose name contains this")
    args = parser.parse_args(argv)
    verdicts = grade(args.chapter, args.file, args.solution, args.only)
    return 0 if verdicts and not any(v.failed for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
