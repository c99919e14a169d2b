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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.p2p_plan import P2PRecorder, find_deadlock, plan_from_records
from common.rank_pool import RankError, RankPool, RankTimeoutError

PACKAGES = {1: "data_parallel", 2: "ring_allreduce", 3: "zero", 4: "fsdp", 5: "tensor_parallel",
            6: "pipeline", 7: "parallel3d"}
TIMEOUT_S = float(os.environ.get("PFS_LAB_TIMEOUT", 20))
TRACED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
          "reduce_scatter_single", "all_to_all_single", "broadcast", "barrier", "all_gather",
          "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")


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
    every rank posted replay to the end under NCCL's rules; list it before the real runs."""

    name: str
    configs: Sequence[dict[str, Any]]
    run: Callable[..., Any]
    check: Callable[[list[tuple[dict, Any]]], tuple[bool, str, str]] | None = None
    timeout_s: float = TIMEOUT_S
    plan: bool = False


@dataclass
class Verdict:
    name: str
    status: str  # "pass", "fail", "hang", "deadlock", "todo" (NotImplementedError), "skipped"
    detail: str = ""
    hint: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # printed under the verdict (per rank, a plan)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def lines(self) -> list[str]:
        mark = {"pass": "✓", "fail": "✗", "hang": "⏱", "deadlock": "✗", "todo": "✗", "skipped": "·"}
        out = [f"{mark[self.status]} {self.name:<58} {self.detail}".rstrip()]
        out += [f"    {line}" for note in self.notes for line in note.splitlines()]
        if self.hint:
            out.append(f"    hint: {self.hint}")
        return out


# --- what runs on each rank --------------------------------------------------------------------

def load_lab(path: str | Path) -> ModuleType:
    """The student's file as a module of its own (not a package member: it is theirs to move)."""
    path = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(f"lab_under_test_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _describe(args: tuple, kwargs: dict) -> str:
    parts = []
    for a in [*args, *kwargs.values()]:
        if isinstance(a, torch.Tensor):
            parts.append(f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}")
        elif isinstance(a, (list, tuple)) and a and hasattr(a[0], "peer"):  # P2POps
            parts.append(", ".join(f"{getattr(o.op, '__name__', '?')}(peer {o.peer})" for o in a))
        elif isinstance(a, int) and not isinstance(a, bool):
            parts.append(str(a))
        elif isinstance(a, dist.ProcessGroup):
            parts.append(f"group of {dist.get_world_size(a)}")
    return ", ".join(parts)


@contextmanager
def trace_ops(path: str):
    """Append each collective / send / recv this rank posts to `path` before it runs (the last
    line is what a hung rank waits in). Wraps torch.distributed from the outside, like the meter."""
    originals = [(m, n, getattr(m, n)) for n in TRACED for m in (dist, c10d) if hasattr(m, n)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def traced(name: str, fn):
        def call(*args, **kwargs):
            os.write(fd, f"{name}({_describe(args, kwargs)})\n".encode())
            return fn(*args, **kwargs)
        call.__name__ = fn.__name__
        return call

    wrapped = {}
    for module, name, fn in originals:
        wrapped.setdefault(name, traced(name, fn))
        setattr(module, name, wrapped[name])
    try:
        yield
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
        os.close(fd)


class _Done:
    """A finished Work: what a send or receive returns when nothing is moved."""

    def wait(self, *_) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextmanager
def record_p2p_plan():
    """Run point-to-point code without moving data: sends and receives are recorded (per
    communicator, in issue order, as P2PRecorder does) and return finished works. Yields the
    recorder; its `groups` are this rank's part of the plan."""
    stubs = {"batch_isend_irecv": lambda ops: [_Done() for _ in ops],
             "isend": lambda *a, **k: _Done(), "irecv": lambda *a, **k: _Done()}
    saved = [(m, n, getattr(m, n)) for n in stubs for m in (dist, c10d)]
    for module, name, _ in saved:
        setattr(module, name, stubs[name])
    try:
        with P2PRecorder() as recorder:
            yield recorder
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def _on_rank(package: str, prop_name: str, lab_path: str, config: dict, trace_dir: str) -> Any:
    """One rank's part of one property: trace, load the lab, run."""
    prop = property_named(package, prop_name)
    with trace_ops(os.path.join(trace_dir, f"rank{dist.get_rank()}")):
        lab = load_lab(lab_path)
        if not prop.plan:
            return prop.run(lab, **config)
        with record_p2p_plan() as recorder:
            prop.run(lab, **config)
        return dict(recorder.groups)


def property_named(package: str, name: str) -> Property:
    return next(p for p in importlib.import_module(f"{package}.lab_check").PROPERTIES if p.name == name)


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


def grade_property(package: str, prop: Property, lab_path: str) -> Verdict:
    """Run `prop` on each of its configs; the first failure decides the verdict."""
    start, runs = time.perf_counter(), []

    def verdict(status: str, detail: str, hint: str = "", notes: list[str] | None = None) -> Verdict:
        return Verdict(prop.name, status, detail, hint, time.perf_counter() - start, notes or [])

    for config in prop.configs:
        world = config["world"]
        with tempfile.TemporaryDirectory(prefix="pfs-lab-") as trace_dir:
            pool = RankPool(world)
            try:
                results = pool.run(_on_rank, package, prop.name, lab_path, config, trace_dir,
                                   timeout=prop.timeout_s)
            except RankTimeoutError as error:
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
                               notes=_last_ops(trace_dir, world))
            finally:
                pool.close()
        if not prop.plan:
            runs.append((config, results[0]))
            continue
        ok, detail = _replay(results)
        if not ok:
            return verdict("deadlock", f"at world {world}: would hang on NCCL",
                           "a send completes only when its receive runs in the peer's current group: "
                           "post each send in one batch_isend_irecv with the receive it waits for, "
                           "in the same order on both ranks", [detail])
    if prop.plan:
        return verdict("pass", detail)
    passed, detail, hint = prop.check(runs)
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
    verdicts: list[Verdict] = []
    stop = ""
    for prop in lab_check.PROPERTIES:
        if only is not None and only not in prop.name:
            continue
        verdict = (Verdict(prop.name, "skipped", stop) if stop
                   else grade_property(package, prop, lab_path))
        if verdict.status == "todo":
            stop = "not run: write what is not implemented first"
        elif verdict.status == "deadlock":
            stop = "not run: the send/recv plan above would hang on NCCL"
        elif verdict.status == "hang":
            stop = "not run: mend the hang above first"
        verdicts.append(verdict)
        for line in verdict.lines():
            out(line)
    passed = sum(v.passed for v in verdicts)
    out(f"{passed}/{len(verdicts)} properties pass ({sum(v.seconds for v in verdicts):.1f} s)")
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapter", type=int, choices=sorted(PACKAGES))
    parser.add_argument("--solution", action="store_true", help="grade lab_solution.py (the reference)")
    parser.add_argument("--file", default=None, help="grade this file instead of the chapter's lab.py")
    parser.add_argument("--only", default=None, help="only the properties whose name contains this")
    args = parser.parse_args(argv)
    verdicts = grade(args.chapter, args.file, args.solution, args.only)
    return 0 if verdicts and all(v.passed for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
