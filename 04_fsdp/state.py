"""A sharded model's state: building it (meta-device materialization, sync_module_states), its
shard layout, clipping across shards, and its state dicts.

Mixed into FullyShardedDataParallel (the root). Every function that gathers is a collective over
the FSDP process group (every rank of the group calls it). `state_dict()` / `load_state_dict()`
keep torch's default contract (StateDictType.FULL_STATE_DICT): the original parameter names,
without the wrappers' `_fsdp_wrapped_module` segments, full tensors on every rank, so the dict
loads into the unwrapped model; the optimizer's state likewise (torch's `optim_state_dict` pair, by
original names). The other views: `full_state_dict(rank0_only=True)` and `full_gradients()` the
same on group rank 0; `local_state_dict()` / `load_local_state_dict(sd)` {"<unit>._flat_param":
shard} per rank; `shard_layout()` a UnitShard per unit, root first (its flat shard and each
original parameter's ParamShard: name, shape, offset, numel, shard_offset); `units()` every FSDP
instance under the root, each with its `.unit_name` ("" for the root). Clipping follows
torch.nn.utils.clip_grad_norm_ (common/kernel/clip.py):

    total = sqrt(Σ_ranks Σ_shard g²)          (each element once: shards are disjoint)
    g    *= min(1, max_norm / (total + 1e-6))

Depends only on torch and common/kernel/clip.py.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from common.kernel.clip import accumulate_dtype, clip_grads_by_global_norm_

from .flat_param import FlatParamHandle, UnitShard
from .wrap import ShardingStrategy

WRAPPED = "_fsdp_wrapped_module"
# torch FSDP1's other public methods: not implemented here; calling one raises, naming what does the job
FULL_STATE = ("state_dict() is already FULL_STATE_DICT on every rank (torch's default); "
              "full_state_dict(rank0_only=True) is FullStateDictConfig(rank0_only=True); "
              "local_state_dict() is LOCAL_STATE_DICT")
OPTIM_STATE = ("FullyShardedDataParallel.optim_state_dict(model, optim) / "
               "optim_state_dict_to_load(model, optim, osd), torch's current pair")
NOT_IMPLEMENTED = {
    "apply": "call fn on the module before wrapping it, or pass param_init_fn (torch's FSDP.apply "
             "runs fn on the gathered parameters; nn.Module.apply here would see freed views)",
    "summon_full_params": "model.full_state_dict(rank0_only=False) gives the full values (a "
                          "collective); model.load_state_dict(values) writes them back",
    "state_dict_type": FULL_STATE, "set_state_dict_type": FULL_STATE, "get_state_dict_type": FULL_STATE,
    "full_optim_state_dict": OPTIM_STATE, "sharded_optim_state_dict": OPTIM_STATE,
    "shard_full_optim_state_dict": OPTIM_STATE, "scatter_full_optim_state_dict": OPTIM_STATE,
    "flatten_sharded_optim_state_dict": OPTIM_STATE, "rekey_optim_state_dict": OPTIM_STATE,
    "register_comm_hook": "the reduction is flat_param.py's reduce_grad (SUM, then ÷ N): edit it there",
}


def not_implemented(name: str, fix: str) -> staticmethod:
    """A stand-in for torch's FSDP1 method `name` that raises, naming `fix` (class or instance call)."""
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"FullyShardedDataParallel.{name} (torch's FSDP1) is not implemented "
                                  f"here: {fix}")
    refuse.__name__ = refuse.__qualname__ = name
    return staticmethod(refuse)


def clean_name(name: str) -> str:
    """Drop the wrapper's segments: '_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.w' → 'layers.0.w'."""
    return ".".join(part for part in name.split(".") if part and part != WRAPPED)


# --- building a unit's state -------------------------------------------------------------------

