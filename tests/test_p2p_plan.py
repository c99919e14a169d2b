"""Point-to-point plans under NCCL's rules (common/kernel/p2p_plan.py): the checker itself, chapter 06's
plan for every schedule, the grouping it replaced as the negative control, and the groups that real
gloo runs of 06 and 07 post, recorded and replayed with the same checker.

Pure-Python parts replay every valid schedule × p ≤ 8 × m ≤ 16 × v ≤ 4 exhaustively (well under a
second); the recorded parts run one step on 2-, 4- and 8-rank pools."""

from __future__ import annotations

import inspect
import math
from dataclasses import replace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from common.dist import init_distributed
from common.kernel.model import LlamaConfig, get_config
from common.kernel.p2p_plan import P2PRecorder, PlannedOp, find_deadlock, normalize, plan_from_records
from common.training import rank_micro_batches
from parallel3d import train as train3d
from pipeline.p2p import exchanges, p2p_plan, segments
from pipeline.schedules import SCHEDULES, Schedule, make_schedule, schedule_error
from pipeline.train import PipelineStrategy
from pipeline.train import validate as pp_validate
from tests.equivalence import TrainSpec, spec_args

# --- the checker ------------------------------------------------------------------------------


def test_two_ranks_sending_first_in_separate_groups_deadlock_and_one_group_does_not():
    lone = {0: [[("send", 1)], [("recv", 1)]], 1: [[("send", 0)], [("recv", 0)]]}
    found = find_deadlock(lone)
    assert found is not None and found.reason == "deadlock"
    assert set(found.stuck) == {0, 1} and "rank 0 group 0" in str(found) and "rank 1 group 0" in str(found)
    assert find_deadlock({0: [[("send", 1), ("recv", 1)]], 1: [[("recv", 0), ("send", 0)]]}) is None
    assert find_deadlock({0: [[("send", 1)], [("recv", 1)]], 1: [[("recv", 0)], [("send", 0)]]}) is None


def test_matching_is_fifo_per_pair_and_ops_complete_one_by_one():
    # the k-th send 0→1 meets the k-th receive at 1 from 0: sizes say which met which
    fifo = {0: [[("send", 1, 8)], [("send", 1, 4)]], 1: [[("recv", 0, 8), ("recv", 0, 4)]]}
    assert find_deadlock(fifo) is None
    swapped = {0: [[("send", 1, 8)], [("send", 1, 4)]], 1: [[("recv", 0, 4), ("recv", 0, 8)]]}
    assert "8 B (group 0) meets a receive of 4 B" in find_deadlock(swapped).reason
    # a three-rank chain: rank 1's group finishes op by op as 0 and 2 reach their groups
    chain = {0: [[("send", 1)]], 1: [[("recv", 0), ("send", 2)]], 2: [[("recv", 1)]]}
    assert find_deadlock(chain) is None
    # a cycle through three ranks: each sends before it receives, in separate groups
    ring = {r: [[("send", (r + 1) % 3)], [("recv", (r - 1) % 3)]] for r in range(3)}
    assert set(find_deadlock(ring).stuck) == {0, 1, 2}


def test_unmatched_and_mismatched_plans_are_reported():
    assert "1 sends 0→1 but 0 receives" in find_deadlock({0: [[("send", 1)]], 1: []}).reason
    assert "receives 1→0 but no send" in find_deadlock({0: [[("recv", 1)]], 1: []}).reason
    assert "meets a receive" in find_deadlock({0: [[("send", 1, 2)]], 1: [[("recv", 0, 3)]]}).reason
    assert normalize({0: [[PlannedOp("send", 1), ("recv", 1, 0, "x")]]})[0][0][1].label == "x"


# --- chapter 06's plan for every schedule -------------------------------------------------------


def all_schedules(p_max: int = 8, m_max: int = 16, v_max: int = 4) -> list[Schedule]:
    return [make_schedule(name, p, m, v) for name in SCHEDULES for p in range(1, p_max + 1)
            for m in range(1, m_max + 1) for v in (range(1, v_max + 1) if name == "interleaved" else [1])
            if schedule_error(name, p, m, v) is None]


ALL = all_schedules()


def test_every_schedule_plan_is_deadlock_free_under_nccl_rules():
    assert len(ALL) == 524  # gpipe 128 + 1f1b 128 + interleaved 168 + zb 100
    found = {(s.name, s.p, s.m, s.v): d for s in ALL if (d := find_deadlock(p2p_plan(s, 4096)))}
    assert not found, next(iter(found.items()))


def test_plan_carries_every_message_once_and_in_action_order():
    for s in ALL:
        for rank in range(s.p):
            posted = [(x.kind, x.microbatch, x.src_stage) for ex in exchanges(s, rank) for x in ex.recvs]
            needed = [(x.kind, x.microbatch, x.src_stage) for a in s.actions[rank]
                      if (x := s.recv(rank, a)) is not None and x.src != rank]
            assert posted == needed
            assert [a for seg in segments(s, rank) for a in seg] == list(s.actions[rank])


