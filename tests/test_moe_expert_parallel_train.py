"""05_tensor_parallel/train.py on a MoE model: expert parallelism (train_expert.py), alone or with
every expert cut over TP (moe_tensor_parallel.py, with and without SP), trains tiny-moe exactly
like one device (float64, --check at 1e-10, with clipping and gradient accumulation), the meter's
all-to-all bytes equal the formula from the routing counts, the report's load imbalance is the
max/mean of its rows per rank; bad --ep / --tp / --cp fail on every rank before any collective."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from common.dist import init_distributed
from common.model import get_config
from common.training import train
from tensor_parallel import train as tp_train
from tests.harness import RankError


def train_cli(argv: list[str]) -> dict:
    args = tp_train.parse_args(argv)
    layout = tp_train.validate(args, dist.get_world_size())
    ctx = init_distributed()
    return train(args, ctx, tp_train.build(args, ctx, layout), layout, 5)


@pytest.mark.parametrize("world, flags", [(2, ["--ep", "2", "--clip-grad", "0.5", "--grad-accum", "2"]),
                                          (4, ["--ep", "2"]),
                                          (4, ["--tp", "2", "--sequence-parallel", "--clip-grad", "0.05"])])
def test_train_check_passes_and_report_matches_formulas(pools, world, flags):
    argv = ["--model", "tiny-moe", "--dtype", "float64", "--steps", "2", "--global-batch", "4",
            "--seq-len", "8", "--check", "--data", "synthetic", "--log-every", "0", *flags]
    reports = pools.run(world, train_cli, argv)
    report = reports[0]
    assert all(r["check_passed"] for r in reports)
    assert report["max_grad_diff"] < 1e-12
    tp = 2 if "--tp" in flags else 1
    assert report["mesh"] == ({"dp": world, "ep": 2} if tp == 1 else {"dp": 2, "tp": 2, "ep": 2})
    assert report["comm_bytes_per_rank"] == pytest.approx(report["comm_bytes_formula"], rel=1e-12)
    for r in reports:  # each rank's all-to-all bytes: its own routing counts
        sent = r["comm"]["all_to_all_single"]["bytes"]
        assert sent == pytest.approx(r["ep_all_to_all_bytes_formula"], rel=1e-12) and sent > 0
    for key in ("params", "grads", "optimizer"):
        assert report["memory"][key] == pytest.approx(report["memory_formula"][key], rel=1e-12), key
    rows = report["ep_rows_per_rank"]
    for step, imbalance in zip(rows, report["ep_load_imbalance"], strict=True):
        groups = [step[i:i + 2] for i in range(0, world // tp, 2)]
        assert imbalance == pytest.approx(max(max(g) / (sum(g) / 2) for g in groups))


def validate_argv(argv: list[str], n_experts: int | None = None):
    args = tp_train.parse_args(argv)
    args.cfg = get_config("tiny-moe", n_experts=n_experts) if n_experts else None
    return tp_train.validate(args, dist.get_world_size())


@pytest.mark.parametrize("argv, n_experts, message", [
    (["--model", "tiny-moe", "--ep", "3"], None,
     r"--ep 3 does not divide the 4 ranks it borrows .*: use one of --ep 1, 2, 4$"),
    (["--model", "tiny-moe", "--ep", "4"], 6,
     r"--ep 4 does not divide the 6 experts .*: use one of --ep 1, 2$"),
    (["--model", "tiny-moe"], 6, r"--ep 4 does not divide the 6 experts .*\(--ep defaults to every"),
    (["--model", "tiny-moe", "--tp", "2", "--ep", "4"], None,
     r"--ep 4 does not divide the 2 ranks it borrows .*: use one of --ep 1, 2$"),
    (["--model", "tiny-moe", "--cp", "2"], None, r"mixture-of-experts model: not --cp 2 .*use --cp 1"),
    (["--model", "tiny", "--ep", "2"], None, r"--ep 2 with --model tiny: the model has no experts"),
])
def test_bad_input_fails_on_every_rank_before_any_collective(pools, argv, n_experts, message):
    with pytest.raises(RankError, match=message) as info:
        pools.run(4, validate_argv, argv, n_experts)
    assert sorted(info.value.errors) == [0, 1, 2, 3]
