"""Lab 06 (1F1B as data and its send/recv groups): the grader passes the reference, stops the
skeleton at once, names each typical bug, and reports a plan NCCL would hang on as a deadlock
before any real run."""

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
    assert_reference_passes(6)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(6)


WARMUP = "        warmup = min(p - r - 1, m)\n"
GROUP = "        if sends or recvs:\n            program.append(Exchange(sends, recvs))\n"
PATCH = "from pipeline.schedules import Action, Message\n"
EXECUTOR = PATCH + "from pipeline.executor import PipelineExecutor\n"
BUGS = {
    "GPipe's order": Bug([(WARMUP, "        warmup = m\n")], "at most p − r held", "fail", "GPipe's memory",
                         "check_order"),
    "GPipe's order, measured": Bug([(WARMUP, "        warmup = m\n")], "on 2 ranks", "fail",
                                   "held 4.00 micro-batches' activations at its peak", "check_in_flight"),
    "one warm-up forward too many": Bug([(WARMUP, "        warmup = min(p - r, m)\n")], "at most p − r held",
                                        "fail", "one warm-up forward too many", "check_order"),
    "cool-down one short": Bug([("range(m - warmup, m)]", "range(m - warmup, m - 1)]")], "at most p − r held",
                               "fail", "never runs B7", "check_order"),
    "warm-up reversed": Bug([(WARMUP, "        warmup = min(r, m)\n")], "at most p − r held", "fail",
                            "the warm-up grows with the rank", "check_order"),
    "too few warm-up forwards": Bug([(WARMUP, "        warmup = max(0, min(p - r - 2, m))\n")],
                                    "bubble", "fail", "then waits for a gradient", "check_bubble"),
    "F's receive in the wrong direction": Bug(
        [('Message("act", i, rank - 1, rank - 1, rank)', 'Message("act", i, rank - 1, rank, rank - 1)')],
        "messages", "fail", "src is the rank that sends", "check_messages"),
    "last send never posted": Bug([("    if sends:\n        program.append(Exchange(sends, ()))\n", "")],
                                  "p2p_schedule", "fail", "the last action's send needs a group after it",
                                  "check_programs"),
    # Send and receive in separate groups: gloo would run it, NCCL hangs (rank 0 sends F1's
    # activation while rank 1 sends B0's gradient, each waiting for a receive posted later).
    "send and receive split into two groups": Bug(
        [(GROUP, "        if sends:\n            program.append(Exchange(sends, ()))\n"
                 "        if recvs:\n            program.append(Exchange((), recvs))\n")],
        "NCCL", "deadlock", "waits on send→1 act mb1 stage 0→1 [m=4]", "replay"),
    # The executor's receive buffer reused for every message (README, "break it"): only the
    # gradients show it.
    "one receive buffer for every message": Bug(
        [(PATCH, EXECUTOR + "_fresh = PipelineExecutor.new_buffer\n"
                            "PipelineExecutor.new_buffer = lambda self, message: "
                            "self.__dict__.setdefault('_one', _fresh(self, message))\n")],
        "on 2 ranks", "fail", "right loss, wrong gradients", "check_steps"),
    # Errors of 1e-8 come from the executor the lab drives: the loss scaled by 1/m, slightly off.
    "an error of 1e-8": Bug(
        [(PATCH, EXECUTOR + "_scale = PipelineExecutor.scale_loss\n"
                            "PipelineExecutor.scale_loss = lambda self, loss: "
                            "_scale(self, loss) * (1 + 1e-8)\n")],
        "on 2 ranks", "fail", "max rel diff 1e-08", "check_steps"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    assert_bug_diagnosed(6, tmp_path, BUGS[bug])


def test_every_check_has_a_planted_bug():
    assert_checks_covered(6, BUGS)
