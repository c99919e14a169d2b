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
after.

While a gradient lives only in the shards, `p.grad` holds a `ShardedGrad`: the parameter's shape,
dtype and device, no storage, and an error naming the fix for any read. Depends only on torch and
common/kernel/collectives.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from common.kernel.collectives import all_gather_single, reduce_scatter_single

from .sole_reducer import WRAPPED


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


def restrict_units(units: list[Unit], params: list[nn.Parameter]) -> list[Unit]:
    """The units with only the members in `params` (one param group), empty ones dropped."""
    ids = {id(p) for p in params}
    kept = [(mod, [(n, p) for n, p in members if id(p) in ids], persistent)
            for mod, members, persistent in units]
    return [unit for unit in kept if unit[1]]


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
    # gradients: `grad_flat` holds local ones not reduced yet (`window`), `shard_grad` reduced
    # ones (`reduced`); stages 0-1 keep `grad_flat` (`keep_grads`: the shard is a slice of it) and
    # move the shard to `saved` while a window accumulates; `grads`: what each p.grad shows
    keep_grads: bool = True
    window: bool = False
    reduced: bool = False
    saved: torch.Tensor | None = None
    grads: list[torch.Tensor] = field(default_factory=list)

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

    # --- gradients: local bucket → reduced shard ------------------------------------------------
    def open_window(self, dtype: torch.dtype, device: torch.device) -> None:
        """The first gradient since the last reduction: a zeroed local bucket. Where the shard
        is a slice of the bucket (stages 0-1), what it holds moves aside until `complete`."""
        if self.keep_grads:
            self.saved = self.shard_grad.clone() if self.reduced else None
            self.grad_flat.zero_()
        else:
            self.grad_flat = torch.zeros(self.padded, dtype=dtype, device=device)
        self.window = True

    def reduce(self, group, all_reduce: bool) -> None:
        """Launch the bucket's SUM over `group`, asynchronously: all-reduced in place where every
        rank owns everything (stage 0), else this rank's slice reduce-scattered into `recv`."""
        if all_reduce:
            self.work = dist.all_reduce(self.grad_flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        else:
            self.recv = torch.empty(self.shard_size, dtype=self.grad_flat.dtype, device=self.grad_flat.device)
            self.work = reduce_scatter_single(self.recv, self.grad_flat, group=group, async_op=True)

    def complete(self, n: int) -> None:
        """After the reduction landed: shard += sum / n (never ReduceOp.AVG), plus what was moved
        aside; a bucket that is not kept is dropped."""
        self.work.wait()
        if self.recv is None:
            self.grad_flat.div_(n)
        elif self.keep_grads:
            self.shard_grad.copy_(self.recv.div_(n))
        else:
            self.shard_grad.add_(self.recv.div_(n))
            self.grad_flat = None
        if self.saved is not None:
            self.shard_grad.add_(self.saved)
        self.work, self.recv, self.saved, self.window, self.reduced = None, None, None, False, True

    def zero_grad(self) -> None:
        """Zero every gradient this rank keeps (reduced, local, moved aside)."""
        (self.grad_flat if self.keep_grads else self.shard_grad).zero_()
        if not self.keep_grads:
            self.grad_flat = None
        self.saved, self.window, self.reduced = None, False, False

    def make_grads(self, where: str | None) -> None:
        """What each p.grad shows after a backward: a view of the full reduced gradient (`where`
        None: stage 0 in the parameter's dtype), or a `ShardedGrad` saying `where` it lives."""
        self.grads = [self.split(self.grad_flat)[name] if where is None else ShardedGrad(
            p, f"{name}.grad lives in ZeroOptimizer's flat buffers ({where}), so it cannot be read or "
            "changed through p.grad: clip with opt.clip_grad_norm_(max_norm) instead of "
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), and read gradients with "
            "opt.full_gradients(); " + WRAPPED, lambda i=i: self.forget_grad(i))
            for i, (name, p) in enumerate(zip(self.names, self.params, strict=True))]

    def show_grads(self) -> None:
        for p, grad in zip(self.params, self.grads, strict=True):
            p.grad = grad

    def read_user_grads(self) -> None:
        """Before a backward adds to the gradients: a p.grad set to None since is a zero gradient
        (torch's meaning); one replaced by another tensor cannot be honoured."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                self.forget_grad(i)
            elif p.grad is not self.grads[i]:
                raise RuntimeError(f"{self.names[i]}.grad was replaced by another tensor; ZeroOptimizer "
                                   "keeps gradients in its own buffers: change p.grad in place, set it "
                                   "to None, or call model.zero_grad()")

    def forget_grad(self, i: int) -> None:
        """Parameter i's gradient is 0 from now on (torch: `.grad = None` or `.grad.zero_()`):
        zero its span wherever this rank keeps part of it (local, reduced or saved)."""
        lo, hi = self.offsets[i], self.offsets[i] + self.params[i].numel()
        for t, start in ((self.grad_flat, 0), (self.shard_grad, self.start), (self.saved, self.start)):
            if t is not None and (self.window or self.reduced):
                t[max(lo - start, 0) : max(min(hi - start, t.numel()), 0)].zero_()

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
        self.gather_work = all_gather_single(self.flat, self.gather_input, group, async_op=True)
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work, self.gather_input = None, None
            self.gathered = True


def all_gather_shards(groups: list[FlatGroup], group, max_elements: int) -> None:
    """Every owner's shard into every rank's flat parameters (after a step), one all-gather per
    persistent group, at most `max_elements` in flight (DeepSpeed's `allgather_bucket_size`)."""
    in_flight, elements = [], 0
    for g in groups:
        if not g.persistent:
            continue
        if in_flight and elements + g.padded > max_elements:
            for work in in_flight:
                work.wait()
            in_flight, elements = [], 0
        in_flight.append(all_gather_single(g.flat, g.shard.clone(), group, async_op=True))
        elements += g.padded
    for work in in_flight:
        work.wait()


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


class ShardedGrad(torch.Tensor):
    """What `p.grad` holds while the gradient lives in ZeRO's shards: the parameter's shape, dtype
    and device, and no storage. Any real op on it (a norm, `mul_`, an optimizer's update,
    GradScaler's `unscale_`, `clone`) raises `message`, which names the fix, so that torch's
    `clip_grad_norm_(model.parameters())` cannot silently clip nothing. `zero_()` zeroes the
    gradient it stands for (`on_zero`) and `detach()` is itself, so torch's
    `zero_grad(set_to_none=False)` keeps its meaning."""

    message: str
    on_zero: Callable[[], None]

    @staticmethod
    def __new__(cls, param: torch.Tensor, message: str, on_zero: Callable[[], None]):
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        t.message, t.on_zero = message, on_zero
        return t

    def __repr__(self) -> str:
        return f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}): {self.message}"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func is aten.zero_.default:
            args[0].on_zero()
            return args[0]
        if func is aten._foreach_zero_.default:  # Optimizer.zero_grad(set_to_none=False)
            for t in args[0]:
                t.on_zero() if isinstance(t, ShardedGrad) else t.zero_()
            return None
        if func in (aten.detach.default, aten.detach_.default, aten.alias.default):
            return args[0]
        leaves, _ = tree_flatten((args, kwargs or {}))
        raise RuntimeError(next(t for t in leaves if isinstance(t, ShardedGrad)).message)
