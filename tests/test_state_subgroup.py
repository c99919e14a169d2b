"""State calls under a process group other than the world: 4 ranks cut into the groups [0, 1] and
[2, 3], each training its own data, so that a call that gathers over the world, sends to a group
rank read as a global one, or asks the world for a rank gets another group's state (or fails).

03's ZeroOptimizer: `consolidate_state_dict(to)` is a collective over the optimizer's group; group
rank `to` (global 1 and 3 for to=1, 0 and 2 for to=0) then holds, through `state_dict()`, what a
single-device torch AdamW of its group keeps (float64, 1e-10), the other raises torch's error
naming its own group rank, and a `to` beyond the group is refused on every rank. 04's FSDP:
`full_state_dict()` on group rank 0 only, `state_dict()` and `optim_state_dict(model, optim,
group=...)` on every rank, each the single-device one's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp import FullyShardedDataParallel, ModuleWrapPolicy
from zero import ZeroOptimizer

GROUPS = ([0, 1], [2, 3])
ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def batch(step: int, group_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group its own data: a state gathered from the other group differs."""
    g = torch.Generator().manual_seed(100 * group_index + step)
    return (torch.randn(4, 6, generator=g, dtype=torch.float64),
            torch.randn(4, 3, generator=g, dtype=torch.float64))


def reference(group_index: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One device, the group's whole batches, torch's AdamW: 2 steps."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(2):
        x, y = batch(step, group_index)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def worst(a: dict, b: dict) -> float:
    """The largest relative difference over the tensors of two nested dicts of the same keys."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    out = 0.0
    for k, v in a.items():
        if isinstance(v, dict):
            out = max(out, worst(v, b[k]))
        elif torch.is_tensor(v):
            out = max(out, ((v - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item())
        else:
            assert v == b[k], (k, v, b[k])
    return out


def subgroup() -> tuple[int, object, int]:
    """(the index of this rank's group, the group, this rank in it); every rank makes both."""
    groups = [dist.new_group(ranks) for ranks in GROUPS]
    index = dist.get_rank() // 2
    return index, groups[index], dist.get_rank(groups[index])


def zero_state(stage: int, to: int) -> dict:
    index, group, me = subgroup()
    model = make_model()
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, process_group=group, stage=stage, **ADAMW)
    for step in range(2):
        x, y = batch(step, index)
        F.mse_loss(model(x[2 * me : 2 * me + 2]), y[2 * me : 2 * me + 2]).backward()
        opt.step()
        opt.zero_grad()
    opt.consolidate_state_dict(to=to)
    try:
        saved = opt.state_dict()
    except RuntimeError as error:
        return {"error": str(error)}
    _, ref = reference(index)
    want = ref.state_dict()
    return {"diff": worst(saved["state"], want["state"]),
            "groups": [{k: v for k, v in g.items() if k in ADAMW} for g in saved["param_groups"]]}


def test_zero_consolidates_on_the_groups_rank_to(pools):
    for stage, to in ((1, 1), (2, 0)):
        results = pools.run(4, zero_state, stage, to)
        for rank, result in enumerate(results):
            if rank % 2 == to:
                assert result.get("diff", 1.0) <= 1e-10, (stage, to, rank, result)
                assert result["groups"] == [{k: ADAMW[k] for k in ADAMW}], result
            else:
                assert f"`consolidate_state_dict(to={rank % 2})`" in result.get("error", ""), (rank, result)


def zero_bad_to() -> str:
    _, group, _ = subgroup()
    opt = ZeroOptimizer(make_model().parameters(), torch.optim.AdamW, process_group=group, stage=2, **ADAMW)
    try:
        opt.consolidate_state_dict(to=2)  # a rank of the world, not of the group of 2
    except ValueError as error:
        return str(error)
    return "no error"


def test_zero_refuses_a_to_beyond_its_group_on_every_rank(pools):
    assert pools.run(4, zero_bad_to) == ["consolidate_state_dict(to=2): a rank of the optimizer's "
                                         "process group, 0 … 1"] * 4


def fsdp_state() -> dict:
    index, group, me = subgroup()
    model = FullyShardedDataParallel(make_model(), process_group=group,
                                     auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(2):
        x, y = batch(step, index)
        F.mse_loss(model(x[2 * me : 2 * me + 2]), y[2 * me : 2 * me + 2]).backward()
        opt.step()
        opt.zero_grad()
    full = model.full_state_dict()
    every = model.state_dict()
    osd = FullyShardedDataParallel.optim_state_dict(model, opt, group=group)
    ref_model, ref_opt = reference(index)
    want = ref_opt.state_dict()
    names = [n for n, _ in ref_model.named_parameters()]
    want_state = {names[i]: s for i, s in want["state"].items()}
    return {"full": None if full is None else worst(full, ref_model.state_dict()),
            "every": worst(dict(every), ref_model.state_dict()), "optim": worst(osd["state"], want_state)}


def test_fsdp_state_calls_gather_over_the_models_group(pools):
    for rank, result in enumerate(pools.run(4, fsdp_state)):
        assert result["every"] <= 1e-10 and result["optim"] <= 1e-10, (rank, result)
        assert (result["full"] is None) == (rank % 2 == 1), (rank, result)
        assert rank % 2 == 1 or result["full"] <= 1e-10, (rank, result)
