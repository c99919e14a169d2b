"""A lab's check module for the grader's own tests (tests/test_lab_grader.py): small properties on
1 and 2 ranks whose 'lab' is a file the test writes, each property a way the grader could go
wrong (a configuration or check left out, a rank's result ignored, a check that crashes, an
exception on one rank, a hang in a blocking collective, an optional part, a later failure an
earlier one explains)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from common.labs.grader import Fail, Property
from common.labs.rank import at

ERROR_HINTS = [(("the student's own words",), "a hint of the lab's own")]


def value(lab, world: int, scale: float = 1.0) -> float:
    """Every rank: the lab's value(rank, world), times `scale`."""
    return lab.value(dist.get_rank(), world) * scale


def check_value(runs) -> Fail | str:
    """Every rank of every configuration returns rank + world."""
    for run in runs:
        for rank, got in enumerate(run.ranks):
            if got != rank + run.world * run.config.get("scale", 1.0):
                return Fail(f"world {run.world}, rank {rank}: {got}", "the value is rank + world")
    return "every rank's value"


def check_worlds(runs) -> Fail | str:
    """The runs are the configurations listed, in order."""
    return "worlds " + ", ".join(str(r.world) for r in runs)


def check_crashes(runs) -> Fail | str:
    """Reads a key no run has (a grader bug, or a result of another kind)."""
    return runs[0].ranks[0]["missing"]


def steps(lab, world: int) -> int:
    """Two marked steps; the lab's step() may raise."""
    for step in (1, 2):
        at(step=step, phase="backward")
        lab.step(dist.get_rank(), step)
    return 0


def blocking(lab, world: int) -> int:
    """An all-reduce every rank posts, then the lab's blocking part."""
    dist.all_reduce(torch.zeros(1))
    lab.blocking(dist.get_rank())
    return 0


def once(lab, world: int) -> int:
    """Fails as a gloo group that could not form the first time each rank runs it (a loaded
    machine), then passes."""
    marker = Path(lab.MARKER + str(dist.get_rank()))
    if not marker.exists():
        marker.touch()
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer")
    return 0


def check_true(runs) -> Fail | str:
    """Passes."""
    return "ok"


PROPERTIES = [
    Property("value on 1 and 2 ranks", [{"world": 1}, {"world": 2}], value, [check_value, check_worlds]),
    Property("a check that crashes", [{"world": 1}], value, [check_crashes]),
    Property("a step that raises on one rank", [{"world": 2}], steps, [check_true]),
    Property("a hang in a blocking collective", [{"world": 2}], blocking, [check_true], timeout_s=3),
    Property("explained by the value above", [{"world": 1, "scale": 2.0}], value, [check_value],
             after=("value on",)),
    Property("a group that fails to form, once", [{"world": 2}], once, [check_true]),
    Property("an optional part", [{"world": 1}], lambda lab, world: lab.optional(), [check_true],
             optional=True),
]
