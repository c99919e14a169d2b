"""The knobs of torch's FSDP, with torch's names: ShardingStrategy, BackwardPrefetch, MixedPrecision,
auto-wrap policies, and the refusal of the options this FSDP does not implement.

A *unit* is a module whose parameters are flattened into one flat parameter and gathered together.
`auto_wrap_policy` decides which submodules become units, with torch's calling convention

    policy(module=m, recurse=True,  nonwrapped_numel=n) -> descend into m's children?
    policy(module=m, recurse=False, nonwrapped_numel=n) -> make m a unit (after its children)?

so the source article's `partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})`
works unchanged: every TransformerBlock becomes a unit, the root unit keeps what is left
(embeddings, final norm, output head). HSDP's two groups (`process_groups`) are resolved here
too: torch's default is the kernel's mesh (common/kernel/mesh.py) of one node per dp_shard line.
Depends only on torch and the kernel.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from common.kernel.mesh import MeshShape, build_mesh


class ShardingStrategy(enum.Enum):
    """What each rank keeps of a unit's parameters (P = parameters, N = ranks of the group):

    FULL_SHARD     P/N params, grads and optimizer state; gather in forward AND in backward (ZeRO-3)
    SHARD_GRAD_OP  P/N at rest; the gathered params live from forward to the end of backward (ZeRO-2-like)
    NO_SHARD       the whole P on every rank; gradients all-reduced (DDP with flat parameters)
    HYBRID_SHARD   HSDP: FULL_SHARD within a shard group of s ranks (a node), the shard's gradient
                   all-reduced over a replicate group of r ranks (the same local rank on each node):
                   P/s per rank, gathers over NVLink only, 2(r-1)/r · P/s · b over the network
    _HYBRID_SHARD_ZERO2  the same with SHARD_GRAD_OP within the shard group
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"


HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def reshards_after_forward(strategy: ShardingStrategy) -> bool:
    """FULL_SHARD and HYBRID_SHARD free a unit after its forward (gathered again for backward)."""
    return strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class BackwardPrefetch(enum.Enum):
    """torch's backward prefetch (None: none). Unit k-1 runs its backward after unit k:

    BACKWARD_PRE   gather k-1 when k's backward starts: overlaps it with k's gradient computation;
                   at the peak k, k-1 and k's gradient are whole (torch's default)
    BACKWARD_POST  gather k-1 when k's gradient is complete and k is freed: overlaps it with k's
                   reduce-scatter only; at the peak k-1 and k's gradient are whole
    """

    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"


