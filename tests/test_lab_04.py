"""Lab 04 (one FSDP unit): the grader passes the reference, stops the skeleton at once, and names
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
    assert_reference_passes(4)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(4)


PRE = "    def _pre_backward(self, grad: torch.Tensor) -> None:\n        self.gather()\n"
COMPUTE = "        output = self.module(*args, **kwargs)\n        self.free()\n"
DIVIDE = "        out.div_(self.world)\n"
GATHER = "        all_gather(self.full.data, self.shard.detach(), self.group)\n"
ACCUMULATE = "        self.shard.grad = out if self.shard.grad is None else self.shard.grad + out\n"
BUGS = {
    "missing 1/N": Bug([(DIVIDE, "")], "one SGD step", "fail", "a missing 1/n", "check_grads"),
    "an error of 1e-8": Bug([(DIVIDE, DIVIDE.replace("self.world", "self.world * (1 + 1e-8)"))],
                            "one SGD step", "fail", "max rel diff 1e-08", "check_grads"),
    "group= ignored by the all-gather": Bug(
        [(GATHER, GATHER.replace(", self.group)", ")"))], "one SGD step", "hang",
        "mismatched collectives at world 3 cut into groups [2, 1]"),
    "the neighbour's slice": Bug(
        [("start = self.rank * self.shard_numel", "start = (self.rank + 1) % self.world * self.shard_numel")],
        "the shard", "fail", "holds rank 1's slice flat[5:10], not rank 0's", "check_shards"),
    "no padding (S = ⌊P/N⌋)": Bug([("-(-self.numel // self.world)", "self.numel // self.world")],
                                  "the shard", "raised", "S = ⌈P/N⌉ (pad with zeros)"),
    "backward without a gather": Bug([(PRE, PRE.replace("self.gather()", "pass"))], "hold memory", "raised",
                                     "gather again in the pre-backward hook"),
    "freed before the module computed": Bug([(COMPUTE, "\n".join(COMPUTE.splitlines()[::-1]) + "\n")],
                                            "hold memory", "raised", "free after it"),
    "never freed after backward": Bug([(ACCUMULATE + "        self.free()\n", ACCUMULATE)], "hold memory",
                                      "fail", "after backward, full still holds", "check_life"),
    "full.grad kept across steps": Bug([("grad, full.grad = full.grad, None", "grad = full.grad")],
                                       "three AdamW", "fail", "right at step 1, wrong after", "check_grads"),
    "the shard a view of the whole flat buffer": Bug(
        [("flat[start : start + self.shard_numel].clone()", "flat[start : start + self.shard_numel]")],
        "the shard", "fail", "a view of the whole flat buffer", "check_shards"),
    "shard.grad overwritten, not accumulated": Bug(
        [(ACCUMULATE, "        self.shard.grad = out\n")], "two backwards", "fail",
        "overwritten, not accumulated", "check_grads"),
    "ReduceOp.AVG": Bug([("dist.ReduceOp.SUM", "dist.ReduceOp.AVG"), (DIVIDE, "")],
                        "2 all-gathers", "fail", "reduce-scatter with ReduceOp.AVG", "check_collectives"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    assert_bug_diagnosed(4, tmp_path, BUGS[bug])


def test_every_check_has_a_planted_bug():
    assert_checks_covered(4, BUGS)


def test_a_shard_viewing_a_flat_buffer_of_two_shards_is_caught_at_world_2():
    """At world 2 a view of the whole flat buffer holds 2·S elements of storage: one too many."""
    import torch

    from fsdp.lab_hints import shard_error

    flat = torch.arange(8, dtype=torch.float64)
    shard = flat[0:4].clone()
    view_storage = 2 * 4 * shard.element_size()
    error = shard_error({"parameters": ["shard"], "shard": shard, "storage": view_storage}, flat, 8, 0, 2)
    assert error is not None and "storage of" in error[0]
    own = {"parameters": ["shard"], "shard": shard, "storage": 4 * shard.element_size()}
    assert shard_error(own, flat, 8, 0, 2) is None
