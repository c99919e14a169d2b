"""Lab 03 (the ZeRO-2 step): the grader passes the reference, stops the skeleton at once, and names
each typical bug."""

from __future__ import annotations

import pytest

from tests.labs import assert_bug_diagnosed, assert_reference_passes, assert_skeleton_fails_fast


def test_reference_passes_every_property():
    assert_reference_passes(3)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(3)


MASTER = "        self.master = flat[self.start : self.end].clone()"
STEP = "        self.optim.step()\n"
GATHER = "        all_gather_single(flat, self.master.detach().to(dtype), group=self.group)\n"
BUGS = {  # name: (edits of lab_solution.py, the property that shows it, status, words of the hint)
    "missing 1/N": ([("        self.master.grad.div_(self.world)\n", "")],
                    "AdamW steps", "fail", "a missing 1/n"),
    "clipping by the local shard's norm": (
        [("        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)\n", "")],
        "clipping", "fail", "clipping by the local shard's norm"),
    "rank counted from 1": (
        [(MASTER, "        self.master = flat.view(self.world, -1)[self.rank - 1].clone()")],
        "AdamW steps", "fail", "shard offset off by one slice"),
    "padding left out": ([("    s = -(-numel // world)", "    s = numel // world")],
                         "owner's slice", "fail", "padding"),
    "master a view of a whole copy": ([(MASTER, MASTER.removesuffix(".clone()"))],
                                      "memory", "fail", "whole-model master copy"),
    "inner optimizer over the model": (
        [("optimizer_class([self.master], **defaults)", "optimizer_class(self.params, **defaults)")],
        "memory", "fail", "optimizer state for the whole model"),
    "optimizer state lost between steps": ([(STEP, "        self.optim.state.clear()\n" + STEP)],
                                           "AdamW steps", "fail", "right after step 1, wrong after step 2"),
    "all-gather before the step": ([(STEP, ""), (GATHER, GATHER + STEP)],
                                   "AdamW steps", "fail", "the all-gather sent stale values"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    edits, only, status, hint = BUGS[bug]
    assert_bug_diagnosed(3, tmp_path, edits, only, status, hint)