def unlabelled(plan: dict) -> dict:
    return {r: [tuple(replace(op, label="") for op in g) for g in groups]
            for r, groups in normalize(plan).items()}


def sends_with_next_receive(s: Schedule) -> dict[int, list[list[tuple]]]:
    """The grouping the pipeline once had: action i's sends posted with action i+1's receive."""
    plan = {}
    for rank in range(s.p):
        groups, pending = [], []
        for action in s.actions[rank]:
            if (x := s.recv(rank, action)) is not None and x.src != rank:
                pending.append(("recv", x.src, 1))
            if pending:
                groups.append(pending)
            pending = []
            if (x := s.send(rank, action)) is not None and x.dst != rank:
                pending.append(("send", x.dst, 1))
        if pending:
            groups.append(pending)
        plan[rank] = groups
    return plan


def test_negative_control_the_old_grouping_deadlocks_every_interleaved_steady_state():
    """p = 2, m = 4, v = 2: rank 0's send-only group waits for rank 1, which is stuck in a group
    sending a gradient rank 0 receives only later. Every interleaved configuration with a steady
    state (m > p, p ≥ 2, v ≥ 2) deadlocks; GPipe, 1F1B, ZB-H1 do not, and for them the new plan
    is the old grouping (Megatron's send_forward_recv_backward pairing)."""
    found = find_deadlock(sends_with_next_receive(make_schedule("interleaved", 2, 4, 2)))
    assert found is not None and found.reason == "deadlock" and set(found.stuck) == {0, 1}
    steady = [s for s in ALL if s.name == "interleaved" and s.p >= 2 and s.m > s.p and s.v >= 2]
    assert len(steady) == 57
    assert sum(find_deadlock(sends_with_next_receive(s)) is not None for s in steady) == 57
    others = [s for s in ALL if s.name != "interleaved"]
    assert not any(find_deadlock(sends_with_next_receive(s)) for s in others)
    for s in others:
        assert unlabelled(p2p_plan(s)) == normalize(sends_with_next_receive(s)), s


# --- what real gloo runs post: 06 -----------------------------------------------------------------


def recorded_step(strategy, spec: TrainSpec) -> tuple[dict, int, int]:
    """One forward_backward of `strategy` under the recorder: (groups per communicator, the
    message bytes, the .item() calls made inside the executor's step)."""
    tokens = spec.data().global_batch(0, spec.global_batch)
    micro = rank_micro_batches(strategy, tokens, spec.micro_batch, torch.device("cpu"))
    inputs, targets = zip(*((t[:, :-1], t[:, 1:]) for t in micro), strict=True)
    item, items = torch.Tensor.item, []

    def counted_item(tensor: torch.Tensor):
        items.append(tensor.shape)
        return item(tensor)

    with P2PRecorder() as recorder, mock.patch.object(torch.Tensor, "item", counted_item):
        strategy.executor.run(inputs, targets, [torch.arange(x.shape[1]) for x in inputs])
    executor = strategy.executor
    nbytes = math.prod(executor.shape) * torch.empty((), dtype=executor.dtype).element_size()
    return dict(recorder.groups), nbytes, len(items)


def pipeline_run(schedule: str, m: int, v: int) -> tuple[dict, int, int]:
    p = dist.get_world_size()
    spec = TrainSpec(cfg=get_config("tiny", n_layers=p * v), world_size=p, dp=1, global_batch=m,
                     micro_batch=1, seq_len=4, steps=1)
    run = pp_validate(spec_args(spec, schedule=schedule, microbatches=m, virtual_stages=v, partition=None,
                                timeline_png=None), p)
    return recorded_step(PipelineStrategy(run, init_distributed()), spec)


def expected(plan: dict, ranks: tuple[int, ...]) -> dict:
    """The pure plan in global ranks, without labels (the recorder sees no labels)."""
    return {ranks[r]: [tuple(PlannedOp(op[0], ranks[op[1]], op[2]) for op in g) for g in groups]
            for r, groups in plan.items()}


@pytest.mark.parametrize("schedule, p, m, v", [("gpipe", 2, 3, 1), ("1f1b", 2, 4, 1), ("zb", 2, 4, 1),
                                               ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2),
                                               ("1f1b", 4, 6, 1)])
def test_recorded_06_groups_are_the_plan_and_deadlock_free(pools, schedule, p, m, v):
    results = pools.run(p, pipeline_run, schedule, m, v)
    plans = plan_from_records([groups for groups, _, _ in results])
    ranks = tuple(range(p))
    assert list(plans) == [ranks]  # one communicator: the world
    assert find_deadlock(plans[ranks]) is None
    assert plans[ranks] == expected(p2p_plan(make_schedule(schedule, p, m, v), results[0][1]), ranks)
    assert all(items == 0 for _, _, items in results)  # no host sync inside the step


