"""The knobs of torch's FSDP, with torch's names: ShardingStrategy, MixedPrecision, auto-wrap.

A *unit* is a module whose parameters are flattened into one flat parameter and gathered together.
`auto_wrap_policy` decides which submodules become units, with torch's calling convention

    policy(module=m, recurse=True,  nonwrapped_numel=n) -> descend into m's children?
    policy(module=m, recurse=False, nonwrapped_numel=n) -> make m a unit (after its children)?

so the source article's `partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})`
works unchanged: every TransformerBlock becomes a unit, the root unit keeps what is left
(embeddings, final norm, output head). Depends only on torch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn


class ShardingStrategy(enum.Enum):
    """What each rank keeps of a unit's parameters (P = parameters, N = ranks of the group):

    FULL_SHARD     P/N params, grads and optimizer state; gather in forward AND in backward (ZeRO-3)
    SHARD_GRAD_OP  P/N at rest; the gathered params live from forward to the end of backward (ZeRO-2-like)
    NO_SHARD       the whole P on every rank; gradients all-reduced (DDP with flat parameters)
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"


@dataclass(frozen=True)
class MixedPrecision:
    """`param_dtype`: the gathered (compute) copy; `reduce_dtype`: the gradient reduce-scatter;
    `buffer_dtype`: the module's floating buffers. The sharded master parameter keeps the
    module's own dtype (fp32), and so do its gradient and the optimizer state. None = unchanged.
    `_module_classes_to_ignore` (torch's name): modules of these classes (e.g. RMSNorm) become
    units of their own that gather, compute and reduce in the module's dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True  # the root casts floating-point inputs to param_dtype
    _module_classes_to_ignore: tuple[type[nn.Module], ...] = ()

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"MixedPrecision({name}={dtype!r}): must be a floating-point "
                                 "torch.dtype (e.g. torch.bfloat16) or None")


AutoWrapPolicy = Callable[..., bool]


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type[nn.Module]]) -> bool:
    """torch's signature: descend everywhere; wrap each instance of `transformer_layer_cls`."""
    if recurse:
        return True
    return isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = 10**8) -> bool:
    """Wrap a module once the parameters not yet in a unit below it reach `min_num_params`."""
    return True if recurse else nonwrapped_numel >= min_num_params


class ModuleWrapPolicy:
    """`ModuleWrapPolicy({TransformerBlock})`: torch's class form of the transformer policy."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self.module_classes = tuple(module_classes)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return transformer_auto_wrap_policy(module, recurse, nonwrapped_numel, self.module_classes)


def exempting(policy: AutoWrapPolicy | None, classes: tuple[type[nn.Module], ...]) -> AutoWrapPolicy:
    """`policy`, except that every instance of `classes` becomes a unit (its children are not
    visited); without a policy, descend everywhere and wrap only those."""
    def wrap(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if isinstance(module, classes):
            return not recurse
        if policy is None:
            return recurse
        return policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)
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
