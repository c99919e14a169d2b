"""Lab 05 (tensor parallelism): the grader passes the reference, stops the skeleton at once, names
each typical bug, and passes a lab whose optional parts are left unwritten."""

from __future__ import annotations

import pytest

from tests.labs import (
    assert_bug_diagnosed,
    assert_reference_passes,
    assert_skeleton_fails_fast,
    graded,
    plant,
)


def test_reference_passes_every_property():
    assert_reference_passes(5)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(5)


F_REDUCE = "        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)\n"
ROW_FORWARD = ("        y = reduce_from_tp_region(F.linear(x, self.weight), self.group)\n"
               "        return y if self.bias is None else y + self.bias\n")
BIAS_FIRST = "        return reduce_from_tp_region(F.linear(x, self.weight, self.bias), self.group)\n"
F_AND_G = ("    return CopyToTP.apply(x, group)\n\n\n"
           "def reduce_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:\n"
           "    return ReduceFromTP.apply(x, group)\n")
SWAP = F_AND_G.replace("CopyToTP", "@").replace("ReduceFromTP", "CopyToTP").replace("@", "ReduceFromTP")
COLUMN_SPLIT = ("        t, r = dist.get_world_size(group), dist.get_rank(group)\n"
                "        if linear.out_features % t:")
MAPPED = "ColumnParallelLinear(mlp.{0}, group, input_is_mapped=True)"
BUGS = {  # name: (edits of lab_solution.py, the property that shows it, status, words of the hint)
    "f's backward without its all-reduce": (
        [(F_REDUCE, "")], "f and g", "fail", "f's backward must all-reduce"),
    "f and g swapped": (
        [(F_AND_G, SWAP)],
        "f and g", "fail", "f and g are swapped"),
    "g where the column layer needs f": (
        [("x = copy_to_tp_region(x, self.group)", "x = reduce_from_tp_region(x, self.group)")],
        "ColumnParallelLinear", "fail", "X was summed over the ranks in forward"),
    "column layer split over the world, not its group": (
        [(COLUMN_SPLIT, COLUMN_SPLIT.replace("(group)", "()"))],
        "ColumnParallelLinear", "fail", "not over the 2 of the TP group"),
    "row weight sliced along the wrong dimension": (
        [("linear.weight.detach()[:, cols]", "linear.weight.detach()[cols]")],
        "RowParallelLinear", "fail", "sliced along the wrong dimension"),
    "bias added before the row reduction": (
        [(ROW_FORWARD, BIAS_FIRST)],
        "RowParallelLinear", "fail", "the bias is counted 2×"),
    "f in each column layer of the MLP": (
        [(MAPPED.format("w1"), "ColumnParallelLinear(mlp.w1, group)"),
         (MAPPED.format("w3"), "ColumnParallelLinear(mlp.w3, group)"),
         ("    mlp.register_forward_pre_hook(_f_on_input(group))\n", "")],
        "parallelize_mlp", "fail", "f in each of the 2 column layers"),
    "merge that overflows": (
        [("    lse = torch.logaddexp(lse1, lse2)", "    lse = torch.log(torch.exp(lse1) + torch.exp(lse2))")],
        "merge_attention", "fail", "overflows float64"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    edits, only, status, hint = BUGS[bug]
    assert_bug_diagnosed(5, tmp_path, edits, only, status, hint)


def test_an_optional_part_left_unwritten_does_not_fail_the_lab(tmp_path):
    merge = "    lse = torch.logaddexp(lse1, lse2)\n"
    path = plant(5, tmp_path, [(merge, "    raise NotImplementedError('merge_attention')\n" + merge)])
    verdicts, text = graded(5, path, only="merge_attention")
    assert [(v.status, v.optional, v.failed) for v in verdicts] == [("todo", True, False)], text
    assert "(optional) merge_attention" in text and "optional: 0/1 pass" in text, text
