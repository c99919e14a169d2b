"""FullyShardedDataParallel from scratch: torch's FSDP API, one flat parameter per unit (ZeRO-3).

    model = FullyShardedDataParallel(model, auto_wrap_policy=partial(transformer_auto_wrap_policy,
                transformer_layer_cls={TransformerBlock}), mixed_precision=MixedPrecision(
                torch.bfloat16, torch.float32, torch.bfloat16), sharding_strategy=FULL_SHARD)
    optimizer = torch.optim.AdamW(model.parameters())     # the 1/N flat shards
    loss = model(batch); loss.backward(); optimizer.step(); optimizer.zero_grad()

The life cycle of a unit (FULL_SHARD) in one step, N ranks, P_u parameters:

    forward :  all-gather P_u → compute → free           (prefetch: the next unit's gather starts first)
    backward:  all-gather P_u → compute grads → reduce-scatter grads → free
    step    :  the optimizer updates this rank's P_u/N shard only

Wire bytes per rank and step: (N-1)/N · (2·P·b_param + P·b_reduce) = 1.5× DDP's 2(N-1)/N·P·b
when every parameter is in a unit; the root unit (what the policy left: embeddings, final norm,
head) stays gathered from its forward to the end of backward, as in torch, so it is gathered
once. SHARD_GRAD_OP keeps every unit gathered from forward to the end of backward: 1.0× DDP's
bytes, no memory saving on parameters during the step. Persistent memory per rank:
(params + grads + optimizer)/N (+ padding to a multiple of N per unit).

Public API (stable; chapter 07 wraps a pipeline stage of tensor-parallel blocks over a DP group):
  FullyShardedDataParallel(module, process_group=None, sharding_strategy=, auto_wrap_policy=,
      mixed_precision=, device_id=, sync_module_states=False, forward_prefetch=True,
      backward_prefetch=True, param_init_fn=None, use_orig_params=False)
                                              any nn.Module whose forward reads its weights
                                              as attributes (module.weight); process_group may be
                                              a sub-group (ranks are group ranks). A module on
                                              the meta device: param_init_fn(name, meta param)
                                              returns a parameter's full values (e.g. on CPU),
                                              only for those overlapping this rank's shards;
                                              the shards are allocated on device_id (default
                                              CPU), so no rank ever holds a whole unit
  .parameters()                               the flat shards (give them to any torch optimizer);
                                              use_orig_params=True: the original parameters
                                              under their names, views of their pieces (1-D
                                              while sharded), grads views of the grad shard
  .shard_layout()                             [UnitShard] per unit, root first: its flat shard,
                                              and for every original parameter its ParamShard
                                              (name, shape, offset, numel, shard_offset)
  .no_sync()                                  accumulate unsharded grads locally (call on the root)
  .clip_grad_norm_(max_norm, norm_type=2.0)   torch's clipping, norm over every shard of the group
  .full_state_dict(rank0_only=True)           {original name: full tensor} on group rank 0
  .full_gradients(rank0_only=True)            the same for the shards' gradients (zeros if None)
  .load_full_state_dict(sd)                   every rank passes full tensors, keeps its slice
  .sharded_state_dict() / .load_sharded_state_dict(sd)  {"<unit>._flat_param": shard} per rank
  .units()                                    every FSDP instance under the root, root first;
                                              each has .unit_name ("" for the root)
  .memory_trace                               set to [] to record (event, unit, live bytes, phase)

MixedPrecision(..., _module_classes_to_ignore=(RMSNorm,)) (torch's field): each module of those
classes becomes its own unit in the module's dtype; it casts its inputs to that dtype and its
outputs back to param_dtype.

Semantics a caller may rely on: several forwards may precede their backwards (1F1B); every
backward (each `backward()` call) ends with all reductions landed in the shards' `.grad` and
every unit freed; the next use gathers again. Each unit's gradient reduction is SUM then ÷ N.

Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from .flat_param import FlatParamHandle
from .state import WRAPPED, ShardedStateMixin, clean_name
from .wrap import AutoWrapPolicy, MixedPrecision, ShardingStrategy, apply_auto_wrap, exempting


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _cast_inputs(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_inputs(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_inputs(v, dtype) for k, v in obj.items()}
    return obj


class _RootState:
    """Shared by every unit of one root: execution order, sync flag, the end-of-backward callback."""

    def __init__(self) -> None:
        self.order: list[FullyShardedDataParallel] = []  # units with parameters, forward order
        self.order_frozen = False
        self.sync = True
        self.in_backward = False
        self.trace: list[dict] | None = None


class FullyShardedDataParallel(ShardedStateMixin, nn.Module):
    """Shards `module`'s parameters over `process_group`; see the module docstring."""

    def __init__(self, module: nn.Module, process_group=None,
                 sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
                 auto_wrap_policy: AutoWrapPolicy | None = None,
                 mixed_precision: MixedPrecision | None = None,
                 device_id: int | torch.device | None = None, sync_module_states: bool = False,
                 forward_prefetch: bool = True, backward_prefetch: bool = True,
                 param_init_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 use_orig_params: bool = False):
        super().__init__()
        if not isinstance(sharding_strategy, ShardingStrategy):
            raise ValueError(f"sharding_strategy={sharding_strategy!r}: use a ShardingStrategy "
                             f"({', '.join(s.name for s in ShardingStrategy)})")
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else device_id
        if param_init_fn is not None:  # nested units see their own names: map back to ours by identity
            names = {id(p): clean_name(n) for n, p in module.named_parameters()}
            init, param_init_fn = param_init_fn, lambda _, p: init(names[id(p)], p)
        elif device is not None:
            module.to(device)
        self.process_group, self.sharding_strategy = process_group, sharding_strategy
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.forward_prefetch, self.backward_prefetch = forward_prefetch, backward_prefetch
        self.use_orig_params = use_orig_params
        self._exempt_output_dtype: torch.dtype | None = None  # set on a unit exempt from mixed precision
        self.add_module(WRAPPED, module)
        # original names in registration order (for state dicts ordered like the module's own)
        self._original_order = {clean_name(n): i for i, (n, _) in enumerate(module.named_parameters())}
        if sync_module_states:  # before any unit flattens its share: group rank 0's values
            src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            with torch.no_grad():
                for t in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(t.data, src=src, group=process_group)
        exempt = tuple(self.mixed_precision._module_classes_to_ignore)
        if auto_wrap_policy is not None or exempt:
            kwargs = dict(process_group=process_group, sharding_strategy=sharding_strategy,
                          mixed_precision=mixed_precision, sync_module_states=False,
                          forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch,
                          device_id=device, param_init_fn=param_init_fn, use_orig_params=use_orig_params)

            def make_unit(m: nn.Module) -> FullyShardedDataParallel:
                if not isinstance(m, exempt):
                    return FullyShardedDataParallel(m, **kwargs)
                unit = FullyShardedDataParallel(m, **{**kwargs, "mixed_precision": None})
                unit._exempt_output_dtype = self.mixed_precision.param_dtype
                return unit

            made = apply_auto_wrap(module, exempting(auto_wrap_policy, exempt), make_unit,
                                   lambda m: isinstance(m, FullyShardedDataParallel))
            if made == 0 and auto_wrap_policy is not None:
                kinds = sorted({type(m).__name__ for m in module.modules()})
                raise ValueError(
                    f"auto_wrap_policy wrapped no submodule of {type(module).__name__} (its module "
                    f"classes: {', '.join(kinds)}): check transformer_layer_cls, or pass "
                    "auto_wrap_policy=None to shard the whole model as one unit")
        self._cast_buffers(module)
        own = self._own_parameters(module)
        mp = self.mixed_precision
        self._handle = (FlatParamHandle(own, process_group,
                                        shard=sharding_strategy != ShardingStrategy.NO_SHARD,
                                        param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                        on_event=self._on_event, init_device=device,
                                        init_fn=None if param_init_fn is None else partial(param_init_fn, ""),
                                        orig_params=use_orig_params)
                        if own else None)
        if self._handle is not None:
            if not use_orig_params:
                self._flat_param = self._handle.flat_param  # registered: what .parameters() yields
            if self._handle.full.requires_grad:
                self._handle.full.register_post_accumulate_grad_hook(self._post_backward)
        self._adopt_units()

    # --- construction -------------------------------------------------------------------------

    def _cast_buffers(self, module: nn.Module) -> None:
        dtype = self.mixed_precision.buffer_dtype
        for m in self._own_modules(module):
            for name, b in list(m._buffers.items()):
                if dtype is not None and b is not None and b.is_floating_point():
                    m._buffers[name] = b.to(dtype)

    @staticmethod
    def _own_modules(module: nn.Module) -> Iterator[nn.Module]:
        """`module` and its descendants, not descending into nested units."""
        yield module
        for child in module.children():
            if not isinstance(child, FullyShardedDataParallel):
                yield from FullyShardedDataParallel._own_modules(child)

    def _own_parameters(self, module: nn.Module) -> list[tuple[str, nn.Module, str]]:
        own, prefix = [], {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
        for m in self._own_modules(module):
            for attr, p in m._parameters.items():
                if p is not None:
                    own.append((f"{prefix[id(m)]}.{attr}".lstrip("."), m, attr))
        return own

    def _adopt_units(self) -> None:
        """This instance becomes the root of every unit below it; shared parameters are refused."""
        self._state = _RootState()
        owner: dict[int, str] = {}
        for name, unit in self.named_modules():
            if not isinstance(unit, FullyShardedDataParallel):
                continue
            object.__setattr__(unit, "_root", self)  # not a submodule: a back-reference
            unit._is_root, unit.unit_name = unit is self, clean_name(name)
            if unit._handle is None:
                continue
            unit._handle.name = unit.unit_name or "<root>"
            for pid in unit._handle.param_ids:
                if pid in owner:
                    raise ValueError(
                        f"a parameter is shared between units {owner[pid] or '<root>'!r} and "
                        f"{unit.unit_name or '<root>'!r}: FSDP shards each unit's parameters "
                        "separately, so tied weights must live in one unit (wrap their common "
                        "parent, or untie them)")
                owner[pid] = unit.unit_name
            unit._handle.on_event = unit._on_event

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """torch's FSDP names: the wrappers' `_fsdp_wrapped_module.` segments removed."""
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield clean_name(name), p

    def units(self) -> list[FullyShardedDataParallel]:
        """Every FSDP instance under this root (root first), with or without parameters."""
        return [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]

    @property
    def module(self) -> nn.Module:
        return getattr(self, WRAPPED)

    @property
    def memory_trace(self) -> list[dict] | None:
        return self._root._state.trace

    @memory_trace.setter
    def memory_trace(self, value: list[dict] | None) -> None:
        self._root._state.trace = value

    def _on_event(self, event: str, handle: FlatParamHandle) -> None:
        state = self._root._state
        if state.trace is None:
            return
        live = [u._handle for u in self._root.units()
                if u._handle is not None and u._handle.allocated and not u._handle.alias]
        state.trace.append({"event": event, "unit": handle.name,
                            "phase": "backward" if state.in_backward else "forward",
                            "live_bytes": sum(h.full_bytes for h in live),
                            "live_units": [h.name for h in live]})

    # --- forward ------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        state = self._root._state
        mp = self.mixed_precision
        if self._is_root and mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = _cast_inputs(args, mp.param_dtype), _cast_inputs(kwargs, mp.param_dtype)
        if self._exempt_output_dtype is not None and self._handle is not None:
            dtype = self._handle.full.dtype
            args, kwargs = _cast_inputs(args, dtype), _cast_inputs(kwargs, dtype)
        if self._handle is not None:
            if not state.order_frozen and self not in state.order:
                state.order.append(self)
            self._handle.unshard()
            self._handle.wait_unshard()
            self._handle.use_views()
            if self.forward_prefetch and state.order_frozen:
                self._prefetch(self._neighbour(+1))
        output = self.module(*args, **kwargs)
        if self._handle is not None:
            self._handle.register_orig_params()
        if self._exempt_output_dtype is not None:
            output = _cast_inputs(output, self._exempt_output_dtype)
        if self._is_root:
            state.order_frozen = True
        needs_grad = [t for t in _tensors(output) if t.requires_grad]
        if needs_grad and torch.is_grad_enabled():
            self._register_pre_backward(needs_grad)
            if not self._is_root and self.sharding_strategy == ShardingStrategy.FULL_SHARD:
                self._reshard()
        else:  # no backward will follow this forward
            self._reshard()
        return output

    def _neighbour(self, step: int) -> FullyShardedDataParallel | None:
        order = self._root._state.order
        if self not in order:
            return None
        i = order.index(self) + step
        return order[i] if 0 <= i < len(order) else None

    @staticmethod
    def _prefetch(unit: FullyShardedDataParallel | None) -> None:
        if unit is not None and unit._handle is not None:
            unit._handle.unshard(async_op=True)

    def _reshard(self) -> None:
        if self._handle is not None:
            self._handle.reshard()

    # --- backward -----------------------------------------------------------------------------

    def _register_pre_backward(self, outputs: list[torch.Tensor]) -> None:
        fired = [False]

        def pre_backward(grad: torch.Tensor) -> None:
            if fired[0]:
                return
            fired[0] = True
            self._root._queue_final_callback()
            if self._handle is not None:
                self._handle.unshard()
                self._handle.wait_unshard()
            if self.backward_prefetch:  # the unit whose backward runs next
                order = self._root._state.order
                self._prefetch(order[-1] if self._is_root and order and order[-1] is not self
                               else None if self._is_root else self._neighbour(-1))

        for t in outputs:
            t.register_hook(pre_backward)

    def _queue_final_callback(self) -> None:
        state = self._state
        if not state.in_backward:
            state.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _post_backward(self, full: torch.Tensor) -> None:
        """The unit's gradient is complete: start its reduction, free the gathered copy."""
        grad, full.grad = full.grad, None
        self._root._queue_final_callback()
        self._handle.reduce_grad(grad, self._root._state.sync)
        self._reshard()

    def _finish_backward(self) -> None:
        """End of backward (autograd-engine callback): every reduction has landed in `.grad`."""
        state = self._state
        state.in_backward = False
        for unit in self.units():
            if unit._handle is not None:
                unit._handle.finish_grad()
                unit._handle.reshard()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without communication: each unit sums its unsharded gradient
        locally (P_u·b_reduce bytes more per unit); the first backward outside reduces the sum."""
        if not self._is_root:
            raise RuntimeError("no_sync() must be called on the root FullyShardedDataParallel")
        self._state.sync, previous = False, self._state.sync
        try:
            yield
        finally:
            self._state.sync = previous

    # --- gradients and state ------------------------------------------------------------------

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(self.module, name)
