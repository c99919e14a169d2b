"""Lab 05 · context (ring attention's forward on zig-zag blocks): the grader passes the reference,
stops the skeleton at once, reports a send/recv order NCCL would hang on before any real run, and
names each typical bug at the check that catches it."""

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
    assert_reference_passes(5, "context")


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(5, "context")


POST = ("            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, right, group),\n"
        "                                            dist.P2POp(dist.irecv, arriving, left, group)])\n")
SEPARATE = ("            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, right, group)])\n"
            "            works += dist.batch_isend_irecv([dist.P2POp(dist.irecv, arriving, left, group)])\n")
MERGE = "    new = torch.logaddexp(lse, block_lse)\n"
BUGS = {
    "the early chunk twice": Bug([("chunks[2 * cp - 1 - rank]]", "chunks[rank]]")], "zig-zag", "fail",
                                 "rank r holds chunk r and chunk 2·cp−1−r", "check_layout"),
    "the diagonal seen whole": Bug([('"causal" if k_chunk == q_chunk', '"full" if k_chunk == q_chunk')],
                                   "zig-zag", "fail", "block_mode(0, 0) = 'full', expected 'causal'",
                                   "check_layout"),
    "a merge that overflows": Bug([(MERGE, "    new = torch.log(torch.exp(lse) + torch.exp(block_lse))\n")],
                                  "merge", "fail", "overflows float64", "check_merge"),
    "send and receive in separate groups": Bug([(POST, SEPARATE)], "NCCL order", "deadlock",
                                               "a send completes only when its receive runs", "replay"),
    "K/V attributed to the rank it came from, not the one it left": Bug(
        [("kv, source = arriving, (source - 1) % n", "kv, source = arriving, (source + 1) % n")],
        "ring_attention", "fail", "a block attributed to the wrong chunk", "check_ring"),
    "never rotated (every rank keeps its own K/V)": Bug(
        [("kv, source = arriving, (source - 1) % n", "source = source")],
        "ring_attention", "fail", "this rank attended only to its own K/V", "check_ring"),
    "an error of 1e-8": Bug([(MERGE, MERGE + "    new = new + 1e-8\n")], "ring_attention", "fail",
                            "max rel diff", "check_ring"),
    "masked blocks computed and thrown away": Bug(
        [("                if (mode := block_mode(qc, kc)) is None:\n                    continue\n",
          "                if (mode := block_mode(qc, kc)) is None:\n"
          "                    attend_block(q[..., rows, :], kv[0], kv[1], \"full\")\n"
          "                    continue\n")],
        "ring_attention", "fail", "skip the blocks block_mode says None for", "check_work"),
    "a last transfer nobody uses": Bug(
        [("        if step < n - 1:\n            arriving", "        if True:\n            arriving"),
         ("        if step < n - 1:\n            for work", "        if True:\n            for work")],
        "ring_attention", "fail", "not the last step's (nobody uses it)", "check_ring_bytes"),
    "waits before it attends": Bug(
        [(POST, POST + "            for work in works:\n                work.wait()\n"),
         ("            for work in works:\n                work.wait()\n            kv, source",
          "            kv, source")],
        "ring_attention", "fail", "the ring waits before it attends", "check_overlap"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    assert_bug_diagnosed(5, tmp_path, BUGS[bug], "context")


def test_every_check_has_a_planted_bug():
    assert_checks_covered(5, BUGS, "context")


def test_a_ring_that_waits_first_only_from_its_second_step_is_caught():
    """Every post restarts the count: a wait right after the second post, with the first step
    overlapped, is still a wait before attending."""
    from types import SimpleNamespace

    from common.labs.grader import Fail
    from tensor_parallel.lab_context_check import check_overlap

    def run(events):
        return [SimpleNamespace(config={"world": 2}, ranks=[{"events": events}])]

    assert isinstance(check_overlap(run(["post", "attend", "wait", "post", "wait", "attend"])), Fail)
    assert not isinstance(check_overlap(run(["post", "attend", "wait", "post", "attend", "wait"])), Fail)