@dataclass(frozen=True)
class MixedPrecision:
    """torch's fields and defaults. `param_dtype`: the gathered (compute) copy; `reduce_dtype`: the
    gradient reduction (None: param_dtype); `buffer_dtype`: the module's floating buffers (a state
    dict returns them in their own dtype). The sharded master parameter keeps the module's own
    dtype (fp32), and so do its gradient and the optimizer state. None = unchanged.
    `cast_root_forward_inputs`: the root casts floating-point inputs to param_dtype;
    `cast_forward_inputs`: every other unit does too. `_module_classes_to_ignore`: with an
    auto_wrap_policy (as in torch), modules of these classes (e.g. RMSNorm) become units of their
    own that gather, compute and reduce in the module's dtype (inputs cast to it, outputs back).
    `keep_low_precision_grads=True` is refused: gradients are always upcast to the master dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: tuple[type[nn.Module], ...] = (_BatchNorm,)

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"MixedPrecision({name}={dtype!r}): must be a floating-point "
                                 "torch.dtype (e.g. torch.bfloat16) or None")
        if self.keep_low_precision_grads:
            raise NotImplementedError(
                "MixedPrecision(keep_low_precision_grads=True) is not implemented: the gradient "
                "shard is upcast to the master dtype after the reduction; drop the argument")


def cast_floating(obj, dtype: torch.dtype):
    """`obj` (a tensor, or lists, tuples, dicts of them) with its floating-point tensors cast to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in `obj` (a tensor, or lists, tuples, dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


def check_options(process_group, sharding_strategy, backward_prefetch, cpu_offload, ignored_modules,
                  ignored_states, device_mesh, param_init_fn, shard_init_fn,
                  sync_module_states: bool, auto_wrap_policy=None) -> None:
    """torch's FSDP arguments this FSDP cannot honour fail here, before any collective, with the fix."""
    if not isinstance(sharding_strategy, ShardingStrategy):
        raise ValueError(f"sharding_strategy={sharding_strategy!r}: use a ShardingStrategy "
                         f"({', '.join(s.name for s in ShardingStrategy)})")
    check_process_group(process_group, sharding_strategy, auto_wrap_policy)
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise ValueError(f"backward_prefetch={backward_prefetch!r}: torch's FSDP takes a BackwardPrefetch "
                         "or None; pass backward_prefetch=BackwardPrefetch.BACKWARD_PRE (the default) "
                         "or None to disable it")
    if cpu_offload is not None and getattr(cpu_offload, "offload_params", True):
        raise NotImplementedError(f"cpu_offload={cpu_offload!r}: parameter offload is not implemented "
                                  "here (chapter 03's ZeRO offloads the optimizer); pass cpu_offload=None")
    for name, value in (("ignored_modules", ignored_modules), ("ignored_states", ignored_states)):
        if value:
            raise NotImplementedError(f"{name}: not implemented here, every parameter is sharded; "
                                      "keep those modules outside the FSDP-wrapped module")
    if device_mesh is not None:
        raise NotImplementedError("device_mesh: not implemented here; pass process_group= (a mesh's "
                                  "data-parallel group), or for HYBRID_SHARD process_group=(mesh."
                                  "get_group(1), mesh.get_group(0)) (shard, replicate: torch's mesh dims)")
    if param_init_fn is not None and shard_init_fn is not None:
        raise ValueError("param_init_fn and shard_init_fn both given: pass one (param_init_fn(module) "
                         "materializes a unit, shard_init_fn(name, meta_param) draws only this "
                         "rank's pieces)")
    if sync_module_states and shard_init_fn is not None:
        raise ValueError("sync_module_states=True with shard_init_fn: no rank holds whole parameters to "
                         "broadcast; make shard_init_fn deterministic (seeded) instead, and drop one")


# --- HSDP's two groups --------------------------------------------------------------------------

NODE_GROUPS = ("(mesh.group('dp_shard'), mesh.group('dp_replicate')) of common.kernel.mesh's "
               "build_mesh(MeshShape(dp_replicate=nodes, dp_shard=ranks_per_node))")

def check_process_group(process_group, sharding_strategy: ShardingStrategy, auto_wrap_policy) -> None:
    """torch's rules for `process_group`: a HYBRID strategy takes (shard_group, replicate_group) or
    None (then torch's default: the node's ranks, `process_groups`); the others take one group."""
    hybrid, pair = sharding_strategy in HYBRID_STRATEGIES, isinstance(process_group, tuple)
    if pair and not hybrid:
        raise ValueError(f"process_group=(shard_group, replicate_group) with {sharding_strategy}: a pair "
                         "of groups serves HYBRID_SHARD / _HYBRID_SHARD_ZERO2; pass one group, or "
                         "sharding_strategy=ShardingStrategy.HYBRID_SHARD")
    if not hybrid:
        return
    if pair and (len(process_group) != 2 or not all(isinstance(g, dist.ProcessGroup) for g in process_group)):
        raise ValueError(f"{sharding_strategy}: process_group={process_group!r} must be a tuple of two "
                         "ProcessGroups, (shard_group, replicate_group): torch's (intra-node, inter-node)")
    if pair:  # a rank's replicas hold its shard index on the other nodes: the groups meet in it alone
        shard, replicate = (dist.get_process_group_ranks(g) for g in process_group)
        if set(shard) & set(replicate) != {dist.get_rank()}:
            raise ValueError(f"{sharding_strategy}: process_group=(shard_group {shard}, replicate_group "
                             f"{replicate}) must share only this rank ({dist.get_rank()}), or replicas would "
                             f"hold different shards: build them as {NODE_GROUPS}")
    if process_group is not None and not pair:
        raise ValueError(f"{sharding_strategy} takes process_group=(shard_group, replicate_group) or None "
                         f"(the node's ranks), not one group ({type(process_group).__name__}): pass both "
                         f"groups, e.g. {NODE_GROUPS}")
    if process_group is None:
        if auto_wrap_policy is None:  # torch's rule: manually wrapped units would make groups each
            raise ValueError(f"Manual wrapping with {sharding_strategy} requires explicit specification of "
                             "process group: pass process_group=(shard_group, replicate_group) "
                             f"({NODE_GROUPS} is torch's default), or an "
                             "auto_wrap_policy")
        node_size(dist.get_world_size())


def node_size(world_size: int) -> int:
    """Ranks per node for torch's default HSDP groups: LOCAL_WORLD_SIZE (torchrun sets it; torch's
    FSDP counts the node's GPUs, the same under one process per GPU)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None or not value.isdigit() or int(value) < 1 or world_size % int(value):
        raise ValueError(f"HYBRID_SHARD with process_group=None shards within a node of LOCAL_WORLD_SIZE "
                         f"ranks, but LOCAL_WORLD_SIZE={value} (world size {world_size}): launch with "
                         "torchrun (equal nodes), or pass process_group=(shard_group, replicate_group), "
                         f"e.g. {NODE_GROUPS}")
    return int(value)


def process_groups(process_group, sharding_strategy: ShardingStrategy) -> tuple[object, object | None]:
    """(the group a unit shards over, the group its shards are all-reduced over or None); torch's
    defaults: the world, or for HSDP the node's ranks and their replicas."""
    if sharding_strategy not in HYBRID_STRATEGIES:
        return dist.group.WORLD if process_group is None else process_group, None
    if process_group is None:  # torch's default: node k's L ranks shard, local rank i's replicate
        per_node = node_size(dist.get_world_size())
        mesh = build_mesh(MeshShape(dp_replicate=dist.get_world_size() // per_node, dp_shard=per_node),
                          ("dp_shard", "dp_replicate"))
        return mesh.group("dp_shard"), mesh.group("dp_replicate")
    return process_group


AutoWrapPolicy = Callable[..., bool]


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type[nn.Module]]) -> bool:
    """torch's signature: descend everywhere; wrap each instance of `transformer_layer_cls`."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = 10**8,
                                force_leaf_modules: set[type[nn.Module]] | None = None,
                                exclude_wrap_modules: set[type[nn.Module]] | None = None) -> bool:
    """torch's: descend into, and wrap, a module once the parameters not yet in a unit below it
    reach `min_num_params`; never descend into `force_leaf_modules` (nn.MultiheadAttention), never
    wrap `exclude_wrap_modules` (nn.ModuleList, nn.ModuleDict: they have no forward)."""
    leaves = {nn.MultiheadAttention} if force_leaf_modules is None else force_leaf_modules
    excluded = {nn.ModuleList, nn.ModuleDict} if exclude_wrap_modules is None else exclude_wrap_modules
    large = nonwrapped_numel >= min_num_params
    return large and not isinstance(module, tuple(leaves if recurse else excluded))


class ModuleWrapPolicy:
    """`ModuleWrapPolicy({TransformerBlock})`: torch's class form of the transformer policy."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self.module_classes = tuple(module_classes)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return transformer_auto_wrap_policy(module, recurse, nonwrapped_numel, self.module_classes)


