"""FullyShardedDataParallel from scratch: torch's FSDP API, one flat parameter per unit (ZeRO-3).

    model = FullyShardedDataParallel(model, auto_wrap_policy=partial(transformer_auto_wrap_policy,
                transformer_layer_cls={TransformerBlock}), mixed_precision=MixedPrecision(
                torch.bfloat16, torch.float32, torch.bfloat16), sharding_strategy=FULL_SHARD)
    optimizer = torch.optim.AdamW(model.parameters())     # the 1/N flat shards; then torch's loop

The life cycle of a unit (FULL_SHARD) in one step, N ranks, P_u parameters:

    forward :  all-gather P_u → compute → free           (prefetch: the next unit's gather starts first)
    backward:  all-gather P_u → compute grads → reduce-scatter grads → free
    step    :  the optimizer updates this rank's P_u/N shard only

Wire bytes per rank and step: (N-1)/N · (2·P·b_param + P·b_reduce) = 1.5× DDP's 2(N-1)/N·P·b
when every parameter is in a unit; the root unit (what the policy left: embeddings, final norm,
head) stays gathered from its forward to the end of backward, as in torch, so it is gathered
once. SHARD_GRAD_OP keeps every unit gathered from forward to the end of backward: 1.0× DDP's
bytes, no memory saving on parameters during the step. Persistent memory per rank:
(params + grads + optimizer)/N (+ padding to a multiple of N per unit). HYBRID_SHARD (HSDP,
_HYBRID_SHARD_ZERO2 with SHARD_GRAD_OP inside) shards over s ranks of a node and all-reduces each
reduced shard over the r nodes: (s-1)/s·(2·P·b_p + P·b_r) intra-node, 2(r-1)/r·P/s·b_r across.

Public API: torch's FSDP1 signature, defaults and meanings (chapter 07 wraps a pipeline stage of
tensor-parallel blocks over a DP group):
  FullyShardedDataParallel(module, process_group=None, sharding_strategy=FULL_SHARD, cpu_offload=None,
      auto_wrap_policy=None, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, mixed_precision=None,
      ignored_modules=None, param_init_fn=None, device_id=None, sync_module_states=False,
      forward_prefetch=False, limit_all_gathers=True, use_orig_params=False, ignored_states=None,
      device_mesh=None, *, shard_init_fn=None)
    any module whose forward reads its weights as attributes (module.weight); process_group may be
    a sub-group; for HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (shard_group, replicate_group), torch's
    (intra-node, inter-node) pair (None: torch's default, nodes of LOCAL_WORLD_SIZE ranks, built
    by the kernel's mesh in fsdp.wrap.process_groups).
    Refused, with the fix: an offloading cpu_offload, ignored_modules/_states, device_mesh;
    limit_all_gathers is moot (at most one unit is prefetched ahead).
    A meta-device module, torch's way: each unit calls param_init_fn(module) on its modules (or
    to_empty + reset_parameters), then shards: the peak is one unit. Ours, cheaper:
    shard_init_fn(name, meta_param) returns a parameter's full values, called only for those
    overlapping this rank's shards: no rank holds a whole unit. Shards live on device_id
    (default: the parameters' device; CPU for meta ones).
  .parameters() / .named_parameters()         the flat shards (give them to any torch optimizer);
      use_orig_params=True: the original parameters, views of their pieces (1-D while sharded),
      whose grads are views of the (accumulated) grad shard. Names are nn.Module's, with
      `_fsdp_wrapped_module.` (as torch's); clean_name() strips it.
  .no_sync()                                  accumulate unsharded grads locally (on the root)
  .set_gradient_divide_factor(f)              (FSDP2's) divide this unit's gradient by f, not s·r
  .clip_grad_norm_(max_norm, norm_type=2.0)   torch's clipping, norm over every shard of the group
                                              (HSDP: of the shard group; the replicas are equal)
  .state_dict() / .load_state_dict(sd), FSDP.optim_state_dict / .optim_state_dict_to_load, and
      the full, local and per-unit views (.shard_layout(), .units()): state.py, which says each;
      torch's other FSDP1 methods raise, naming the fix
  .memory_trace                               set to [] to record (event, unit, live bytes, phase)

MixedPrecision(..., _module_classes_to_ignore=(RMSNorm,)) (torch's field): each module of those
classes becomes its own unit in its own dtype, inputs cast to it and outputs back to param_dtype.

Semantics a caller may rely on: several forwards may precede their backwards (1F1B); every
`backward()` ends with all reductions landed in the shards' `.grad`, every unit freed. Each unit's
gradient reduction is SUM then ÷ N (HSDP: reduce-scatter SUM over the shard group, all-reduce SUM
over the replicate group, ÷ s·r).

Depends only on torch and the kernel's common/kernel/clip.py, collectives.py and mesh.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from .flat_param import FlatParamHandle
from .state import (
    NOT_IMPLEMENTED,
    WRAPPED,
    ShardedStateMixin,
    broadcast_from_rank0,
    cast_buffers,
    clean_name,
    materialize,
    not_implemented,
    on_meta,
    tied_parameters,
    unit_modules,
)
from .wrap import (
    AutoWrapPolicy,
    BackwardPrefetch,
    MixedPrecision,
    ShardingStrategy,
    apply_auto_wrap,
    cast_floating,
    check_options,
    exempting,
    process_groups,
    reshards_after_forward,
    tensors_in,
)


class _RootState:
    """Shared by every unit of one root: execution order, sync flag, the end-of-backward callback."""

    def __init__(self) -> None:
        self.order: list[FullyShardedDataParallel] = []  # units with parameters, forward order
        self.order_frozen = False
        self.sync = True
        self.in_backward = False
        self.trace: list[dict] | None = None
        self.replicating: FlatParamHandle | None = None  # HSDP: the unit whose all-reduce is next


class FullyShardedDataParallel(ShardedStateMixin, nn.Module):
    """Shards `module`'s parameters over `process_group`; see the module docstring."""

    def __init__(self, module: nn.Module, process_group=None,
                 sharding_strategy: ShardingStrategy | None = None, cpu_offload=None,
                 auto_wrap_policy: AutoWrapPolicy | None = None,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: MixedPrecision | None = None, ignored_modules=None,
                 param_init_fn: Callable[[nn.Module], None] | None = None,
                 device_id: int | torch.device | None = None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = False, ignored_states=None, device_mesh=None, *,
                 shard_init_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        sharding_strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        check_options(process_group, sharding_strategy, backward_prefetch, cpu_offload, ignored_modules,
                      ignored_states, device_mesh, param_init_fn, shard_init_fn, sync_module_states,
                      auto_wrap_policy)
        process_group, replicate_group = process_groups(process_group, sharding_strategy)
        tied = tied_parameters(module)
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else device_id
        if shard_init_fn is not None:  # nested units see their own names: map back to ours by identity
            names = {id(p): clean_name(n) for n, p in module.named_parameters()}
            init, shard_init_fn = shard_init_fn, lambda _, p: init(names[id(p)], p)
        elif device is not None and not on_meta(module.modules()):
            module.to(device)
        self.process_group, self.sharding_strategy = process_group, sharding_strategy  # torch's names
        self.replicate_group = replicate_group  # HSDP only (torch's `_inter_node_pg`), else None
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.forward_prefetch, self.backward_prefetch = forward_prefetch, backward_prefetch
        self.use_orig_params = use_orig_params
        self._exempt_output_dtype: torch.dtype | None = None  # set on a unit exempt from mixed precision
        self._buffer_dtypes: dict[tuple[int, str], torch.dtype] = {}  # before buffer_dtype, for state dicts
        self.add_module(WRAPPED, module)
        # original names in registration order (for state dicts ordered like the module's own)
        self._original_order = {clean_name(n): i for i, (n, _) in enumerate(module.named_parameters())}
        if auto_wrap_policy is not None:  # the units below first (post-order), each built like this one
            self._wrap_units(module, auto_wrap_policy, dict(
                process_group=process_group if replicate_group is None else (process_group, replicate_group),
                sharding_strategy=sharding_strategy,
                mixed_precision=mixed_precision, sync_module_states=sync_module_states,
                forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch, device_id=device,
                param_init_fn=param_init_fn, shard_init_fn=shard_init_fn, use_orig_params=use_orig_params))
        modules = unit_modules(module, lambda m: isinstance(m, FullyShardedDataParallel))
        if shard_init_fn is None and on_meta(modules):  # torch's: this unit whole, then sharded
            materialize(modules, param_init_fn, device)
        if sync_module_states:  # group rank 0's values, before this unit flattens its share
            tensors = [t for m in modules for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
            for group in (replicate_group, process_group)[replicate_group is None:]:  # torch's order
                broadcast_from_rank0(tensors, group, device)
        self._buffer_dtypes.update(cast_buffers(modules, self.mixed_precision.buffer_dtype, device))
        own = self._own_parameters(module)
        mp = self.mixed_precision
        self._handle = (FlatParamHandle(own, process_group,
                                        shard=sharding_strategy != ShardingStrategy.NO_SHARD,
                                        param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                        on_event=self._on_event, init_device=device,
                                        init_fn=None if shard_init_fn is None else partial(shard_init_fn, ""),
                                        orig_params=use_orig_params, replicate_group=replicate_group)
                        if own else None)
        if self._handle is not None:
            if not use_orig_params:
                self._flat_param = self._handle.flat_param  # registered: what .parameters() yields
            if self._handle.full.requires_grad:
                self._handle.full.register_post_accumulate_grad_hook(self._post_backward)
        self._adopt_units(tied)

    # --- construction -------------------------------------------------------------------------

    def _wrap_units(self, module: nn.Module, policy: AutoWrapPolicy, kwargs: dict) -> None:
        """Make the policy's units (torch's order: post-order), and with mixed precision one unit
        per instance of `_module_classes_to_ignore`, computing in the module's own dtype."""
        exempt = tuple(self.mixed_precision._module_classes_to_ignore) if kwargs["mixed_precision"] else ()

        def make_unit(m: nn.Module) -> FullyShardedDataParallel:
            if not isinstance(m, exempt):
                return FullyShardedDataParallel(m, **kwargs)
            unit = FullyShardedDataParallel(m, **{**kwargs, "mixed_precision": None})
            unit._exempt_output_dtype = self.mixed_precision.param_dtype
            return unit

        made = apply_auto_wrap(module, exempting(policy, exempt) if exempt else policy, make_unit,
                               lambda m: isinstance(m, FullyShardedDataParallel))
        if made == 0:
            kinds = sorted({type(m).__name__ for m in module.modules()})
            raise ValueError(
                f"auto_wrap_policy wrapped no submodule of {type(module).__name__} (its module "
                f"classes: {', '.join(kinds)}): check transformer_layer_cls, or pass "
                "auto_wrap_policy=None to shard the whole model as one unit")

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

    def _adopt_units(self, tied: list[list[str]]) -> None:
        """This instance becomes the root of every unit below it; a parameter registered under
        names in two units (`tied`) is refused."""
        self._state = _RootState()
        for name, unit in self.named_modules():
            if isinstance(unit, FullyShardedDataParallel):
                object.__setattr__(unit, "_root", self)  # not a submodule: a back-reference
                unit._is_root, unit.unit_name = unit is self, clean_name(name)
                if unit._handle is not None:
                    unit._handle.name, unit._handle.on_event = unit.unit_name or "<root>", unit._on_event
        units = [u.unit_name for u in self.units() if u._handle is not None]
        for names in tied:
            owners = sorted({max((u for u in units if u == "" or n.startswith(f"{u}.")), key=len)
                             for n in names})
            if len(owners) > 1:
                raise ValueError(
                    f"a parameter is shared between units {owners[0] or '<root>'!r} and "
                    f"{owners[1] or '<root>'!r}: FSDP shards each unit's parameters separately, so "
                    "tied weights must live in one unit (wrap their common parent, or untie them)")

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
        if mp.param_dtype is not None and (mp.cast_root_forward_inputs if self._is_root
                                           else mp.cast_forward_inputs):
            args, kwargs = cast_floating(args, mp.param_dtype), cast_floating(kwargs, mp.param_dtype)
        if self._exempt_output_dtype is not None and self._handle is not None:
            dtype = self._handle.full.dtype
            args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
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
            output = cast_floating(output, self._exempt_output_dtype)
        if self._is_root:
            state.order_frozen = True
        needs_grad = [t for t in tensors_in(output) if t.requires_grad]
        if needs_grad and torch.is_grad_enabled():
            self._register_pre_backward(needs_grad)
            if not self._is_root and reshards_after_forward(self.sharding_strategy):
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
            if self.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:  # the next unit's backward
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
        """The unit's gradient is complete: free the gathered copy, (BACKWARD_POST) start gathering
        the unit whose backward runs next, start this unit's reduction (torch's order)."""
        grad, full.grad = full.grad, None
        self._root._queue_final_callback()
        self._reshard()
        if self.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
            self._prefetch(self._neighbour(-1))
        state = self._root._state
        self._handle.reduce_grad(grad, state.sync)
        if state.replicating is not None:  # HSDP: the previous unit's shard joins its replicas
            state.replicating.start_replicate()  # (its reduce-scatter overlapped this unit's backward)
        state.replicating = self._handle

    def _finish_backward(self) -> None:
        """End of backward (autograd-engine callback): every reduction has landed in `.grad`."""
        state = self._state
        state.in_backward, state.replicating = False, None
        for unit in self.units():
            if unit._handle is not None:
                unit._handle.finish_grad()
                unit._handle.reshard()

    def set_gradient_divide_factor(self, factor: float) -> None:
        """FSDP2's name and meaning (torch's FSDP1 has none): this unit's summed gradient is divided
        by `factor` instead of its group's size (s·r). Experts sharded over a subgroup of the
        data's ranks still average over every data-parallel rank (torchtitan sets dp·cp)."""
        if self._handle is not None:
            self._handle.dp_size = factor

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


for _name, _fix in NOT_IMPLEMENTED.items():  # torch's other FSDP1 methods: each call names the fix
    setattr(FullyShardedDataParallel, _name, not_implemented(_name, _fix))