def unit_modules(module: nn.Module, is_unit: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """`module` and its descendants not inside a unit below it, breadth first (torch's order)."""
    out, queue, seen = [], deque([module]), {id(module)}
    while queue:
        m = queue.popleft()
        out.append(m)
        for child in m.children():
            if not is_unit(child) and id(child) not in seen:
                seen.add(id(child))
                queue.append(child)
    return out


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """The names of each parameter registered under several names (read while every parameter
    is alive: a unit frees its originals once flattened, and their ids may be reused)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(clean_name(name))
    return [group for group in names.values() if len(group) > 1]


def on_meta(modules: Iterable[nn.Module]) -> bool:
    """Does any of `modules` hold a parameter or buffer (its own) on the meta device?"""
    return any(t.is_meta for m in modules for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))


def materialize(modules: list[nn.Module], param_init_fn: Callable[[nn.Module], None] | None,
                device: torch.device | None) -> None:
    """torch's meta-device initialization of one unit's modules, before it is flattened (so a rank
    holds one whole unit at most): `param_init_fn(module)` for each module, or without one, for
    each module with parameters or buffers, `to_empty(device)` then `reset_parameters()`."""
    for m in modules:
        if param_init_fn is not None:
            param_init_fn(m)
        elif [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            if not hasattr(m, "reset_parameters"):
                raise ValueError(
                    f"{type(m).__name__} is on the meta device and has no reset_parameters(): pass "
                    "param_init_fn(module) (torch's: materialize it, e.g. module.to_empty(device=...,"
                    " recurse=False), then set its values) or shard_init_fn(name, meta_param)")
            m.to_empty(device=device or torch.device("cpu"), recurse=False)
            m.reset_parameters()


def cast_buffers(modules: list[nn.Module], dtype: torch.dtype | None,
                 device: torch.device | None) -> dict[tuple[int, str], torch.dtype]:
    """Floating buffers to `dtype` (MixedPrecision.buffer_dtype), all to `device`; returns the
    dtypes they had, by (id(module), name), for state dicts."""
    before = {}
    for m in modules:
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            if dtype is not None and b.is_floating_point():
                before[(id(m), name)] = b.dtype
                b = b.to(dtype)
            m._buffers[name] = b.to(device or b.device)
    return before


def broadcast_from_rank0(tensors: Iterable[torch.Tensor], group, device: torch.device | None) -> None:
    """torch's sync_module_states=True: every rank takes group rank 0's values (one broadcast per
    tensor, on `device`: NCCL takes no CPU tensor)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in tensors:
            on_device = t.detach().to(device or t.device)
            dist.broadcast(on_device, src=src, group=group)
            if on_device.data_ptr() != t.data_ptr():
                t.copy_(on_device)


class ShardedStateMixin:
    """Methods of the root FullyShardedDataParallel over all of its units' flat parameters."""

    def _handles(self) -> list[FlatParamHandle]:
        """The flat-parameter handle of every unit that has parameters (root first); private:
        `shard_layout()` is the public description of what a rank holds."""
        return [u._handle for u in self.units() if u._handle is not None]

    def _require_root(self, method: str) -> None:
        if not self._is_root:
            raise RuntimeError(f"{method} must be called on the root FullyShardedDataParallel, not on "
                               f"the unit {self.unit_name!r}")

    def shard_layout(self) -> list[UnitShard]:
        """Every unit under this root that has parameters (root first), as this rank holds it:
        its flat shard, its sizes, its dtypes (from its MixedPrecision config) and, for every
        original parameter, the piece this rank holds (ParamShard)."""
        out = []
        for unit in self.units():
            h = unit._handle
            if h is None:
                continue
            mp, dtype = unit.mixed_precision, h.flat_param.dtype
            prefix = f"{unit.unit_name}." if unit.unit_name else ""
            out.append(UnitShard(
                name=unit.unit_name, flat_param=h.flat_param, params=h.param_shards(prefix, clean_name),
                numel=h.numel, padded_numel=h.padded, shard_numel=h.shard_numel, shard_rank=h.shard_rank,
                shard_world=h.shard_world, param_dtype=mp.param_dtype or dtype,
                reduce_dtype=mp.reduce_dtype or mp.param_dtype or dtype, full=h.full, aliased=h.alias))
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's FSDP.clip_grad_norm_ over the whole (sharded) model, on the root: total = ||all
        grads||, each element counted once (shards are summed over the group; NO_SHARD grads are
        replicated; HSDP sums over the shard group only, as torch: the r replicas hold equal shards,
        summing over them too would count each element r times); grads *= min(1, max_norm /
        (total + 1e-6)). Returns the total norm (collective)."""
        self._require_root("clip_grad_norm_()")
        flats = [h.flat_param for h in self._handles()]
        sharded = self.sharding_strategy != ShardingStrategy.NO_SHARD
        return clip_grads_by_global_norm_([p.grad for p in flats], max_norm, norm_type=norm_type,
                                          groups=(self.process_group or dist.group.WORLD,) if sharded else (),
                                          device=flats[0].device, dtype=accumulate_dtype(flats))

    # --- state dicts ---------------------------------------------------------------------------

    def _gather_named(self, tensor_of: Callable[[UnitShard], torch.Tensor | None],
                      rank0_only: bool) -> dict[str, torch.Tensor] | None:
        out: dict[str, torch.Tensor] = {}
        for unit, h in zip(self.shard_layout(), self._handles(), strict=True):
            full = h.gather(tensor_of(unit))
            pieces = full[: unit.numel].split([p.shape.numel() for p in unit.params])
            out.update({p.name: t.view(p.shape).clone() for p, t in zip(unit.params, pieces, strict=True)})
        if rank0_only and dist.get_rank(self.process_group) != 0:
            return None
        order = self._original_order
        return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))

    def _named_buffers(self) -> dict[str, tuple[nn.Module, str]]:
        """Persistent buffers by original name: (owner module, attribute)."""
        return {clean_name(f"{prefix}.{name}"): (m, name) for prefix, m in self.module.named_modules()
                for name, b in m._buffers.items()
                if b is not None and name not in m._non_persistent_buffers_set}

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
        """{original name: full tensor}: the parameters in the shard's dtype (the fp32 master in
        mixed precision), the buffers in their own dtype (before buffer_dtype), on group rank 0
        (HSDP: of each shard group, as torch; every rank if not rank0_only). A collective over the
        (shard) group: every rank calls it."""
        out = self._gather_named(lambda u: u.flat_param, rank0_only)
        if out is not None:
            dtypes = {k: v for u in self.units() for k, v in u._buffer_dtypes.items()}
            for name, (m, attr) in self._named_buffers().items():
                b = m._buffers[attr]
                out[name] = b.detach().to(dtypes.get((id(m), attr), b.dtype), copy=True)
        return out

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """torch's default (FULL_STATE_DICT, rank0_only=False): `full_state_dict` on every rank,
        keys prefixed by `prefix`. A collective over the group."""
        if args:
            raise TypeError("state_dict() takes keyword arguments only (destination=, prefix=, keep_vars=)")
        self._require_root("state_dict()")
        out = OrderedDict() if destination is None else destination
        out.update((prefix + name, t) for name, t in self.full_state_dict(rank0_only=False).items())
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """torch's FULL_STATE_DICT load: every rank passes the full tensors (original names) and
        copies its slice of each into its shards; buffers whole. No collective."""
        self._require_root("load_state_dict()")
        if assign:
            raise NotImplementedError("load_state_dict(assign=True): the values are copied into the "
                                      "flat shards; pass assign=False")
        buffers = self._named_buffers()
        expected = [*self._original_order, *buffers]
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._original_order and k not in buffers]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: missing keys "
                               f"{missing}, unexpected keys {unexpected} (the original parameter names)")
        with torch.no_grad():
            for unit in self.shard_layout():
                for p in unit.params:
                    if p.name in state_dict:
                        piece = state_dict[p.name].detach().reshape(-1)[p.offset : p.offset + p.numel]
                        unit.flat_param[p.shard_offset : p.shard_offset + p.numel].copy_(piece)
            for name, (m, attr) in buffers.items():
                if name in state_dict:
                    m._buffers[attr].copy_(state_dict[name])
        return _IncompatibleKeys(missing, unexpected)

    # --- the optimizer's state: torch's optim_state_dict pair (FULL_STATE_DICT, every rank) --------

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict | None = None,
                         group=None) -> dict:
        """torch's FSDP.optim_state_dict with its default FULL_STATE_DICT: `optim` (any torch
        optimizer over `model.parameters()`, the flat shards) as a single-device optimizer of the
        unwrapped model keeps it, keyed by original names: {"state": {name: {key: full tensor}},
        "param_groups": [{..., "params": [names]}]}, on every rank (a collective over the group).
        `optim_state_dict`: optim.state_dict() if you already took it."""
        flats, layout = model._optim_layout(optim, group)
        osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
        state: dict[str, dict] = {}
        for unit, h in layout:
            saved = osd["state"].get(_position(flats, unit.flat_param), {})
            whole = {k: h.gather(v)[: unit.numel].split([p.shape.numel() for p in unit.params])
                     for k, v in saved.items() if torch.is_tensor(v) and v.shape == unit.flat_param.shape}
            for i, p in enumerate(unit.params):
                if saved:
                    state[p.name] = {k: whole[k][i].view(p.shape).clone() if k in whole else _copy(v)
                                     for k, v in saved.items()}
        names = {id(u.flat_param): [p.name for p in u.params] for u, _ in layout}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [n for q in optim.param_groups[i]["params"] for n in names[id(q)]]}
                  for i, g in enumerate(osd["param_groups"])]
        return {"state": state, "param_groups": groups}

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict,
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group=None) -> dict:
        """torch's inverse: the `optim_state_dict` above (every rank passes the whole) cut to this
        rank's shards, ready for `optim.load_state_dict` (`load_directly`: loaded too). Local."""
        if is_named_optimizer:
            raise NotImplementedError("is_named_optimizer=True (torchrec's KeyedOptimizer): pass a "
                                      "torch optimizer over model.parameters()")
        flats, layout = model._optim_layout(optim, group)
        state: dict[int, dict] = {}
        for unit, _ in layout:
            saved = [optim_state_dict["state"].get(p.name, {}) for p in unit.params]
            if not saved[0]:
                continue
            first = saved[0]
            shaped = {k for k, v in first.items() if torch.is_tensor(v) and v.shape == unit.params[0].shape}
            state[_position(flats, unit.flat_param)] = {
                k: _shard_of(unit, [s[k] for s in saved]) if k in shaped else _copy(v)
                for k, v in first.items()}
        groups = [{**{k: v for k, v in saved.items() if k != "params"},
                   "params": [_position(flats, q) for q in g["params"]]}
                  for g, saved in zip(optim.param_groups, optim_state_dict["param_groups"], strict=True)]
        out = {"state": state, "param_groups": groups}
        if load_directly:
            optim.load_state_dict(out)
        return out

    def _optim_layout(self, optim: torch.optim.Optimizer, group) -> tuple[list, list]:
        """(the optimizer's parameters in order, [(UnitShard, handle)]), refusing what the optimizer
        pair cannot honour: a non-root, `group` other than the model's, use_orig_params."""
        self._require_root("optim_state_dict()")
        if group is not None and group is not self.process_group:
            raise ValueError("optim_state_dict(group=...): pass None (the model's process_group)")
        if self.use_orig_params:
            raise NotImplementedError("optim_state_dict with use_orig_params=True: the optimizer "
                                      "steps 1-D pieces of the original parameters; wrap with "
                                      "use_orig_params=False and give the optimizer model.parameters()")
        flats = [p for g in optim.param_groups for p in g["params"]]
        layout = list(zip(self.shard_layout(), self._handles(), strict=True))
        missing = [u.name or "<root>" for u, _ in layout if not any(q is u.flat_param for q in flats)]
        if missing:
            raise ValueError(f"the optimizer does not step the flat parameters of units {missing}: "
                             "build it from model.parameters()")
        return flats, layout

    def full_gradients(self, rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
        """The shards' `.grad` gathered to full shape under the original names (collective)."""
        return self._gather_named(lambda u: u.flat_param.grad, rank0_only)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's flat shards, {"<unit>._flat_param": 1-d tensor} (root: "_flat_param"): the
        content of torch's StateDictType.LOCAL_STATE_DICT; loads only into the same world size."""
        return {(f"{u.name}." if u.name else "") + "_flat_param": u.flat_param.detach()
                for u in self.shard_layout()}

    def load_local_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, shard in self.local_state_dict().items():
                shard.copy_(state_dict[key])


def _position(tensors: list[torch.Tensor], t: torch.Tensor) -> int:
    return next(i for i, q in enumerate(tensors) if q is t)


def _copy(value):
    return value.detach().clone() if torch.is_tensor(value) else value


def _shard_of(unit: UnitShard, values: list[torch.Tensor]) -> torch.Tensor:
    """This rank's flat shard of the unit's per-parameter full `values` (padding: zeros)."""
    shard = torch.zeros(unit.flat_param.shape, dtype=values[0].dtype, device=unit.flat_param.device)
    for p, v in zip(unit.params, values, strict=True):
        shard[p.shard_offset : p.shard_offset + p.numel] = v.reshape(-1)[p.offset : p.offset + p.numel]
    return shard.detach()