def exempting(policy: AutoWrapPolicy, classes: tuple[type[nn.Module], ...]) -> AutoWrapPolicy:
    """torch's `_or_policy(policy, each instance of classes)` for MixedPrecision's
    `_module_classes_to_ignore`: descend everywhere; wrap what `policy` wraps, and every instance
    of `classes` (whose children are not visited)."""
    def wrap(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if isinstance(module, classes):
            return not recurse
        return recurse or policy(module=module, recurse=False, nonwrapped_numel=nonwrapped_numel)
    return wrap


def _unwrapped_numel(module: nn.Module, is_unit: Callable[[nn.Module], bool]) -> int:
    """Parameters of `module` not already inside a unit below it."""
    if is_unit(module):
        return 0
    own = sum(p.numel() for p in module.parameters(recurse=False))
    return own + sum(_unwrapped_numel(c, is_unit) for c in module.children())


def apply_auto_wrap(module: nn.Module, policy: AutoWrapPolicy, wrap: Callable[[nn.Module], nn.Module],
                    is_unit: Callable[[nn.Module], bool], _wrapped: dict[int, str] | None = None,
                    _prefix: str = "") -> int:
    """Post-order: wrap the deepest qualifying submodules of `module` first (replacing each child
    by `wrap(child)`), never `module` itself. Returns how many units were made. A module reached
    twice (registered under two names) cannot become two units: that is a ValueError."""
    if _wrapped is None and not policy(module=module, recurse=True,
                                       nonwrapped_numel=_unwrapped_numel(module, is_unit)):
        return 0  # torch asks about the root too: no descent, one unit
    made, wrapped = 0, {} if _wrapped is None else _wrapped
    for name, child in list(module._modules.items()):  # not named_children(): it hides repeats
        if child is None:
            continue
        path = f"{_prefix}{name}"
        if id(child) in wrapped:
            raise ValueError(f"module {path!r} is the same module as the unit {wrapped[id(child)]!r}: "
                             "a module used twice must be wrapped once, by a common parent")
        if is_unit(child):
            continue
        if policy(module=child, recurse=True, nonwrapped_numel=_unwrapped_numel(child, is_unit)):
            made += apply_auto_wrap(child, policy, wrap, is_unit, wrapped, f"{path}.")
        if policy(module=child, recurse=False, nonwrapped_numel=_unwrapped_numel(child, is_unit)):
            wrapped[id(child)] = path
            setattr(module, name, wrap(child))
            made += 1
    return made
