"""ZeroOptimizer's checkpoints in torch's per-parameter optimizer format, consolidated.

`state_dict` gathers every rank's shards whole on every rank (one `all_gather_object`: it fits
teaching sizes; torch's ZeroRedundancyOptimizer consolidates on one rank, DeepSpeed saves shards),
then cuts each flat slice back into per-parameter tensors at the layout's offsets;
`load_state_dict` is the inverse: each rank cuts its slice (or its whole parameters) out of the
full tensors, from any world size or from a single-device torch optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .flat import FlatGroup

if TYPE_CHECKING:
    from .optimizer import ZeroOptimizer


def _copy(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value


def consolidated_state_dict(opt: ZeroOptimizer) -> dict[str, Any]:
    """{"state": {index: {key: full-shape tensor}}, "param_groups": [...]}, as a single-device
    torch optimizer writes it, on every rank (a collective: each rank's shards are gathered
    whole, so it fits teaching sizes; torch consolidates on one rank, DeepSpeed saves shards).
    bf16 adds each parameter's fp32 "master"."""
    local = {}
    for t, gi, i in opt.pieces:
        state = dict(opt.optim.state.get(t, {}))
        if opt.master_dtype != opt.compute_dtype:
            state["master"] = t
        local[gi, i] = {k: _copy(v).cpu() if torch.is_tensor(v) else v for k, v in state.items()}
    gathered = [None] * opt.world
    dist.all_gather_object(gathered, local, group=opt.group)
    index = {id(p): n for n, p in enumerate(p for group in opt.param_groups for p in group["params"])}
    state = {}
    for gi, g in enumerate(opt.flat_groups):
        if opt.ownership == "parameter":
            for i, p in enumerate(g.params):
                found = [s[gi, i] for s in gathered[: opt.shard_world] if (gi, i) in s]
                if found and found[0]:
                    state[index[id(p)]] = found[0]
            continue
        shards = [s[gi, None] for s in gathered[: opt.shard_world]]
        sliced = {k for k, v in shards[0].items() if torch.is_tensor(v) and v.shape == (g.shard_size,)}
        whole = {k: torch.cat([s[k] for s in shards]) if k in sliced else v for k, v in shards[0].items()}
        for p, off in zip(g.params, g.offsets, strict=True):
            if whole:  # scalars ("step") copied: each parameter's own, as torch's optimizers keep them
                state[index[id(p)]] = {k: v[off : off + p.numel()].view(p.shape).clone() if k in sliced
                                       else _copy(v) for k, v in whole.items()}
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [index[id(p)] for p in group["params"]]} for group in opt.param_groups]
    return {"state": state, "param_groups": groups}


def load_consolidated_state_dict(opt: ZeroOptimizer, state_dict: Mapping[str, Any]) -> None:
    """Load a consolidated (or single-device torch) state dict: settings into `param_groups`,
    each rank cutting its own shards out of the whole. Load the model's weights first: the
    masters are refreshed from them unless the dict holds "master" values."""
    saved = state_dict["param_groups"]
    if [len(s["params"]) for s in saved] != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError("the state dict's param groups differ in number or size from this optimizer's")
    by_param = {}
    for group, saved_group in zip(opt.param_groups, saved, strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
        for p, n in zip(group["params"], saved_group["params"], strict=True):
            by_param[p] = state_dict["state"].get(n, {})
    inner = {}
    for n, (_, gi, i) in enumerate(opt.pieces):
        g = opt.flat_groups[gi]
        if i is not None:
            inner[n] = {k: _copy(v) for k, v in by_param[g.params[i]].items()}
        elif by_param[g.params[0]]:  # per-element state is shaped like its parameter
            inner[n] = {k: _slice_of(g, by_param, k) if torch.is_tensor(v) and v.dim() > 0
                        and v.shape == g.params[0].shape else _copy(v)
                        for k, v in by_param[g.params[0]].items()}
    for g in opt.flat_groups:
        if "master" in by_param[g.params[0]]:
            g.master.copy_(_slice_of(g, by_param, "master"))
            g.shard.copy_(g.master)
        elif g.master is not g.shard:
            g.master.copy_(g.shard)
    for state in inner.values():
        state.pop("master", None)
    ids, groups = iter(range(len(opt.pieces))), []
    for group, inner_group in zip(opt.param_groups, opt.optim.param_groups, strict=True):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [next(ids) for _ in inner_group["params"]]})
    opt.optim.load_state_dict({"state": inner, "param_groups": groups})
    opt._gather_updated_parameters()


def _slice_of(g: FlatGroup, by_param: Mapping[nn.Parameter, dict], key: str) -> torch.Tensor:
    """This rank's slice of the flat layout of every parameter's `by_param[p][key]`."""
    values = [by_param[p][key] for p in g.params]
    flat = torch.zeros(g.padded, dtype=values[0].dtype, device=values[0].device)
    for p, off, v in zip(g.params, g.offsets, values, strict=True):
        flat[off : off + p.numel()] = v.reshape(-1)
    return flat[g.start : g.start + g.shard_size].clone()
