"""05_tensor_parallel/train.py on a MoE model: expert parallelism (train_expert.py) trains tiny-moe
exactly like one device (float64, --check at 1e-10, with clipping and gradient accumulation), the
meter's all-to-all bytes equal the formula from the routing counts, the report's load imbalance
is the max/mean of its rows per rank; bad --ep / --tp / --cp fail on every rank before any collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from common.dist import init_distributed
from common.model import get_config
from common.training import train
from tensor_parallel import train as tp_train
from tensor_parallel.train_expert import load_imbalance
from tests.harness import RankError


def train_cli(argv: list[str]) -> dict:
    args = tp_train.parse_args(argv)
    run = tp_train.validate(args, dist.get_world_size())
    ctx = init_distributed()
    return train(run, ctx, tp_train.build(run, ctx), 5)


@pytest.mark.parametrize("world, flags", [(2, ["--ep", "2", "--clip-grad", "0.5", "--grad-accum", "2"]),
                                          (4, ["--ep", "2"])])
def test_train_check_passes_and_report_matches_formulas(pools, world, flags):
    argv = ["--model", "tiny-moe", "--dtype", "float64", "--steps", "2", "--global-batch", "4",
            "--seq-len", "8", "--check", "--data", "synthetic", "--log-every", "0", *flags]
    reports = pools.run(world, train_cli, argv)
    report = reports[0]
    assert all(r["check_passed"] for r in reports)
    assert report["max_grad_diff"] < 1e-12
    assert report["mesh"] == {"dp": world, "ep": 2}
    assert report["comm_bytes_per_rank"] == pytest.approx(report["comm_bytes_formula"], rel=1e-12)
    for r in reports:  # each rank's all-to-all bytes: its own routing counts
        sent = r["comm"]["all_to_all_single"]["bytes"]
        assert sent == pytest.approx(r["ep_all_to_all_bytes_formula"], rel=1e-12) and sent > 0
    for key in ("params", "grads", "optimizer"):
        assert report["memory"][key] == pytest.approx(report["memory_formula"][key], rel=1e-12), key
    for step, imbalance in zip(report["ep_rows_per_dispatch"], report["ep_load_imbalance"], strict=True):
        assert len(step) == 7 * (2 if "--grad-accum" in flags else 1)  # MoE layers × micro-batches
        groups = [rows[i:i + 2] for rows in step for i in range(0, world, 2)]
        assert imbalance == pytest.approx(max(max(g) / (sum(g) / 2) for g in groups))


def test_load_imbalance_is_the_worst_dispatch_not_the_step_sum():
    """Two MoE layers on EP 2, each with a straggler: layer 0 sends 3 rows to rank 0 and 1 to
    rank 1, layer 1 the reverse. Each all-to-all waits for its busiest rank (3 against a mean of
    2): 1.5, where the step's summed rows (4, 4) would say 1.0."""
    rows = torch.tensor([[[3.0, 1.0], [1.0, 3.0]], [[2.0, 2.0], [2.0, 2.0]]])  # [step, layer, rank]
    assert load_imbalance(rows, 2).tolist() == [1.5, 1.0]
    assert load_imbalance(rows.repeat(1, 1, 2), 2).tolist() == [1.5, 1.0]  # two EP groups


def validate_argv(argv: list[str], n_experts: int | None = None):
    args = tp_train.parse_args(argv)
    args.cfg = get_config("tiny-moe", n_experts=n_experts) if n_experts else None
    return tp_train.validate(args, dist.get_world_size())


@pytest.mark.parametrize("argv, n_experts, message", [
    (["--model", "tiny-moe", "--ep", "3"], None,
     r"--model tiny-moe: --ep 3 does not divide the 4 ranks it borrows .*: use one of --ep 1, 2, 4"),
    (["--model", "tiny-moe", "--ep", "4"], 6,
     r"--ep 4 does not divide the 6 experts .*: use one of --ep 1, 2$"),
    (["--model", "tiny-moe", "--tp", "2"], None,
     r"mixture-of-experts model: .* not --tp 2 --cp 1 .*use --tp 1 --cp 1"),
    (["--model", "tiny-moe", "--cp", "2"], None, r"not --tp None --cp 2 .*use --tp 1 --cp 1"),
    (["--model", "tiny", "--ep", "2"], None, r"--ep 2 with --model tiny: the model has no experts"),
])
def test_bad_input_fails_on_every_rank_before_any_collective(pools, argv, n_experts, message):
    with pytest.raises(RankError, match=message) as info:
        pools.run(4, validate_argv, argv, n_experts)
    assert sorted(info.value.errors) == [0, 1, 2, 3]


def expert_groups_of_the_strategy(argv: list[str]) -> dict[str, list[int]]:
    strategy = tp_train.build(tp_train.validate(tp_train.parse_args(argv), dist.get_world_size()),
                              init_distributed())
    ranks = dist.get_process_group_ranks
    return {"ep": ranks(strategy.ep_group), "dispatch": ranks(strategy.layers[0].dispatcher.group),
            "replicas": ranks(strategy.replica_group)}


def test_the_all_to_alls_run_over_consecutive_ranks(pools):
    """EP groups strided across the replica train the same numbers while every all-to-all crosses
    nodes: only the ranks say it. On 4 ranks, --ep 2: the all-to-alls over {0,1} and {2,3} (one
    node of 2), the expert gradients averaged over {0,2} and {1,3}."""
    argv = ["--model", "tiny-moe", "--ep", "2", "--data", "synthetic", "--global-batch", "4"]
    for rank, groups in enumerate(pools.run(4, expert_groups_of_the_strategy, argv)):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert groups == {"ep": pair, "dispatch": pair, "replicas": [rank % 2, rank % 2 + 2]}, (rank, groups)
