"""The labs' grader, on each rank: the student's file loaded as a module, every collective and
send/recv traced before it runs, point-to-point code run without moving data to record its plan,
and any exception turned into a record the grader reports.

`_on_rank` is what common/labs/grader.py sends to every rank of a job for one property. A property's
`run` marks where it is with `at(step=…, phase=…)`; when anything raises on a rank (the student's
code, or the grader reading what it returned), the rank writes what raised, where (that mark, the
innermost frame in the lab file and the innermost frame overall) to `error<rank>` in the job's
trace folder and ends its process at once: its peers, waiting in a collective it will never
post, are stopped by the grader instead of waiting out a deadline.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import traceback
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.kernel.p2p_plan import P2PRecorder
from common.kernel.patch import patch_dist

TRACED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
          "reduce_scatter_single", "all_to_all_single", "broadcast", "barrier", "all_gather",
          "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")
WHERE: dict[str, Any] = {}  # the running property's step and phase, set by `at`


def at(step: int | None = None, phase: str | None = None) -> None:
    """Mark where the property's run is (step counted from 1; phase: forward, backward, …): an
    exception raised after this is reported there."""
    WHERE.update({k: v for k, v in (("step", step), ("phase", phase)) if v is not None})


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
            parts.append(f"group of {dist.get_world_size(a)} {dist.get_process_group_ranks(a)}")
    return ", ".join(parts)


@contextmanager
def trace_ops(path: str):
    """Append each collective / send / recv this rank posts to `path` before it runs (the last
    line is what a hung rank waits in). Wraps torch.distributed from the outside, like the meter."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def traced(name: str, fn):
        def call(*args, **kwargs):
            os.write(fd, f"{name}({_describe(args, kwargs)})\n".encode())
            return fn(*args, **kwargs)
        call.__name__ = fn.__name__
        return call

    try:
        with patch_dist({name: partial(traced, name) for name in TRACED}, also=(c10d,)):
            yield
    finally:
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
    no_data = patch_dist({name: lambda _torchs, stub=stub: stub for name, stub in stubs.items()},
                         also=(c10d,))
    with no_data, P2PRecorder() as recorder:
        yield recorder


def _frame(frame, lineno: int) -> str:
    code = frame.f_code
    return f"{getattr(code, 'co_qualname', code.co_name)} ({Path(code.co_filename).name}:{lineno})"


def raised(error: BaseException, lab_path: str) -> dict:
    """What the grader reports of an exception: its type and message, the mark of `at`, the
    innermost frame in the lab file and the innermost frame of all (torch's, or the grader's)."""
    frames = list(traceback.walk_tb(error.__traceback__))
    mine = Path(lab_path).resolve()
    lab = [(f, n) for f, n in frames if Path(f.f_code.co_filename).resolve() == mine]
    message = " ".join(str(error).split())
    return {"type": type(error).__name__, "message": message[:400], **WHERE,
            "lab_frame": _frame(*lab[-1]) if lab else None, "frame": _frame(*frames[-1]) if frames else None}


def _on_rank(module: str, prop_name: str, lab_path: str, config: dict, trace_dir: str) -> Any:
    """One rank's part of one property: trace, load the lab, run. Anything raised is written to
    `error<rank>` and ends the process (module doc)."""
    WHERE.clear()
    rank = dist.get_rank()
    try:
        prop = property_named(module, prop_name)
        with trace_ops(os.path.join(trace_dir, f"rank{rank}")):
            lab = load_lab(lab_path)
            if not prop.plan:
                return prop.run(lab, **config)
            with record_p2p_plan() as recorder:
                described = prop.run(lab, **config)
            return _labelled(dict(recorder.groups), described)
    except BaseException as error:  # a student's SystemExit is reported too
        Path(trace_dir, f"error{rank}").write_text(json.dumps(raised(error, lab_path)))
        os._exit(1)


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


def property_named(module: str, name: str):
    return next(p for p in importlib.import_module(module).PROPERTIES if p.name == name)
