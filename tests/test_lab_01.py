"""Lab 01 (bucketed DDP): the grader passes the reference, stops the skeleton at once, and names
each typical bug."""

from __future__ import annotations

from importlib import import_module

import pytest

from common.lab_rank import load_lab
from tests.labs import assert_bug_diagnosed, assert_reference_passes, assert_skeleton_fails_fast, plant


def test_reference_passes_every_property():
    assert_reference_passes(1)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(1)


LAUNCH = "        if self.ready[i] == len(self.buckets[i]):\n"
WAIT = "            self.works[i].wait()\n"
EXIT = "                __import__('os')._exit(1)\n"  # the process ends without an exception
BUGS = {  # name: (edits of lab_solution.py, the property that shows it, status, words of the hint)
    "missing 1/n": ([("            self.buffers[i].div_(self.world)\n", "")],
                    "one backward", "fail", "a missing 1/n"),
    "forward order": ([("    for p in reversed(params):", "    for p in params:")],
                      "assign_buckets", "fail", "forward order"),
    "state not reset": ([("        self.works = [None] * len(self.buckets)\n        self.queued = False",
                          "        self.works = [None] * len(self.buckets)")],
                        "three AdamW", "fail", "right at step 1, wrong after"),
    "a bucket only rank 0 launches": (
        [(LAUNCH, LAUNCH.replace(":", " and (i > 0 or dist.get_rank() == 0):"))],
        "one backward", "hang", "last posted all_reduce"),
    "launched at the end of backward": (
        [(LAUNCH, LAUNCH.replace(":", " and False:")),
         (WAIT, "            dist.all_reduce(self.buffers[i], group=self.group)\n")],
        "during backward", "fail", "launch each bucket from the hook"),
    "a rank that dies": ([(WAIT, "            if dist.get_rank() == 1:\n" + EXIT + WAIT)], "one backward",
                         "fail", "rank 1 died at world 2 (a crash in native code or os._exit)"),
    "a rank that posts another collective, then dies": (
        [(LAUNCH, LAUNCH + "            if dist.get_rank() == 1:\n"
                           "                dist.broadcast(self.buffers[i], 0, async_op=True)\n" + EXIT)],
        "one backward", "hang", "collective 1 differs: rank 0 posted all_reduce(float64[8192]), "
                                "rank 1 posted broadcast(float64[8192], 0)"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    edits, only, status, hint = BUGS[bug]
    assert_bug_diagnosed(1, tmp_path, edits, only, status, hint)


def test_a_layout_with_the_right_sizes_names_the_bucket_that_differs(tmp_path):
    lab_check = import_module("data_parallel.lab_check")
    lab = load_lab(plant(1, tmp_path, BUGS["forward order"][0]))  # at cap 0: 21 buckets of one, as expected
    passed, detail, _ = lab_check.check_layouts([({"world": 1}, lab_check.bucket_layouts(lab, world=1))])
    assert not passed
    assert detail == "cap 0 B: bucket 0 holds ['tok_embeddings.weight'], expected ['output.weight']"
