"""Lab 03 (the ZeRO-1 step): the grader passes the reference, stops the skeleton at once, and names
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
    assert_reference_passes(3)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(3)


MASTER = "        self.master = flat[self.start : self.end].clone()"
STEP = "        self.optim.step()\n"
GATHER = "        all_gather_single(flat, self.master.detach().to(dtype), group=self.group)\n"
DIVIDE = "        self.master.grad.div_(self.world)\n"
CLIP_REDUCE = "        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)\n"
SCALE = "        self.master.grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))\n"
COEF = "(max_norm / (norm + 1e-6))"
BUGS = {
    "missing 1/N": Bug([(DIVIDE, "")], "AdamW steps", "fail", "a missing 1/n", "check_grads"),
    "an error of 1e-8": Bug([(DIVIDE, DIVIDE.replace("self.world", "self.world * (1 + 1e-8)"))],
                            "AdamW steps", "fail", "max rel diff 1e-08", "check_grads"),
    "rank counted from 1": Bug(
        [(MASTER, "        self.master = flat.view(self.world, -1)[self.rank - 1].clone()")],
        "AdamW steps", "fail", "shard offset off by one slice", "check_master"),
    "a bf16 master for bf16 parameters": Bug(
        [("torch.promote_types(self.params[0].dtype, torch.float32)", "self.params[0].dtype")],
        "AdamW steps", "fail", "keeps a torch.bfloat16 master", "check_master"),
    "padding left out": Bug([("    s = -(-numel // world)", "    s = numel // world")],
                            "owner's slice", "fail", "padding", "check_owner_slices"),
    "master a view of a whole copy": Bug([(MASTER, MASTER.removesuffix(".clone()"))],
                                         "memory", "fail", "whole-model master copy", "check_memory"),
    "inner optimizer over the model": Bug(
        [("optimizer_class([self.master], **defaults)", "optimizer_class(self.params, **defaults)")],
        "memory", "fail", "optimizer state for the whole model", "check_memory"),
    "an all-reduce of the flat buffer, then the slice": Bug(
        [("        reduce_scatter_single(self.master.grad, flat, group=self.group)  # SUM\n",
          "        dist.all_reduce(flat, group=self.group)\n"
          "        self.master.grad.copy_(flat[self.start : self.end])\n")],
        "memory", "fail", "that is DDP", "check_collectives"),
    "optimizer state lost between steps": Bug([(STEP, "        self.optim.state.clear()\n" + STEP)],
                                              "AdamW steps", "fail", "right after step 1, wrong after step 2",
                                              "check_params"),
    "all-gather before the step": Bug([(STEP, ""), (GATHER, GATHER + STEP)], "AdamW steps", "fail",
                                      "the all-gather sent stale values", "check_params"),
    "clipping by the local shard's norm": Bug([(CLIP_REDUCE, "")], "clipping", "fail",
                                              "clipping by the local shard's norm", "check_norm"),
    "the clipped norm returned": Bug(
        [("        return norm\n", "        return norm * torch.clamp(max_norm / (norm + 1e-6), max=1.0)\n")],
        "clipping", "fail", "that is the norm after clipping", "check_norm"),
    "clipping's all-reduce over the world, not the group": Bug(
        [(CLIP_REDUCE, CLIP_REDUCE.replace(", group=self.group", ""))], "clipping", "fail",
        "summed over the whole world, not over your group", "check_norm"),
    "a clip without min(1, ·) (small gradients scaled up)": Bug(
        [(SCALE, SCALE.replace("torch.clamp(max_norm / (norm + 1e-6), max=1.0)", COEF))],
        "clipping", "fail", "min(1, ·) caps the coefficient at 1", "check_clipped"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    assert_bug_diagnosed(3, tmp_path, BUGS[bug])


def test_every_check_has_a_planted_bug():
    assert_checks_covered(3, BUGS)
