"""Lab 02 (ring reduce-scatter, all-gather, all-reduce): the grader passes the reference, stops the
skeleton at once, reports a deadlocking send/recv order before any real run, and names each
typical bug at the check that catches it."""

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
    assert_reference_passes(2)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(2)


RS_CHUNKS = "        send, recv = (rank - 1 - step) % n, (rank - 2 - step) % n\n"
EXCHANGE = "    for work in dist.batch_isend_irecv(ops):\n"
RING_OF = "    rank, n, right, left = ring_of(group)\n    chunks = [tensor"
ADD = "        chunks[recv] += arrived\n"
GATHER = "        exchange(chunks[(rank - step) % n], chunks[(rank - 1 - step) % n], right, left, group)\n"
WHOLE = ("        whole, j = torch.empty_like(out), (rank - 1 - step) % n\n"
         "        exchange(out.clone(), whole, right, left, group)\n"
         "        chunks[j].copy_(whole[chunk_bounds(length, n)[j][0] : chunk_bounds(length, n)[j][1]])\n")
BUGS = {
    "remainder dropped (uneven chunks)": Bug(
        [("length // n + (1 if i < length % n else 0)", "length // n")],
        "chunk_bounds", "fail", "uneven chunks", "check_layouts"),
    "send before receive, in separate groups": Bug(
        [(EXCHANGE, "    for work in dist.batch_isend_irecv(ops[:1]) + dist.batch_isend_irecv(ops[1:]):\n")],
        "NCCL order", "deadlock", "a send completes only when its receive runs", "replay"),
    "reduce-scatter chunk index one step off": Bug(
        [(RS_CHUNKS, "        send, recv = (rank - step) % n, (rank - 1 - step) % n\n")],
        "reduce-scatter:", "fail", "the chunk index rule", "check_reduce_scatter"),
    "receive overwrites instead of adding": Bug(
        [(ADD, "        chunks[recv].copy_(arrived)\n")],
        "reduce-scatter:", "fail", "replaced your copy instead of being added", "check_reduce_scatter"),
    "an error of 1e-8": Bug([(ADD, "        chunks[recv] += arrived * (1 + 1e-8)\n")],
                            "reduce-scatter:", "fail", "max rel diff", "check_reduce_scatter"),
    "group= ignored (a ring over the world)": Bug(
        [(RING_OF, RING_OF.replace("(group)", "()"))], "reduce-scatter:", "raised",
        "world 4 cut into groups [1, 3], rank 0 raised ValueError: Global rank 1 is not part of group"),
    "all-gather's own chunk never put in place": Bug(
        [("    chunks[rank].copy_(chunk)\n", "")], "all-gather:", "fail",
        "put your own chunk in its place first", "check_all_gather"),
    "all-gather sends the whole buffer each step": Bug(
        [(GATHER, WHOLE)], "all-gather:", "fail", "More means whole tensors", "check_ring_bytes"),
    "AVG without the 1/n": Bug(
        [("        mine /= dist.get_world_size(group)\n", "        pass\n")],
        "all-reduce =", "fail", "a missing 1/n", "check_all_reduce"),
    "SUM averaged too (DDP's gradients n× too small)": Bug(
        [("    if op == AVG:\n", "    if True:\n")], "DDP on your ring", "fail", "3× too small", "check_ddp"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    assert_bug_diagnosed(2, tmp_path, BUGS[bug])


def test_every_check_has_a_planted_bug():
    assert_checks_covered(2, BUGS)
