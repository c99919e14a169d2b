"""07's bytes against their formulas where recomputation and experts meet (comm_formulas.py,
experts.all_to_all_formula): under full recomputation a MoE block's recomputed forward runs its
experts' FSDP unit again (one more all-gather per backward, FULL_SHARD only: SHARD_GRAD_OP keeps
the gathered weights) and dispatches again (every second all-to-all a rerun, its backward not
doubled); selective recomputation reruns neither. tests/test_3d_experts.py checks the bytes
without recomputation only. One step of tiny-moe on 4 ranks (dp_shard 4, ep 2: the experts'
units over dp_shard_mod_ep, 2 ranks), every report group's bytes and EP's all-to-all bytes equal
to their formulas, per mode and sharding strategy.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from common.dist import init_distributed
from common.training import build_and_train
from parallel3d import train as train3d

RUNS = [("full", "FULL_SHARD"), ("full", "SHARD_GRAD_OP"), ("selective", "FULL_SHARD")]


def metered(runs: list[tuple[str, str]]) -> list[dict]:
    """train.py's path on every rank, once per (recomputation, sharding strategy)."""
    out = []
    for mode, sharding in runs:
        argv = ["--model", "tiny-moe", "--dp-shard", "4", "--ep", "2", "--activation-checkpointing", mode,
                "--sharding-strategy", sharding, "--dtype", "float64", "--steps", "1", "--global-batch", "4",
                "--seq-len", "8", "--data", "synthetic", "--log-every", "0"]
        run = train3d.validate(train3d.parse_args(argv), dist.get_world_size())
        report = build_and_train(run, init_distributed(), train3d.build, 7)
        out.append({k: v for k, v in report.items() if k.startswith(("comm_bytes_", "ep_all_to_all"))}
                   | {"all_to_all": report["comm"]["all_to_all_single"]["bytes"],
                      "ops": {op: c["calls"] for op, c in report["comm"].items()}})
    return out


def test_recomputation_with_experts_bytes_equal_their_formulas(pools):
    reports = pools.run(4, metered, RUNS)
    for rank, per_run in enumerate(reports):
        for (mode, sharding), r in zip(RUNS, per_run, strict=True):
            where = f"rank {rank}, {mode} recomputation, {sharding}"
            groups = sorted(k for k in r if f"{k}_formula" in r)
            assert groups == ["comm_bytes_dp_shard", "comm_bytes_dp_shard_mod_ep", "comm_bytes_ep"], where
            for key in groups:
                assert r[key] == pytest.approx(r[f"{key}_formula"], rel=1e-12), (where, key)
            assert r["comm_bytes_per_rank"] == pytest.approx(r["comm_bytes_formula"], rel=1e-12), where
            sent = r["all_to_all"]
            assert sent == pytest.approx(r["ep_all_to_all_bytes_formula"], rel=1e-12) and sent > 0, where
    full, kept, selective = reports[0]
    assert full["comm_bytes_dp_shard_mod_ep"] > selective["comm_bytes_dp_shard_mod_ep"]  # the rerun is there
    assert sum(full["ops"].values()) > sum(kept["ops"].values()), (full["ops"], kept["ops"])
