"""Lab 02 (ring reduce-scatter, all-gather, all-reduce): the grader passes the reference, stops the
skeleton at once, reports a deadlocking send/recv order before any real run, and names each
typical bug."""

from __future__ import annotations

import pytest

from tests.labs import assert_bug_diagnosed, assert_reference_passes, assert_skeleton_fails_fast


def test_reference_passes_every_property():
    assert_reference_passes(2)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(2)


RS_CHUNKS = "        send, recv = (rank - 1 - step) % n, (rank - 2 - step) % n\n"
EXCHANGE = "    for work in dist.batch_isend_irecv(ops):\n"
BUGS = {  # name: (edits of lab_solution.py, the property that shows it, status, words of the hint)
    "remainder dropped (uneven chunks)": (
        [("length // n + (1 if i < length % n else 0)", "length // n")],
        "chunk_bounds", "fail", "uneven chunks"),
    "send before receive, in separate groups": (
        [(EXCHANGE, "    for work in dist.batch_isend_irecv(ops[:1]) + dist.batch_isend_irecv(ops[1:]):\n")],
        "NCCL order", "deadlock", "a send completes only when its receive runs"),
    "reduce-scatter chunk index one step off": (
        [(RS_CHUNKS, "        send, recv = (rank - step) % n, (rank - 1 - step) % n\n")],
        "reduce-scatter:", "fail", "the chunk index rule"),
    "receive overwrites instead of adding": (
        [("        chunks[recv] += arrived\n", "        chunks[recv].copy_(arrived)\n")],
        "reduce-scatter:", "fail", "replaced your copy instead of being added"),
    "AVG without the 1/n": (
        [("        mine /= dist.get_world_size(group)\n", "        pass\n")],
        "all-reduce =", "fail", "a missing 1/n"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    edits, only, status, hint = BUGS[bug]
    assert_bug_diagnosed(2, tmp_path, edits, only, status, hint)
