"""Lab 05 (tensor parallelism): the grader passes the reference, stops the skeleton at once, names
each typical bug at the check that catches it, passes a lab whose optional parts are left
unwritten and fails one whose optional part is written wrong."""

from __future__ import annotations

import pytest

from tests.labs import (
    Bug,
    assert_bug_diagnosed,
    assert_checks_covered,
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
ROW_CHECK = "        if linear.in_features % t:\n            raise ValueError("
MAPPED = "ColumnParallelLinear(mlp.{0}, group, input_is_mapped=True)"
LSE = "    lse = torch.logaddexp(lse1, lse2)\n"
BUGS = {
    "the row weight a view of the full weight": Bug(
        [("linear.weight.detach()[:, cols].clone()", "linear.weight.detach()[:, cols]")],
        "RowParallelLinear", "fail", "a view of the full weight", "check_weights"),
    "f's backward without its all-reduce": Bug(
        [(F_REDUCE, "")], "f and g", "fail", "f's backward must all-reduce", "check_fg"),
    "an error of 1e-8": Bug([(F_REDUCE, F_REDUCE + "        grad *= 1 + 1e-8\n")], "f and g", "fail",
                            "max rel diff 1e-08", "check_fg"),
    "f and g swapped": Bug([(F_AND_G, SWAP)], "f and g", "fail", "f and g are swapped", "check_fg"),
    "g where the column layer needs f": Bug(
        [("x = copy_to_tp_region(x, self.group)", "x = reduce_from_tp_region(x, self.group)")],
        "ColumnParallelLinear", "fail", "X was summed over the ranks in forward", "check_outputs"),
    "column layer split over the world, not its group": Bug(
        [(COLUMN_SPLIT, COLUMN_SPLIT.replace("(group)", "()"))],
        "ColumnParallelLinear", "fail", "not over the 2 of the TP group", "check_weights"),
    "a weight of the wrong shape on one rank (no KeyError: 'output' in the grader)": Bug(
        [("rows = slice(r * linear.out_features // t, (r + 1) * linear.out_features // t)",
          "rows = slice(r * linear.out_features // t, (r + 1) * linear.out_features // t - (r == 1))")],
        "ColumnParallelLinear", "fail", "TP 2 (ranks 0–1 of 4), rank 1, split output: weight shape [5, 8]",
        "check_weights"),
    "row weight sliced along the wrong dimension": Bug(
        [("linear.weight.detach()[:, cols]", "linear.weight.detach()[cols]")],
        "RowParallelLinear", "fail", "sliced along the wrong dimension", "check_weights"),
    "bias added before the row reduction": Bug(
        [(ROW_FORWARD, BIAS_FIRST)], "RowParallelLinear", "fail", "the bias is counted 2×", "check_outputs"),
    "an uneven row split not refused": Bug(
        [(ROW_CHECK, "        if False:\n            raise ValueError(")], "RowParallelLinear", "fail",
        "raise ValueError naming the features", "check_refused"),
    "f in each column layer of the MLP": Bug(
        [(MAPPED.format("w1"), "ColumnParallelLinear(mlp.w1, group)"),
         (MAPPED.format("w3"), "ColumnParallelLinear(mlp.w3, group)"),
         ("    mlp.register_forward_pre_hook(_f_on_input(group))\n", "")],
        "parallelize_mlp", "fail", "f in each of the 2 column layers", "check_counts"),
    "f on attention's input and in each column layer": Bug(
        [("ColumnParallelLinear(getattr(attention, name), group, input_is_mapped=True)",
          "ColumnParallelLinear(getattr(attention, name), group)")],
        "parallelize_attention", "fail", "input grad 2× too large", "check_sublayer"),
    "a weight off by 1e-6 in the MLP's row layer (the 2-layer training alone)": Bug(
        [("    mlp.w2 = RowParallelLinear(mlp.w2, group)\n",
          "    mlp.w2 = RowParallelLinear(mlp.w2, group)\n    mlp.w2.weight.data.mul_(1 + 1e-6)\n")],
        "a 2-layer TP LLaMA", "fail", "joined: grad of", "check_train"),
    "sequence parallelism's gather without its backward": Bug(
        [("        return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None\n",
          "        return grad.chunk(dist.get_world_size(ctx.group), ctx.dim)[dist.get_rank(ctx.group)], "
          "None, None\n")],
        "sequence parallelism", "fail", "this rank's slice of its own gradient only", "check_sp"),
    "merge that overflows": Bug(
        [(LSE, "    lse = torch.log(torch.exp(lse1) + torch.exp(lse2))\n")],
        "merge_attention", "fail", "overflows float64", "check_merge"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    assert_bug_diagnosed(5, tmp_path, BUGS[bug])


def test_every_check_has_a_planted_bug():
    assert_checks_covered(5, BUGS)


def test_an_optional_part_left_unwritten_does_not_fail_the_lab(tmp_path):
    path = plant(5, tmp_path, [(LSE, "    raise NotImplementedError('merge_attention')\n" + LSE)])
    verdicts, text = graded(5, path, only="merge_attention")
    assert [(v.status, v.optional, v.failed) for v in verdicts] == [("todo", True, False)], text
    assert "(optional) merge_attention" in text and "optional: 0/1 pass" in text, text
