"""Lab 04 (one FSDP unit): the grader passes the reference, stops the skeleton at once, and names
each typical bug."""

from __future__ import annotations

import pytest

from tests.labs import assert_bug_diagnosed, assert_reference_passes, assert_skeleton_fails_fast


def test_reference_passes_every_property():
    assert_reference_passes(4)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(4)


PRE = "    def _pre_backward(self, grad: torch.Tensor) -> None:\n        self.gather()\n"
COMPUTE = "        output = self.module(*args, **kwargs)\n        self.free()\n"
BUGS = {  # name: (edits of lab_solution.py, the property that shows it, status, words of the hint)
    "missing 1/N": ([("        out.div_(self.world)\n", "")], "one SGD step", "fail", "a missing 1/n"),
    "the neighbour's slice": (
        [("start = self.rank * self.shard_numel", "start = (self.rank + 1) % self.world * self.shard_numel")],
        "the shard", "fail", "holds rank 1's slice flat[5:10], not rank 0's"),
    "no padding (S = ⌊P/N⌋)": ([("-(-self.numel // self.world)", "self.numel // self.world")],
                               "the shard", "fail", "pad the flat with zeros"),
    "backward without a gather": ([(PRE, PRE.replace("self.gather()", "pass"))],
                                  "hold memory", "fail", "gather again in the pre-backward hook"),
    "freed before the module computed": ([(COMPUTE, "\n".join(COMPUTE.splitlines()[::-1]) + "\n")],
                                         "hold memory", "fail", "free after it"),
    "full.grad kept across steps": ([("grad, full.grad = full.grad, None", "grad = full.grad")],
                                    "three AdamW", "fail", "right at step 1, wrong after"),
    "ReduceOp.AVG": ([("dist.ReduceOp.SUM", "dist.ReduceOp.AVG"), ("        out.div_(self.world)\n", "")],
                     "2 all-gathers", "fail", "reduce-scatter with ReduceOp.AVG"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    edits, only, status, hint = BUGS[bug]
    assert_bug_diagnosed(4, tmp_path, edits, only, status, hint)
