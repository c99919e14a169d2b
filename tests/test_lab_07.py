"""Lab 07 (the 3D recipe and clipping over the mesh): the grader passes the reference, stops the
skeleton at once, names each typical bug at the check that catches it, and does not blame context
parallelism for a failure the clipping property already explained."""

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
COEF = "    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)\n"
PER_CHUNK = ("def clip_global_norm(chunks, tp_specs, mesh, max_norm):\n"
             "    return [_clip([c], tp_specs, mesh, max_norm) for c in chunks][-1]\n\n\ndef _clip(")
BUGS = {
    "clipped per virtual stage": Bug(
        [("def clip_global_norm(", PER_CHUNK)], "clip_global_norm", "fail", "with 2 virtual stages",
        "check_norms"),
    "TP copies counted on every TP rank": Bug(
        [(COUNTED, "                if True:")], "clip_global_norm", "fail",
        "TP copies counted on every TP rank", "check_norms"),
    "each rank clips by its own norm": Bug(
        [(ALL_REDUCE, "    pass")], "clip_global_norm", "fail", "each rank clipped by its own norm",
        "check_norms"),
    "the clipped norm returned": Bug(
        [("    return norm\n", "    return norm * coef\n")], "clip_global_norm", "fail",
        "that is the norm after clipping", "check_norms"),
    "an error of 1e-8": Bug([("    return norm\n", "    return norm * (1 + 1e-8)\n")], "clip_global_norm",
                            "fail", "+1e-08", "check_norms"),
    "a clip without min(1, ·) (small gradients scaled up)": Bug(
        [(COEF, "    coef = max_norm / (norm + 1e-6)\n")], "clip_global_norm", "fail",
        "min(1, ·) caps the coefficient at 1", "check_params"),
    "FSDP over the DP group only with CP": Bug(
        [("process_group=mesh.dp_cp_group", "process_group=mesh.dp_group")], "parallelize", "fail",
        "sharded over the DP ranks only", "check_holdings"),
    "the seed ignored": Bug([("init = initializer(model.cfg, seed)", "init = initializer(model.cfg, 0)")],
                            "parallelize", "fail", "dp2×pp2 seed 1", "check_holdings"),
    "TP applied after FSDP": Bug(
        [(TP, ""), ("return local_piece(init(name), tp_specs[name])", "return init(name)"),
         (WRAP, WRAP_THEN_TP)], "parallelize", "raised", "tensor parallelism applied after FSDP?"),
    "no context parallelism in the attention": Bug(
        [("        if mesh.cp > 1:\n            apply_context_parallel(chunk, mesh.cp_group)\n", "")],
        "context parallelism", "fail", "must attend over the CP ring", "check_grads"),
    "FSDP keeping the weights between forward and backward (SHARD_GRAD_OP)": Bug(
        [("import FSDP, ModuleWrapPolicy", "import FSDP, ModuleWrapPolicy, ShardingStrategy"),
         ("auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))",
          "auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),\n"
          "                 sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)")],
        "clip_global_norm", "fail", "over its FSDP (dp·cp) group, the formula", "check_bytes"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_gets_its_diagnosis(bug, tmp_path):
    assert_bug_diagnosed(7, tmp_path, BUGS[bug])


def test_every_check_has_a_planted_bug():
    assert_checks_covered(7, BUGS)


def test_a_clipping_failure_is_not_blamed_on_context_parallelism(tmp_path):
    bug = BUGS["each rank clips by its own norm"]._replace(only=("clip_global_norm", "context parallelism"))
    verdicts = assert_bug_diagnosed(7, tmp_path, bug)
    later = "\n".join(verdicts[-1].lines())
    assert verdicts[-1].failed and "probably the same cause as ✗ \"clip_global_norm" in later, later
    assert "attend over the CP ring" not in later, later
