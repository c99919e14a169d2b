"""Lab 05 · experts (expert parallelism's all-to-alls and gradients): the grader passes the
reference, stops the skeleton at once, rejects a plan NCCL would hang on before any real run, and
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
    assert_reference_passes(5, "expert")


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(5, "expert")


FORWARD = "        out = x.new_empty(sum(out_splits), x.shape[1])\n"
APPLY = "        arrived = AllToAll.apply(rows, out_splits, in_splits, self.group)  # source-major\n"
EXCHANGE = ("    received = torch.empty_like(counts)\n"
            "    dist.all_to_all_single(received, counts, group=group)\n"
            "    return received.view(ep, -1).tolist()  # the host read: the splits must be on the host\n")
GATHERED = ("    every, r = counts.new_empty(ep * counts.numel()), dist.get_rank(group)\n"
            "    dist.all_gather_into_tensor(every, counts, group=group)\n"
            "    return every.view(ep, ep, -1)[:, r].tolist()\n")
DIVIDE = "            p.grad.div_(n)\n"
BUGS = {
    "no exchange for a rank that receives no row": Bug(
        [(FORWARD, "        if sum(out_splits) == 0:\n            return x.new_empty(0, x.shape[1])\n"
                   + FORWARD)],
        "the all-to-all plan", "fail", "rule 1: group [0, 1] posts different all-to-alls", "check_plan"),
    "dispatch's splits swapped": Bug(
        [(APPLY, APPLY.replace("out_splits, in_splits", "in_splits, out_splits"))],
        "the all-to-all plan", "fail", "rule 2", "check_plan"),
    "the whole count vector read as the local one": Bug(
        [(EXCHANGE, EXCHANGE.replace("view(ep, -1)", "view(-1, ep)"))],
        "exchange_counts", "fail", "received[s][e] is what rank s sends my local expert e", "check_counts"),
    "rows handed to the experts source-major": Bug(
        [("        return arrived[regroup], [", "        return arrived, [")],
        "dispatch and combine", "fail", "regroup them expert-major", "check_dispatch"),
    "combine without undoing the regrouping": Bug(
        [("outputs[torch.argsort(regroup)]", "outputs")],
        "dispatch and combine", "fail", "combine undoes the regrouping", "check_layer"),
    "an error of 1e-8": Bug(
        [("        return unpermute(back, plan)\n", "        return unpermute(back, plan) * (1 + 1e-8)\n")],
        "dispatch and combine", "fail", "max rel diff", "check_layer"),
    "the counts all-gathered (every rank's whole vector)": Bug(
        [(EXCHANGE, GATHERED)], "dispatch and combine", "fail", "not every row to every rank", "check_bytes"),
    "experts divided by their group's size, not the world's": Bug(
        [(DIVIDE, "            p.grad.div_(dist.get_world_size(over))\n")], "reduce_gradients", "fail",
        "then divide by the world's size, 4", "check_reduction"),
    "experts reduced over the world (other experts' gradients added)": Bug(
        [("        over = expert_group if", "        over = group if")], "reduce_gradients", "fail",
        "all-reduce it over expert_group", "check_reduction"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    assert_bug_diagnosed(5, tmp_path, BUGS[bug], "expert")


def test_every_check_has_a_planted_bug():
    assert_checks_covered(5, BUGS, "expert")
