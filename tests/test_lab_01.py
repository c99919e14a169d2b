"""Lab 01 (bucketed DDP): the grader passes the reference, stops the skeleton at once, and names
each typical bug."""

from __future__ import annotations

import pytest

from tests.labs import assert_bug_diagnosed, assert_reference_passes, assert_skeleton_fails_fast


def test_reference_passes_every_property():
    assert_reference_passes(1)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(1)


LAUNCH = "        if self.ready[i] == len(self.buckets[i]):\n"
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
         ("            self.works[i].wait()\n",
          "            dist.all_reduce(self.buffers[i], group=self.group)\n")],
        "during backward", "fail", "launch each bucket from the hook"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    edits, only, status, hint = BUGS[bug]
    assert_bug_diagnosed(1, tmp_path, edits, only, status, hint)
