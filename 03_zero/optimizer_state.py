"""ZeroOptimizer's state seen whole: which inner tensor is which piece of the layout, its
checkpoints in torch's per-parameter optimizer format (consolidated), and gathered full tensors.

`inner_tensors` hands the inner optimizer each master slice, or with whole-parameter ownership a
view of it per parameter this rank owns (its `pieces`).

torch's ZeroRedundancyOptimizer pair: `consolidate` (a collective) gathers every rank's shards on
one rank (one `gather_object`: it fits teaching sizes; DeepSpeed saves shards instead) and cuts
each flat slice back into per-parameter tensors at the layout's offsets; `consolidated_state_dict`
(local) hands that rank the result, and raises on a rank that holds none;
`load_consolidated_state_dict` (local, every rank) is the inverse: each rank cuts its slice (or its
whole parameters) out of the full tensors, from any world size or a single-device torch optimizer.
The functions take the optimizer's parts they read: its `param_groups`, `flat_groups`, the inner
optimizer and `pieces`, the list of (inner tensor, flat group index, parameter index or None).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.collectives import all_gather_single

from .flat import FlatGroup

Pieces = list[tuple[torch.Tensor, int, int | None]]  # (inner tensor, group index, param index | None)


def inner_tensors(groups: list[FlatGroup], first: int, whole_params: bool) -> Pieces:
    """What the inner optimizer steps: each master slice (`groups` are the optimizer's flat groups
    from index `first` on), or with `whole_params` a view of it per parameter this rank owns, in
    the parameter's shape."""
    pieces = []
    for gi, g in enumerate(groups, start=first):
        if not whole_params:
            pieces.append((g.master, gi, None))
            continue
        for i, (p, off) in enumerate(zip(g.params, g.offsets, strict=True)):
            local = off - g.start
            if 0 <= local < g.shard_size and p.numel():
                pieces.append((g.master[local : local + p.numel()].view(p.shape), gi, i))
    return pieces


def gathered(groups: list[FlatGroup], shard_of: Callable[[FlatGroup], torch.Tensor], dtype: torch.dtype,
             device: torch.device, group, sharded: bool) -> dict[str, torch.Tensor]:
    """{name: full tensor}: `shard_of(g)` of every rank all-gathered over `group` (a collective),
    or copied where this rank holds it whole (not `sharded`: stage 0)."""
    out = {}
    for g in groups:
        shard = shard_of(g).to(device)
        if sharded:
            full = torch.empty(g.padded, dtype=dtype, device=device)
            all_gather_single(full, shard, group)
        else:
            full = shard.clone()
        out.update(g.split(full))
    return out


