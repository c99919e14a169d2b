"""Lab 07 (the 3D recipe and clipping over the mesh): the grader passes the reference, stops the
skeleton at once, and names each typical bug."""

from __future__ import annotations

import pytest

from tests.labs import assert_bug_diagnosed, assert_reference_passes, assert_skeleton_fails_fast


def test_reference_passes_every_property():
    assert_reference_passes(7)


def test_untouched_skeleton_fails_fast_naming_what_is_missing():
    assert_skeleton_fails_fast(7)


COUNTED = "                if tp_specs[p.name].counted_here:"
ALL_REDUCE = "    dist.all_reduce(total, op=dist.ReduceOp.SUM)"
TP = "        tp_specs.update(parallelize_llama(chunk, mesh.tp_group))\n"
WRAP = """    return [FSDP(chunk, process_group=mesh.dp_cp_group, device_id=device, shard_init_fn=tp_piece,
                 auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
            for chunk in chunks], tp_specs
"""
WRAP_THEN_TP = """    wrapped = [FSDP(chunk, process_group=mesh.dp_cp_group, device_id=device,
                    shard_init_fn=tp_piece, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
               for chunk in chunks]
    for chunk in wrapped:
        tp_specs.update(parallelize_llama(chunk, mesh.tp_group))
    return wrapped, tp_specs
"""
BUGS = {  # name: (edits of lab_solution.py, the property that shows it, status, words of the hint)
    "TP copies counted on every TP rank": (
        [(COUNTED, "                if True:")], "clip_global_norm", "fail",
        "TP copies counted on every TP rank"),
    "each rank clips by its own norm": (
        [(ALL_REDUCE, "    pass")], "clip_global_norm", "fail", "each rank clipped by its own norm"),
    "FSDP over the DP group only with CP": (
        [("process_group=mesh.dp_cp_group", "process_group=mesh.dp_group")], "parallelize", "fail",
        "sharded over the DP ranks only"),
    "TP applied after FSDP": (
        [(TP, ""), ("return local_piece(init(name), tp_specs[name])", "return init(name)"),
         (WRAP, WRAP_THEN_TP)],
        "parallelize", "fail", "tensor parallelism applied after FSDP"),
    "no context parallelism in the attention": (
        [("        if mesh.cp > 1:\n            apply_context_parallel(chunk, mesh.cp_group)\n", "")],
        "context parallelism", "fail", "must attend over the CP ring"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    edits, only, status, hint = BUGS[bug]
    assert_bug_diagnosed(7, tmp_path, edits, only, status, hint)