# --- what real gloo runs post: 07's 3D trainer ---------------------------------------------------


def trainer_3d_run(dp: int, pp: int, tp: int) -> tuple[dict, int, int]:
    cfg = LlamaConfig(dim=16, n_layers=2 * pp, n_heads=4, n_kv_heads=2, vocab_size=32, multiple_of=8)
    spec = TrainSpec(cfg=cfg, world_size=dp * pp * tp, dp=dp, global_batch=dp * 2 * pp, micro_batch=1,
                     seq_len=4, steps=1, optimizer="sgd")
    args = spec_args(spec, dp=dp, pp=pp, tp=tp, schedule="interleaved", microbatches=None,
                     virtual_stages=None, sequence_parallel=False, activation_checkpointing="none",
                     sharding_strategy="FULL_SHARD", lr_schedule="constant", warmup_steps=None,
                     min_lr_ratio=0.1)
    config = train3d.validate(args, spec.world_size)
    assert config.grad_accum == 2 * pp  # the default m = 2·pp
    return recorded_step(train3d.Parallel3DStrategy(config, init_distributed()), spec)


def test_recorded_3d_interleaved_groups_are_the_plan_per_communicator(pools):
    """dp 2 × pp 2 × tp 2 with --schedule interleaved (v = 2, m = 2·pp = 4): each pipeline
    communicator's recorded groups, with global peer ranks, replay without deadlock and equal
    06's plan mapped to the communicator's global ranks."""
    dp, pp, tp = 2, 2, 2
    results = pools.run(dp * pp * tp, trainer_3d_run, dp, pp, tp)
    plans = plan_from_records([groups for groups, _, _ in results])
    assert len(plans) == dp * tp and all(len(ranks) == pp for ranks in plans)
    assert sorted(r for ranks in plans for r in ranks) == list(range(dp * pp * tp))
    schedule = make_schedule("interleaved", pp, 2 * pp, 2)
    for ranks, plan in plans.items():
        assert ranks != tuple(range(pp))  # a sub-group: peers must be global to match below
        assert find_deadlock(plan) is None, (ranks, find_deadlock(plan))
        assert plan == expected(p2p_plan(schedule, results[ranks[0]][1]), ranks)
    assert all(items == 0 for _, _, items in results)


def test_3d_default_interleaved_plans_are_deadlock_free_for_larger_meshes():
    """The 3D trainer's pipeline is 06's executor on each pp communicator: its default interleaved
    plans (m = 2·pp and more micro-batches, v 2-4, pp up to 8) replay without deadlock."""
    for pp in range(2, 9):
        for v in (2, 3, 4):
            for m in (2 * pp, 3 * pp, 4 * pp):
                assert find_deadlock(p2p_plan(make_schedule("interleaved", pp, m, v))) is None


def test_interleaved_with_one_rank_hands_messages_over_locally():
    plan = p2p_plan(make_schedule("interleaved", 1, 4, 3))
    assert plan == {0: []}


def lone_sends_and_receives() -> dict:
    """Every spelling of a lone isend/irecv (positional, dst=/src=, group_dst= on a subgroup) is
    recorded as a group of one, with global peers (WORLD and the subgroup share the key (0, 1))."""
    init_distributed()
    rank, sub = dist.get_rank(), dist.new_group([0, 1])
    x = torch.full((3,), float(rank), dtype=torch.float64)
    with P2PRecorder() as recorder:
        if rank == 0:
            dist.isend(x, 1).wait()
            dist.isend(x, dst=1, group=sub).wait()
            dist.irecv(torch.empty(2), src=1, group=sub).wait()
        else:
            dist.irecv(torch.empty(3, dtype=torch.float64), 0).wait()
            dist.irecv(torch.empty(3, dtype=torch.float64), src=0, group=sub).wait()
            peer = {"group_dst": 0} if _has_group_peer() else {"dst": 0}  # group_dst: torch >= 2.7
            dist.isend(torch.ones(2), group=sub, **peer).wait()
    dist.destroy_process_group(sub)
    return dict(recorder.groups)


def _has_group_peer() -> bool:
    return "group_dst" in inspect.signature(dist.isend).parameters


def test_recorder_records_lone_isend_irecv_in_every_spelling(pools):
    records = pools.run(2, lone_sends_and_receives)
    plans = plan_from_records(records)
    world = plans[(0, 1)]
    assert [[(op.kind, op.peer, op.nbytes) for op in g] for g in world[0]] == [
        [("send", 1, 24)], [("send", 1, 24)], [("recv", 1, 8)]]
    assert [[(op.kind, op.peer, op.nbytes) for op in g] for g in world[1]] == [
        [("recv", 0, 24)], [("recv", 0, 24)], [("send", 0, 8)]]
    assert find_deadlock(world) is None