def _copy(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value


def consolidate(flat_groups: list[FlatGroup], pieces: Pieces, inner: torch.optim.Optimizer,
                param_groups: list[dict], group, to: int, shard_world: int,
                with_master: bool) -> dict[int, dict] | None:
    """torch's ZeroRedundancyOptimizer.consolidate_state_dict(to): every rank's shards gathered
    on group rank `to` (a collective over `group`: one `gather_object`), cut back at the layout's
    offsets into per-parameter state {index: {key: full-shape tensor on the CPU}}, as a
    single-device torch optimizer keeps it; None on every other rank. The first `shard_world`
    ranks hold the shards (stage 0: rank 0 holds everything). `with_master` (bf16) adds each
    parameter's fp32 "master"."""
    world = dist.get_world_size(group)
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < world:
        raise ValueError(f"consolidate_state_dict(to={to!r}): a rank of the optimizer's process "
                         f"group, 0 … {world - 1}")
    local = {}
    for t, gi, i in pieces:
        state = dict(inner.state.get(t, {}))
        if with_master:
            state["master"] = t
        local[gi, i] = {k: _copy(v).cpu() if torch.is_tensor(v) else v for k, v in state.items()}
    rank = dist.get_rank(group)
    gathered = [None] * world if rank == to else None
    dst = to if group is None else dist.get_global_rank(group, to)
    dist.gather_object(local, gathered, dst=dst, group=group)
    if rank != to:
        return None
    index = {id(p): n for n, p in enumerate(p for pg in param_groups for p in pg["params"])}
    state = {}
    for gi, g in enumerate(flat_groups):
        if (gi, None) not in gathered[0]:  # whole-parameter ownership: a piece is one parameter
            for i, p in enumerate(g.params):
                found = [s[gi, i] for s in gathered[:shard_world] if (gi, i) in s]
                if found and found[0]:
                    state[index[id(p)]] = found[0]
            continue
        shards = [s[gi, None] for s in gathered[:shard_world]]
        sliced = {k for k, v in shards[0].items() if torch.is_tensor(v) and v.shape == (g.shard_size,)}
        whole = {k: torch.cat([s[k] for s in shards]) if k in sliced else v for k, v in shards[0].items()}
        for p, off in zip(g.params, g.offsets, strict=True):
            if whole:  # scalars ("step") copied: each parameter's own, as torch's optimizers keep them
                state[index[id(p)]] = {k: v[off : off + p.numel()].view(p.shape).clone() if k in sliced
                                       else _copy(v) for k, v in whole.items()}
    return dict(sorted(state.items()))


def consolidated_state_dict(consolidated: dict[int, dict] | None, param_groups: list[dict],
                            rank: int) -> dict[str, Any]:
    """torch's ZeroRedundancyOptimizer.state_dict(): local, the state last consolidated on this
    rank (possibly stale) with the current settings: {"state": {index: {key: tensor}},
    "param_groups": [{..., "params": [index, ...]}]}; on a rank holding none, torch's error."""
    if consolidated is None:
        raise RuntimeError("Optimizer state has not been consolidated on this rank. Please call "
                           f"`consolidate_state_dict(to={rank})` on all ranks beforehand if you "
                           "meant to save the global state.")
    groups, n = [], 0
    for pg in param_groups:
        groups.append({**{k: v for k, v in pg.items() if k != "params"},
                       "params": list(range(n, n + len(pg["params"])))})
        n += len(pg["params"])
    return {"state": {i: dict(s) for i, s in consolidated.items()}, "param_groups": groups}


def load_consolidated_state_dict(state_dict: Mapping[str, Any], param_groups: list[dict],
                                 flat_groups: list[FlatGroup], pieces: Pieces,
                                 inner: torch.optim.Optimizer) -> None:
    """Load a consolidated (or single-device torch) state dict: settings into `param_groups`,
    each rank cutting its own shards out of the whole into `inner` and the masters. Load the
    model's weights first: the masters are refreshed from them unless the dict holds "master"
    values, which then set the whole flat parameters too: local, no collective (torch's)."""
    saved = state_dict["param_groups"]
    if [len(s["params"]) for s in saved] != [len(g["params"]) for g in param_groups]:
        raise ValueError("the state dict's param groups differ in number or size from this optimizer's")
    by_param = {}
    for group, saved_group in zip(param_groups, saved, strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
        for p, n in zip(group["params"], saved_group["params"], strict=True):
            by_param[p] = state_dict["state"].get(n, {})
    states = {}
    for n, (_, gi, i) in enumerate(pieces):
        g = flat_groups[gi]
        if i is not None:
            states[n] = {k: _copy(v) for k, v in by_param[g.params[i]].items()}
        elif by_param[g.params[0]]:  # per-element state is shaped like its parameter
            states[n] = {k: _slice_of(g, by_param, k) if torch.is_tensor(v) and v.dim() > 0
                         and v.shape == g.params[0].shape else _copy(v)
                         for k, v in by_param[g.params[0]].items()}
    for g in flat_groups:
        if "master" in by_param[g.params[0]]:  # every rank holds the whole: no all-gather needed
            full = _flat_of(g, by_param, "master")
            g.master.copy_(full[g.start : g.start + g.shard_size])
            if g.persistent:  # the shard is a view of the flat parameters
                g.flat.copy_(full)
            else:
                g.shard.copy_(g.master)
        elif g.master is not g.shard:
            g.master.copy_(g.shard)
    for state in states.values():
        state.pop("master", None)
    ids, groups = iter(range(len(pieces))), []
    for group, inner_group in zip(param_groups, inner.param_groups, strict=True):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [next(ids) for _ in inner_group["params"]]})
    inner.load_state_dict({"state": states, "param_groups": groups})


def _flat_of(g: FlatGroup, by_param: Mapping[nn.Parameter, dict], key: str) -> torch.Tensor:
    """Every parameter's `by_param[p][key]` laid out as the group's flat buffer (padding 0)."""
    values = [by_param[p][key] for p in g.params]
    flat = torch.zeros(g.padded, dtype=values[0].dtype, device=values[0].device)
    for p, off, v in zip(g.params, g.offsets, values, strict=True):
        flat[off : off + p.numel()] = v.reshape(-1)
    return flat


def _slice_of(g: FlatGroup, by_param: Mapping[nn.Parameter, dict], key: str) -> torch.Tensor:
    """This rank's slice of `_flat_of(g, by_param, key)`."""
    return _flat_of(g, by_param, key)[g.start : g.start + g.shard_size].clone()


def state_tensors(groups: list[FlatGroup], inner: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """The live tensors of the training state by kind (for a storage-deduplicated ledger)."""
    opt = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": [g.flat for g in groups] + [g.shard for g in groups if not g.persistent],
        "grads": [t for g in groups for t in (g.grad_flat, g.shard_grad, g.host_grad) if t is not None],
        "optimizer": opt + [g.master for g in groups if g.master is not g.shard],
    }
