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
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
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
CLOSE_GRACE_S = 0.2  # a graded job's ranks are not reused: killed if still tearing down (~1 s each)
TRACED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
          "reduce_scatter_single", "all_to_all_single", "broadcast", "barrier", "all_gather",
          "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")


MISMATCH = ("the ranks posted different collectives (a rank waits in one its peers never post, or "
            "they disagree on its size): every rank must post the same collectives, same sizes, same order")
GLOO_MISMATCH = ("doesn't match expected size", "Connection reset by peer", "Connection closed by peer")


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
    def isend(*args, **kwargs) -> _Done:  # named: the recorder tells a P2POp's kind by __name__
        return _Done()

    def irecv(*args, **kwargs) -> _Done:
        return _Done()

    stubs = {"batch_isend_irecv": lambda ops: [_Done() for _ in ops], "isend": isend, "irecv": irecv}
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
            described = prop.run(lab, **config)
        return _labelled(dict(recorder.groups), described)


def _labelled(groups: dict, described: Any) -> dict:
    """The recorded groups with each op's label taken from the run's own description of what it
    posted ([[(kind, global peer, label), ...] per group, in order], or None), on the
    communicator where the two agree op for op: a deadlock report then says what each op carries."""
    if not described:
        return groups
    for ranks, posted in groups.items():
        if len(posted) == len(described) and all(
                [(op.kind, op.peer) for op in group] == [(kind, peer) for kind, peer, _ in ops]
                for group, ops in zip(posted, described, strict=True)):
            groups[ranks] = [tuple(replace(op, label=name) for op, (*_, name) in zip(group, ops, strict=True))
                             for group, ops in zip(posted, described, strict=True)]
    return groups


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
                if "died" in str(error):  # gloo aborts a process whose receive gets the wrong size
                    return verdict("hang", f"a rank died at world {world} (gloo aborts a receive "
                                   "whose message has another size)", MISMATCH, _last_ops(trace_dir, world))
                return verdict("hang", f"no answer within {prop.timeout_s:.0f} s at world {world}",
                               MISMATCH, _last_ops(trace_dir, world))
            except RankError as error:
                if (todo := _not_implemented(error)) is not None:
                    return verdict("todo", f"not implemented: {todo}")
                if any(sign in e for e in error.errors.values() for sign in GLOO_MISMATCH):
                    return verdict("hang", f"gloo aborted a mismatched collective at world {world}",
                                   MISMATCH, _last_ops(trace_dir, world))
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
