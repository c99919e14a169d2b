"""Chapter 05: `plan_table` (the TP plan as data, which the lesson's figures draw) says what
`apply_tp_plan` really does: for every module the plan names, the split dim and the number of
distinct pieces of its weight equal the TPShard of the cut model, and the collective it names at
the module's boundary is the one the cut module runs (f or the all-gather on its input, g or the
reduce-scatter on its output, an SP norm's weight gradient summed)."""

from __future__ import annotations

import pytest
import torch

from common.kernel.model import build_model, get_config
from tensor_parallel import SequenceParallelRMSNorm, apply_tp_plan
from tensor_parallel.parallelize import plan_table

# tiny with 2 K/V heads (replicated at t = 4) and a vocab t does not divide (padded head)
CONFIG = get_config("tiny", n_kv_heads=2, vocab_size=30, n_layers=2)


def cut_model_rows(sp: bool) -> list[dict]:
    """Runs on every rank: the model cut by LLAMA_TP_PLAN over the world, described row by row
    like plan_table (dim and shards from its TPShards, comm from the cut modules)."""
    model = build_model(CONFIG, dtype=torch.float64)
    table = plan_table(build_model(CONFIG, device="meta"), torch.distributed.get_world_size(),
                       sequence_parallel=sp)
    specs = apply_tp_plan(model, None, sequence_parallel=sp)
    rows = []
    for row in table:
        module = model.get_submodule(row["name"])
        spec = specs.get(f"{row['name']}.weight")
        comm = ""
        if row["style"] == "ColumnSplit" and not module.input_is_mapped:
            comm = "all-gather" if module.sequence_parallel else "f"
        elif row["style"] in ("RowSplit", "VocabSplit"):
            comm = "reduce-scatter" if module.sequence_parallel else "g"
        elif row["style"] == "MappedInput" and module._forward_pre_hooks:
            comm = "all-gather" if sp else "f"
        elif isinstance(module, SequenceParallelRMSNorm):
            comm = "grad all-reduce"
        rows.append({"name": row["name"], "style": row["style"], "comm": comm,
                     "dim": None if spec is None else spec.dim,
                     "shards": 1 if spec is None or spec.dim is None else spec.num_shards,
                     "shape": row["shape"], "table": row})
    return rows


@pytest.mark.parametrize("sp", [False, True])
def test_plan_table_says_what_apply_tp_plan_does(pools, sp):
    rows = pools.run(4, cut_model_rows, sp)[0]
    assert {r["name"].split(".")[-1] for r in rows} >= {"wq", "wk", "wo", "w2", "output", "tok_embeddings"}
    wrong = [(r["name"], {k: r["table"][k] for k in ("dim", "shards", "comm")},
              {k: r[k] for k in ("dim", "shards", "comm")})
             for r in rows if any(r["table"][k] != r[k] for k in ("dim", "shards", "comm"))]
    assert not wrong, f"plan_table (first) differs from the cut model (second): {wrong}"
    shards = {r["name"]: r["shards"] for r in rows}
    assert shards["layers.0.attention.wk"] == 2 and shards["layers.0.attention.wq"] == 4


def test_plan_table_refuses_what_apply_tp_plan_refuses():
    with pytest.raises(ValueError, match="4 heads do not split over the TP size 3"):
        plan_table(build_model(CONFIG, device="meta"), 3)
