"""Lab 06 (1F1B as data and its send/recv groups): the grader passes the reference, stops the
skeleton at once, names each typical bug, and reports a plan NCCL would hang on as a deadlock
before any real run."""

from __future__ import annotations

import pytest

from tests.labs import assert_bug_diagnosed, assert_reference_passes, assert_skeleton_fails_fast


def test_reference_passes_every_property():
    assert_reference_passes(6)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(6)


WARMUP = "        warmup = min(p - r - 1, m)\n"
GROUP = "        if sends or recvs:\n            program.append(Exchange(sends, recvs))\n"
BUGS = {  # name: (edits of lab_solution.py, the property that shows it, status, words it must print)
    "GPipe's order": ([(WARMUP, "        warmup = m\n")], "at most p − r held", "fail", "GPipe's memory"),
    "one warm-up forward too many": ([(WARMUP, "        warmup = min(p - r, m)\n")], "at most p − r held",
                                     "fail", "one warm-up forward too many"),
    "cool-down one short": ([("range(m - warmup, m)]", "range(m - warmup, m - 1)]")], "at most p − r held",
                            "fail", "never runs B7"),
    "warm-up reversed": ([(WARMUP, "        warmup = min(r, m)\n")], "at most p − r held", "fail",
                         "the warm-up grows with the rank"),
    "too few warm-up forwards": ([(WARMUP, "        warmup = max(0, min(p - r - 2, m))\n")],
                                 "bubble", "fail", "then waits for a gradient"),
    "F's receive in the wrong direction": (
        [('Message("act", i, rank - 1, rank - 1, rank)', 'Message("act", i, rank - 1, rank, rank - 1)')],
        "messages", "fail", "src is the rank that sends"),
    "last send never posted": ([("    if sends:\n        program.append(Exchange(sends, ()))\n", "")],
                               "p2p_schedule", "fail", "the last action's send needs a group after it"),
    # Send and receive in separate groups: gloo would run it, NCCL hangs (rank 0 sends F1's
    # activation while rank 1 sends B0's gradient, each waiting for a receive posted later).
    "send and receive split into two groups": (
        [(GROUP, "        if sends:\n            program.append(Exchange(sends, ()))\n"
                 "        if recvs:\n            program.append(Exchange((), recvs))\n")],
        "NCCL", "deadlock", "waits on send→1 act mb1 stage 0→1 [m=4]"),
    # The executor's receive buffer reused for every message (README, "break it"): only the
    # gradients show it.
    "one receive buffer for every message": (
        [("from pipeline.schedules import Action, Message\n",
          "from pipeline.schedules import Action, Message\nfrom pipeline.executor import PipelineExecutor\n"
          "_fresh = PipelineExecutor.new_buffer\n"
          "PipelineExecutor.new_buffer = lambda self, message: self.__dict__.setdefault('_one', "
          "_fresh(self, message))\n")],
        "on 2 ranks", "fail", "right loss, wrong gradients"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    edits, only, status, hint = BUGS[bug]
    assert_bug_diagnosed(6, tmp_path, edits, only, status, hint)
