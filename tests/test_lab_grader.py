"""The labs' grader graded: each way it could pass a wrong student, or crash instead of grading,
has a test here that goes red (tests/labs.py adds those every lab's tests share: every
configuration and every check run on the reference, a planted bug per check, an error of 1e-8).

The fixture check module (tests/grader_fixture.py) runs on a 'lab' file written here: right, or
wrong in one way."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from common.labs import docs as lab_docs
from common.labs.diagnosis import close, first_difference
from common.labs.grader import ROOT, check_name, describe, grade_module, lab_module, lab_names, main
from common.labs.rank import trace_ops
from tests.labs import plant

LAB = """
def value(rank, world):
    return rank + world


def step(rank, step):
    pass


def blocking(rank):
    pass


def optional():
    raise NotImplementedError("optional: not written")
"""
FIXTURE = "tests.grader_fixture"


def grade_fixture(tmp_path: Path, only, replace: dict[str, str] | None = None) -> tuple[list, str]:
    source = LAB
    for old, new in (replace or {}).items():
        assert old in source
        source = source.replace(old, new)
    path = tmp_path / "fixture_lab.py"
    path.write_text(source)
    lines: list[str] = []
    verdicts = grade_module(FIXTURE, path, only, lines.append)
    return verdicts, "\n".join(lines)


def test_every_configuration_and_check_runs_and_every_rank_is_read(tmp_path):
    verdicts, text = grade_fixture(tmp_path, "value on")
    assert verdicts[0].passed and verdicts[0].configs == [{"world": 1}, {"world": 2}], text
    assert verdicts[0].checks == ["check_value", "check_worlds"] and "worlds 1, 2" in text, text
    # wrong on rank 1 of the second configuration only: rank 0's result alone would pass
    wrong = {"return rank + world": "return rank + world + (rank == 1)"}
    verdicts, text = grade_fixture(tmp_path, "value on", wrong)
    assert verdicts[0].failed and "world 2, rank 1: 4" in text, text


def test_a_check_that_crashes_is_a_failing_verdict(tmp_path):
    verdicts, text = grade_fixture(tmp_path, "crashes")
    assert verdicts[0].failed and "the grader could not read the results: TypeError" in text, text


def test_an_exception_on_one_rank_names_step_world_rank_and_function(tmp_path):
    raising = "if rank == 1 and step == 2:\n        raise RuntimeError(\"the student's own words\")\n"
    step = "def step(rank, step):\n    "
    verdicts, text = grade_fixture(tmp_path, "raises", {step + "pass": step + raising})
    assert verdicts[0].status == "raised" and verdicts[0].failed, text
    assert "step 2, backward, world 2, rank 1 raised RuntimeError: the student's own words in your step" \
        in text, text
    assert "hint: a hint of the lab's own" in text and "rank 0: last posted" not in text, text


def test_a_hang_is_reported_at_the_collective_posted_not_the_one_before(tmp_path):
    blocking = "def blocking(rank):\n    "
    hang = ("import torch, torch.distributed as dist\n"
            "    if rank == 0:\n        dist.broadcast(torch.zeros(1), 0)\n")
    verdicts, text = grade_fixture(tmp_path, "blocking", {blocking + "pass": blocking + hang})
    assert verdicts[0].status == "hang", text
    assert "rank 0: last posted broadcast(float32[1], 0) (2 calls in all)" in text, text


def test_a_group_that_fails_to_form_is_retried_once(tmp_path):
    marker = f"\nMARKER = {str(tmp_path / 'formed')!r}\n\n\ndef value"
    verdicts, text = grade_fixture(tmp_path, "fails to form", {"\ndef value": marker})
    assert verdicts[0].passed, text


def test_the_trace_line_is_written_before_the_call_runs(tmp_path):
    path = tmp_path / "rank0"
    with trace_ops(str(path)), pytest.raises(ValueError):  # no process group here: the call raises
        dist.barrier()
    assert path.read_text() == "barrier()\n"


def test_an_optional_part_unwritten_passes_written_wrong_fails(tmp_path):
    verdicts, text = grade_fixture(tmp_path, "optional")
    assert verdicts[0].status == "todo" and not verdicts[0].failed, text
    verdicts, text = grade_fixture(tmp_path, "optional", {"raise NotImplementedError": "raise ValueError"})
    assert verdicts[0].failed, text


def test_a_failure_an_earlier_property_explains_says_so(tmp_path):
    verdicts, text = grade_fixture(tmp_path, ("value on", "explained"), {"return rank + world": "return -1"})
    assert [v.failed for v in verdicts] == [True, True], text
    assert verdicts[1].hint.startswith("probably the same cause as ✗ 'value on 1 and 2 ranks' above"), text


def test_missing_extra_and_tiny_differences_are_reported():
    want = {"a": torch_ones(), "b": torch_ones()}
    assert first_difference({"a": torch_ones()}, want).missing
    assert first_difference({"a": torch_ones(), "b": None}, want).missing
    assert first_difference({**want, "c": torch_ones()}, want).extra
    assert first_difference({"a": torch_ones(), "b": torch_ones() * (1 + 1e-8)}, want).name == "b"
    assert first_difference({"a": torch_ones(), "b": torch_ones() * (1 + 1e-12)}, want) is None
    assert not close(torch_ones() * float("nan"), torch_ones())


def torch_ones():
    import torch

    return torch.ones(3, dtype=torch.float64)


def test_exit_status_is_one_when_a_verdict_fails_and_zero_when_all_pass(tmp_path):
    assert main(["3", "--solution", "--only", "owner"]) == 0
    bug = plant(3, tmp_path, [("    s = -(-numel // world)", "    s = numel // world")])
    make = subprocess.run(["make", "--no-print-directory", "lab-check", "N=3", f"FILE={bug}", "ONLY=owner",
                           f"PY={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert make.returncode != 0 and "✗ the owner's slice" in make.stdout, make.stdout + make.stderr


LABS = [(chapter, lab) for chapter in lab_docs.CHAPTERS for lab in lab_names(chapter)]


@pytest.mark.parametrize(("chapter", "lab"), LABS, ids=lambda x: str(x or "main"))
def test_every_lab_says_what_it_grades_on_one_page(chapter, lab):
    """A chapter's main lab in its README, a named lab on one page of its chapter (markers carrying
    its name); the block is what the checks grade: every property with every check by name, and,
    off the README (whose length is capped), every check's statement."""
    homes = lab_docs.homes(chapter, lab)
    assert len(homes) == 1, f"chapter {chapter}, lab {lab or '(main)'}: its block is on {homes}, not one page"
    (page,) = homes
    assert lab or page == lab_docs.readme(chapter), f"{page}: a chapter's main lab is graded in its README"
    assert lab_docs.current(page.read_text(encoding="utf-8"), lab) == lab_docs.expected(chapter, lab, page), (
        f"{page.relative_to(ROOT)}: its lab-graded block is not what the graders check: "
        "python -m common.labs.docs --write")
    compact, full = (" ".join(lab_docs.block(chapter, lab, full=f).split()) for f in (False, True))
    properties = importlib.import_module(lab_module(chapter, lab)).PROPERTIES
    for k, prop in enumerate(properties, 1):
        item = compact.split(f"{k}. **{prop.name}**")[1].split(f"{k + 1}. **")[0]
        for check in prop.checks:
            assert lab_docs.label(check) in item and describe(check) in full, (prop.name, check_name(check))
