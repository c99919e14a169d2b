"""Flat parameter groups: the memory layout every ZeRO stage is built on.

A group's parameters are laid end to end in one flat buffer, padded to a multiple of N, and rank r
of N owns the contiguous slice [r·s, (r+1)·s) with s = ⌈numel / N⌉:

    flat   │ wq ............ │ wk ....... │ norm │pad│       numel = Σ pᵢ, padded = N·s
    owner  │ rank 0      │ rank 1      │ rank 2      │ rank 3      │

With whole-parameter ownership (`assign_owners`) rank r's tensors are laid inside slice r
instead, so that no tensor crosses a slice boundary (s: the largest rank's share).

Each parameter is then a view of its span (`p.data = flat[off : off + n].view(shape)`), so the
model runs unchanged on the flat storage. Padding never belongs to a parameter: its gradient is
never written (it stays 0), so it adds nothing to a norm and the optimizer leaves it at 0.

Stages 0-2 group the parameters in reduce buckets (`reduce_bucket_size` elements, reverse
registration order: the order backward produces gradients); stage 3 groups them per unit (a
transformer block, or a module the blocks leave out), gathered before its forward and freed
after. Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


def padded_size(numel: int, world: int) -> int:
    """The smallest multiple of `world` >= numel (the flat buffer's length)."""
    return -(-numel // world) * world


def assign_buckets(named: list[tuple[str, nn.Parameter]],
                   bucket_size: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Reverse registration order, a new bucket when `bucket_size` elements would be exceeded; a
    parameter larger than the bucket gets a bucket of its own (as DeepSpeed's ipg bucket)."""
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in reversed(named):
        if not buckets or size + p.numel() > bucket_size:
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += p.numel()
    return buckets


Unit = tuple[nn.Module, list[tuple[str, nn.Parameter]], bool]
UnitPolicy = Callable[[nn.Module], bool]


def module_list_items(root: nn.Module) -> UnitPolicy:
    """The default unit policy: every item of an `nn.ModuleList` under `root` (a transformer's
    `layers`: one unit per block), found by identity, so it needs no import of the model's classes."""
    items = {id(m) for mod in root.modules() if isinstance(mod, nn.ModuleList) for m in mod}
    return lambda module: id(module) in items


def module_units(module: nn.Module, threshold: int, policy: UnitPolicy | None = None) -> list[Unit]:
    """Stage 3's units: (module, parameters, persistent?) in registration order. A module that
    `policy` picks is one unit holding every parameter below it (a transformer block: one
    all-gather instead of one per Linear; FSDP's `auto_wrap_policy`, DeepSpeed's z3 leaf modules);
    every other module with parameters of its own outside any picked module is a unit of those
    (the root's leftovers: embedding, final norm, output head). `policy` defaults to
    `module_list_items(module)`; `lambda m: False` gives one unit per module (DeepSpeed's default).
    Parameters under `threshold` elements form a separate persistent unit of their module: they
    stay whole on every rank (DeepSpeed's `param_persistence_threshold`), since gathering a tiny
    tensor costs latency, not memory."""
    policy = module_list_items(module) if policy is None else policy
    units: list[Unit] = []
    inside, taken = set(), set()  # modules under a picked unit; parameters already in a unit
    for prefix, mod in module.named_modules():
        if id(mod) in inside:
            continue
        if policy(mod):
            inside.update(id(m) for m in mod.modules())
            named = mod.named_parameters(prefix=prefix)
        else:
            named = ((f"{prefix}.{n}" if prefix else n, p) for n, p in mod.named_parameters(recurse=False))
        own = [(n, p) for n, p in named if p.requires_grad and id(p) not in taken]
        taken.update(id(p) for _, p in own)
        for persistent in (False, True):
            members = [(n, p) for n, p in own if (p.numel() < threshold) == persistent]
            if members:
                units.append((mod, members, persistent))
    return units


@dataclass
class FlatGroup:
    """One flat buffer of parameters, its gradient buffer, and this rank's shard of both.

    `flat`: the full parameters in the compute dtype (views are the model's parameters);
    `shard`: this rank's slice of them (a view of `flat`, or in stage 3 a tensor of its own);
    `grad_flat`: the full gradient in the reduce dtype while it exists; `shard_grad`: the reduced
    gradient of this rank's slice; `master`: what the optimizer updates (the shard itself, or an
    fp32 / offloaded copy of it)."""

    names: list[str]
    params: list[nn.Parameter]
    world: int
    rank: int
    persistent: bool = True  # stage 3: False means `flat` is gathered before use and freed after
    numel: int = 0  # elements laid out: Σ pᵢ (whole-parameter ownership: with each slice's padding)
    offsets: list[int] = field(default_factory=list)
    flat: torch.Tensor | None = None
    shard: torch.Tensor | None = None
    grad_flat: torch.Tensor | None = None
    shard_grad: torch.Tensor | None = None
    master: torch.Tensor | None = None
    host_grad: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    work: object | None = None
    recv: torch.Tensor | None = None
    gather_work: object | None = None
    gather_input: torch.Tensor | None = None
    gathered: bool = True

    @property
    def padded(self) -> int:
        return padded_size(self.numel, self.world)

    @property
    def shard_size(self) -> int:
        return self.padded // self.world

    @property
    def start(self) -> int:
        return self.rank * self.shard_size

    def full_values(self, dtype: torch.dtype, device: torch.device,
                    init: Callable[[str], torch.Tensor] | None = None) -> torch.Tensor:
        """The parameters' current values flattened and zero-padded, in `dtype`; a parameter on
        the meta device takes `init(name)` (its full initial values, drawn one at a time)."""
        out = torch.zeros(self.padded, dtype=dtype, device=device)
        for name, p, off in zip(self.names, self.params, self.offsets, strict=True):
            out[off : off + p.numel()].copy_((init(name) if p.is_meta else p.detach()).reshape(-1))
        return out

    def bind(self, values: torch.Tensor, dtype: torch.dtype) -> None:
        """Make each parameter a view of a new flat buffer holding `values` cast to `dtype` (a
        meta parameter cannot take CPU or GPU `.data`: it swaps contents, keeping its identity)."""
        self.flat = values.to(dtype=dtype, copy=True)
        for p, off in zip(self.params, self.offsets, strict=True):
            view = self.flat[off : off + p.numel()].view(p.shape)
            if p.is_meta:  # an empty tensor on the flat's device first, which `.data` can replace
                torch.utils.swap_tensors(p, nn.Parameter(view.new_empty(0), requires_grad=p.requires_grad))
            # `.data`, not a Parameter made from the view: the parameter keeps its own version
            # counter, so stage 3's gather into `flat` does not invalidate what autograd saved
            p.data = view

    def split(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """A full flat tensor → {name: view shaped like the parameter} (padding dropped)."""
        return {name: full[off : off + p.numel()].view(p.shape)
                for name, p, off in zip(self.names, self.params, self.offsets, strict=True)}

    # --- stage 3: gather before use, free after ----------------------------------------------
    def free(self) -> None:
        """Release the full parameters' storage (the views keep their shapes, not their bytes)."""
        if not self.persistent and self.gathered:
            self.flat.untyped_storage().resize_(0)
            self.gathered = False

    def gather(self, group, async_op: bool = True) -> None:
        """Re-allocate the full buffer and all-gather every rank's shard into it."""
        if self.gathered or self.gather_work is not None:
            return
        self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
        self.gather_input = self.shard.to(self.flat.device, non_blocking=True)  # offload_param: H2D
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.gather_work = gather(self.flat, self.gather_input, group=group, async_op=True)
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work, self.gather_input = None, None
            self.gathered = True


def assign_owners(params: list[nn.Parameter], world: int) -> dict[int, int]:
    """Whole-parameter ownership: largest tensor first, each to the rank holding the fewest
    elements so far (ties: the lower rank), as torch's ZeroRedundancyOptimizer partitions.
    {id(p): rank}."""
    load, owner = [0] * world, {}
    for p in sorted(params, key=lambda p: -p.numel()):  # stable: registration order among equals
        rank = min(range(world), key=load.__getitem__)
        owner[id(p)] = rank
        load[rank] += p.numel()
    return owner


def make_groups(named_groups: list[list[tuple[str, nn.Parameter]]], world: int, rank: int,
                persistent: list[bool] | None = None,
                owner: dict[int, int] | None = None) -> list[FlatGroup]:
    """Lay each list of parameters end to end. With `owner` ({id(p): rank}, `assign_owners`)
    rank r's parameters are laid inside its own slice instead, so that every slice holds whole
    tensors: s = the largest rank's share of the group, the rest of each slice padding."""
    groups = []
    for i, members in enumerate(named_groups):
        g = FlatGroup([n for n, _ in members], [p for _, p in members], world, rank,
                      persistent=True if persistent is None else persistent[i])
        if owner is None:
            offset = 0
            for p in g.params:
                g.offsets.append(offset)
                offset += p.numel()
            g.numel = offset
        else:
            shares = [[p for p in g.params if owner[id(p)] == r] for r in range(world)]
            size = max(1, *(sum(p.numel() for p in share) for share in shares))
            where = {}
            for r, share in enumerate(shares):
                offset = r * size
                for p in share:
                    where[id(p)], offset = offset, offset + p.numel()
            g.offsets, g.numel = [where[id(p)] for p in g.params], world * size
        groups.append(g)
    return groups
