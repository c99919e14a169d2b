"""Lab 01 (bucketed DDP): the grader passes the reference, stops the skeleton at once, and names
each typical bug at the check that catches it."""

from __future__ import annotations

import pytest

from tests.labs import (
    Bug,
    assert_bug_diagnosed,
    assert_checks_covered,
    assert_reference_passes,
    assert_skeleton_fails_fast,
)


def test_reference_passes_every_property():
    assert_reference_passes(1)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(1)


LAUNCH = "        if self.ready[i] == len(self.buckets[i]):\n"
WAIT = "            self.works[i].wait()\n"
DIVIDE = "            self.buffers[i].div_(self.world)\n"
HOOK = "                p.register_post_accumulate_grad_hook(self._on_grad_ready)\n"
COPY = "        self.buffers[i][offset : offset + p.numel()].copy_(p.grad.reshape(-1))\n"
EXIT = "                __import__('os')._exit(1)\n"  # the process ends without an exception
BUGS = {
    "missing 1/n": Bug([(DIVIDE, "")], "one backward", "fail", "a missing 1/n", "check_grads"),
    "an error of 1e-8": Bug([(DIVIDE, DIVIDE.replace("self.world", "self.world * (1 + 1e-8)"))],
                            "one backward", "fail", "max rel diff 1e-08", "check_grads"),
    "divided by 2, not n (right at world 2 only)": Bug(
        [(DIVIDE, DIVIDE.replace("self.world", "2"))], "one backward", "fail",
        "divided by 2 where the group has 3 ranks", "check_grads"),
    "group= ignored": Bug([("group=self.group,\n", "\n")], "group=", "fail",
                          "summed over the whole world, not over your group", "check_grads"),
    "only rank 0 divides": Bug([(DIVIDE, "            if dist.get_rank() == 0:\n    " + DIVIDE)],
                               "one backward", "fail", "ranks [0] are right, rank 1 is not", "check_grads"),
    "forward order": Bug([("    for p in reversed(params):", "    for p in params:")],
                         "assign_buckets", "fail", "forward order", "check_layouts"),
    "a cut at a bucket that reaches the cap exactly": Bug(
        [("size + nbytes > cap_bytes", "size + nbytes >= cap_bytes")], "assign_buckets", "fail",
        "not reach it (>=)", "check_layouts"),
    "state not reset": Bug([("        self.works = [None] * len(self.buckets)\n        self.queued = False",
                             "        self.works = [None] * len(self.buckets)")],
                           "three AdamW", "fail", "right at step 1, wrong after", "check_grads"),
    "a hook on the wrong event": Bug(
        [(HOOK, "                p.register_hook(lambda grad, p=p: self._on_grad_ready(p))\n")],
        "one backward", "raised", "a hook on the wrong event"),
    "a hook on the wrong event, its None gradient skipped": Bug(
        [(HOOK, "                p.register_hook(lambda grad, p=p: self._on_grad_ready(p))\n"),
         (COPY, "        if p.grad is not None:\n    " + COPY)],
        "one backward", "fail", "fired before the gradient was there", "check_grads"),
    "a synchronizing all-reduce when no_sync ends": Bug(
        [("            self.sync = True\n",
          "            self.sync = True\n            dist.all_reduce(torch.zeros(1), group=self.group)\n")],
        "no_sync", "fail", "inside no_sync() nothing is communicated", "check_no_sync"),
    "a bucket only rank 0 launches": Bug(
        [(LAUNCH, LAUNCH.replace(":", " and (i > 0 or dist.get_rank() == 0):"))],
        "one backward", "hang",
        "rank 0 posted all_reduce(float64[8192]), rank 1 posted all_reduce(float64[32])"),
    "launched at the end of backward": Bug(
        [(LAUNCH, LAUNCH.replace(":", " and False:")),
         (WAIT, "            dist.all_reduce(self.buffers[i], group=self.group)\n")],
        "during backward", "fail", "launch each bucket from the hook", "check_overlap"),
    "a rank that dies": Bug([(WAIT, "            if dist.get_rank() == 1:\n" + EXIT + WAIT)], "one backward",
                            "died", "rank 1 died at world 2 (a crash in native code or os._exit)"),
    "a rank that posts another collective, then dies": Bug(
        [(LAUNCH, LAUNCH + "            if dist.get_rank() == 1:\n"
                           "                dist.broadcast(self.buffers[i], 0, async_op=True)\n" + EXIT)],
        "one backward", "hang", "collective 1 differs: rank 0 posted all_reduce(float64[8192]), "
                                "rank 1 posted broadcast(float64[8192], 0)"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    assert_bug_diagnosed(1, tmp_path, BUGS[bug])


def test_every_check_has_a_planted_bug():
    assert_checks_covered(1, BUGS)
