"""05_tensor_parallel/train_expert.py (`make run-5-ep`): expert parallelism, alone or with every
expert cut over TP (moe_tensor_parallel.py, with and without SP), trains tiny-moe exactly like one
device (float64, --check at 1e-10, with clipping and gradient accumulation), the meter's
all-to-all bytes equal the formula from the routing counts, the report's load imbalance is the
max/mean of its rows per rank; bad --ep / --tp and a dense model fail on every rank before any
collective (05's dense train.py refuses a MoE model naming this demo: tests/test_moe_training.py)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.dist import init_distributed
from common.kernel.model import get_config
from common.training import train
from tensor_parallel import train_expert as ep_train
from tensor_parallel.expert_parallel import load_imbalance
from tests.harness import RankError


def train_cli(argv: list[str]) -> dict:
    args = ep_train.parse_args(argv)
    run = ep_train.validate(args, dist.get_world_size())
    ctx = init_distributed()
    return train(run, ctx, ep_train.build(run, ctx), 5)


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
    for step, imbalance in zip(report["ep_rows_per_dispatch"], report["ep_load_imbalance"], strict=True):
        assert len(step) == 7 * (2 if "--grad-accum" in flags else 1)  # MoE layers × micro-batches
        groups = [rows[i:i + 2] for rows in step for i in range(0, world // tp, 2)]  # the dp ranks
        assert imbalance == pytest.approx(max(max(g) / (sum(g) / 2) for g in groups))


def test_load_imbalance_is_the_worst_dispatch_not_the_step_sum():
    """Two MoE layers on EP 2, each with a straggler: layer 0 sends 3 rows to rank 0 and 1 to
    rank 1, layer 1 the reverse. Each all-to-all waits for its busiest rank (3 against a mean of
    2): 1.5, where the step's summed rows (4, 4) would say 1.0."""
    rows = torch.tensor([[[3.0, 1.0], [1.0, 3.0]], [[2.0, 2.0], [2.0, 2.0]]])  # [step, layer, rank]
    assert load_imbalance(rows, 2).tolist() == [1.5, 1.0]
    assert load_imbalance(rows.repeat(1, 1, 2), 2).tolist() == [1.5, 1.0]  # two EP groups


def tp_bf16_routing_differences(promote: bool) -> list[str]:
    """A bf16 MoE layer cut over TP 2 (TensorParallelMoE: bf16 weights and inputs, mixed precision's
    compute copy) against the float32 routing of the same bf16 inputs and router weight: which of
    experts, kept slots, gate weights (cast to bf16) and aux loss differ. promote=False plants the
    bug: every float32 promotion dropped (the logits, gates and aux in bf16)."""
    from common.kernel.moe import LocalDispatcher, route
    from tensor_parallel.moe_tensor_parallel import TensorParallelMoE
    from tests.test_moe import make_layer, moe_config

    class Recording(LocalDispatcher):
        def dispatch(self, x, plan):
            self.plan = plan
            return super().dispatch(x, plan)

    cfg = moe_config(E=8, k=2, cf=1.25, dim=16, hidden=8, coef=0.1)
    full, x = make_layer(cfg, B=8, T=64, seed=5)
    full, x = full.to(torch.bfloat16), x.detach().to(torch.bfloat16)
    layer = TensorParallelMoE(full, group=None)
    layer.dispatcher = Recording()
    with mock.patch.object(torch, "promote_types", torch.promote_types if promote else lambda a, b: a):
        layer(x)
    got, logits = layer.dispatcher.plan, F.linear(x.float(), full.router.weight.float())
    plan, balance = route(logits, 2, "softmax", 1.25)
    checks = {"experts": torch.equal(got.experts, plan.experts), "kept": torch.equal(got.kept, plan.kept),
              "weights": got.weights.dtype == torch.bfloat16
              and torch.equal(got.weights, plan.weights.to(torch.bfloat16)),
              "aux": torch.equal(layer.last_aux_loss, cfg.aux_loss_coef * balance.mean())}
    return sorted(k for k, same in checks.items() if not same)


def test_experts_under_tp_route_in_float32_under_bf16(pools):
    """05's TensorParallelMoE routes as common/kernel/moe.py's layer does: the router's logits, gates,
    top-k and aux loss in float32 whatever the activations' dtype; dropping the promotion is caught."""
    assert pools.run(2, tp_bf16_routing_differences, True) == [[], []]
    planted = pools.run(2, tp_bf16_routing_differences, False)
    assert all({"aux", "experts", "weights"} <= set(d) for d in planted), planted


def validate_argv(argv: list[str], n_experts: int | None = None):
    args = ep_train.parse_args(argv)
    args.cfg = get_config("tiny-moe", n_experts=n_experts) if n_experts else None
    return ep_train.validate(args, dist.get_world_size())


@pytest.mark.parametrize("argv, n_experts, message", [
    (["--model", "tiny-moe", "--ep", "3"], None,
     r"--model tiny-moe: --ep 3 does not divide the 4 ranks it borrows .*: use one of --ep 1, 2, 4$"),
    (["--model", "tiny-moe", "--ep", "4"], 6,
     r"--ep 4 does not divide the 6 experts .*: use one of --ep 1, 2$"),
    (["--model", "tiny-moe"], 6, r"--ep 4 does not divide the 6 experts .*\(--ep defaults to every"),
    (["--model", "tiny-moe", "--tp", "2", "--ep", "4"], None,
     r"--ep 4 does not divide the 2 ranks it borrows .*: use one of --ep 1, 2$"),
    (["--model", "tiny", "--ep", "2"], None, r"--model tiny has no experts: .* a dense one: make run-5$"),
])
def test_bad_input_fails_on_every_rank_before_any_collective(pools, argv, n_experts, message):
    with pytest.raises(RankError, match=message) as info:
        pools.run(4, validate_argv, argv, n_experts)
    assert sorted(info.value.errors) == [0, 1, 2, 3]



def expert_groups_of_the_strategy(argv: list[str]) -> dict[str, list[int]]:
    strategy = ep_train.build(ep_train.validate(ep_train.parse_args(argv), dist.get_world_size()),
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
