"""The grader's stops and its hang report on a subgroup (common/labs/grader.py, failures.py).

A failed `gate` (05's expert lab gates on its all-to-all plan) must stop the grading: the
properties after it are not run (their run would leave a marker file) and say which gate to mend,
and the lab fails; the same property without `gate` lets the grading go on. A hang inside a
subgroup (every existing hang test is world-wide) must be reported on that subgroup, naming its
ranks and the collective that differs. This module is its own check module: its PROPERTIES run
on a 'lab' file each test writes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from common.labs.grader import Fail, Property, grade_module
from common.labs.tools import split

LAB = """
MARKER = {marker!r}


def value(rank, world):
    return rank + world


def subgroup(rank, group):
    pass
"""


def value(lab, world: int) -> int:
    return lab.value(dist.get_rank(), world)


def check_value(runs) -> Fail | str:
    """Every rank returns rank + world."""
    got = runs[0].ranks
    return "rank + world" if got == [r + runs[0].world for r in range(runs[0].world)] else Fail(f"got {got}")


def mark(lab, world: int) -> int:
    """Leaves the lab's MARKER file: the property ran."""
    Path(lab.MARKER).touch()
    return 0


def check_true(runs) -> Fail | str:
    """Passes."""
    return "ran"


def in_subgroup(lab, world: int, groups: list[int]) -> int:
    """An all-reduce on this rank's group of `groups`, then the lab's part on that group."""
    group = split(groups)
    dist.all_reduce(torch.zeros(1), group=group.group)
    lab.subgroup(dist.get_rank(), group.group)
    return 0


PROPERTIES = [
    Property("the gate", [{"world": 1}], value, [check_value], gate=True),
    Property("a plain check", [{"world": 1}], value, [check_value]),
    Property("after", [{"world": 1}], mark, [check_true]),
    Property("a hang inside a subgroup", [{"world": 4, "groups": [2, 2]}], in_subgroup, [check_true],
             timeout_s=3),
]
MODULE = "tests.test_lab_grader_gates"


def grade(tmp_path: Path, only: tuple[str, ...], replace: dict[str, str] | None = None) -> tuple[list, str]:
    source = LAB.format(marker=str(tmp_path / "after ran"))
    for old, new in (replace or {}).items():
        assert old in source
        source = source.replace(old, new)
    (tmp_path / "lab.py").write_text(source)
    lines: list[str] = []
    verdicts = grade_module(MODULE, tmp_path / "lab.py", only, lines.append)
    return verdicts, "\n".join(lines)


WRONG = {"return rank + world": "return rank + world + 1"}


def test_a_failed_gate_stops_the_grading_and_names_the_gate(tmp_path):
    verdicts, text = grade(tmp_path, ("the gate", "after"), WRONG)
    assert [(v.name, v.status) for v in verdicts] == [("the gate", "fail"), ("after", "skipped")], text
    assert verdicts[0].failed and verdicts[0].check == "check_value", text
    assert verdicts[1].detail == "not run: mend 'the gate' above first (on NCCL it would hang)", text
    assert verdicts[1].failed and not (tmp_path / "after ran").exists(), text  # never ran, and fails the lab
    assert "0/2 properties pass" in text, text


def test_a_failed_check_that_is_no_gate_lets_the_grading_go_on(tmp_path):
    verdicts, text = grade(tmp_path, ("a plain check", "after"), WRONG)
    assert [v.status for v in verdicts] == ["fail", "pass"] and (tmp_path / "after ran").exists(), text


def test_a_gate_that_passes_lets_the_grading_go_on(tmp_path):
    verdicts, text = grade(tmp_path, ("the gate", "after"))
    assert [v.status for v in verdicts] == ["pass", "pass"] and (tmp_path / "after ran").exists(), text


def test_a_hang_inside_a_subgroup_is_reported_on_that_subgroup(tmp_path):
    part = "def subgroup(rank, group):\n    "
    hang = ("import torch, torch.distributed as dist\n"
            "    if rank == 2:\n        dist.all_reduce(torch.zeros(1), group=group)\n"
            "    if rank == 3:\n        dist.broadcast(torch.zeros(1), 2, group=group)\n")
    verdicts, text = grade(tmp_path, ("subgroup",), {part + "pass": part + hang})
    assert verdicts[0].status == "hang", text
    assert verdicts[0].detail == "mismatched collectives at world 4 cut into groups [2, 2]", text
    assert ("collective 2 on the group of ranks [2, 3] differs: rank 2 posted all_reduce(float32[1], "
            "group of 2 [2, 3]), rank 3 posted broadcast(float32[1], 2, group of 2 [2, 3])") in text, text
    assert "rank 2: last posted all_reduce(float32[1], group of 2 [2, 3]) (2 calls in all)" in text, text


def test_a_world_divergence_is_reported_before_a_subgroups():
    """Both the world's collective 1 and a subgroup's differ: the world's comes first (its
    collectives order every rank's), named without a group."""
    from common.labs.failures import _diverging

    traces = [["all_reduce(size 4)"], ["all_reduce(size 4)"],
              ["all_reduce(size 8)", "broadcast(size 1, group of 2 [2, 3])"],
              ["all_reduce(size 4)", "all_gather(size 1, group of 2 [2, 3])"]]
    report = _diverging(traces, 4)
    assert report.startswith("collective 1 differs") and "on the group of ranks" not in report
    subgroup_only = [traces[0], traces[1], ["all_reduce(size 4)", traces[2][1]], traces[3]]
    assert _diverging(subgroup_only, 4).startswith("collective 1 on the group of ranks [2, 3] differs")
