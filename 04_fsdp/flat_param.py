"""One FSDP unit's parameters as one flat, padded tensor, sharded 1/N across a process group.

    flat   = cat(p.flatten() for p in unit) ++ zeros(pad)      numel P_u, padded to N·S
    shard  = flat[r·S : (r+1)·S]                               what rank r keeps (the nn.Parameter)
    full   = all_gather(shard.to(param_dtype))                 the unit's compute copy, P_u·b_param bytes
    grad   = reduce_scatter(full.grad.to(reduce_dtype), SUM)/N  → shard.grad
    HSDP   : grad = all_reduce(reduce_scatter(full.grad, SUM over the shard group of s),
                               SUM over the replicate group of r) / (s·r)

`full` is a leaf tensor that requires grad; the unit's modules see views of it as their weights
(`module.weight = full[o:o+n].view(shape)`), so autograd sums every use of a weight into
`full.grad`, and a post-accumulate-grad hook on `full` fires once per backward when the unit's
gradient is complete. Freeing `full` releases its storage (`untyped_storage().resize_(0)`) but
keeps the tensor and its views: the activations autograd saved in forward still point at that
storage, so gathering into it again before the unit's backward makes them valid again (torch's
FSDP does the same). The gather writes through `full.data`, which shares the storage but not the
version counter, so autograd does not see the refill as an in-place change.

The shard is filled parameter by parameter (`flat` itself is never built), and a unit built on
the meta device gets each overlapping parameter's values from a callback: a rank materializes
its 1/N, not the unit. With one shard (NO_SHARD, or a group of one) and no dtype change, `full`
aliases the shard's storage: nothing is gathered or freed.

Rank r holds elements [r·S, (r+1)·S) of `flat`, so of a parameter at flat offset o with n elements
it holds [max(r·S, o), min((r+1)·S, o+n)) − o: `ParamShard` (name, shape, offset, numel, and where
the piece sits in the shard); `UnitShard` is one unit's public description. With `orig_params`
(torch's use_orig_params=True) each original parameter stays registered as a view of its piece
(1-D while sharded, its own shape with one shard), and its `.grad` is a view of the gradient shard.
Depends only on torch and common/kernel/collectives.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.collectives import all_gather_single, reduce_scatter_single


@dataclass(frozen=True)
class ParamShard:
    """The piece of one original parameter this rank holds: `param.flatten()[offset : offset+numel]`,
    stored at `flat_param[shard_offset : shard_offset+numel]` (numel 0: it holds none of it)."""

    name: str  # original name from the FSDP root, wrapper segments removed
    shape: torch.Size  # the parameter's full shape
    offset: int
    numel: int
    shard_offset: int


@dataclass(frozen=True)
class UnitShard:
    """One FSDP unit with parameters, as this rank holds it (see FullyShardedDataParallel.shard_layout).
    The dtypes come from the unit's MixedPrecision config (None there: the shard's own dtype)."""

    name: str  # the unit's module path from the root; "" is the root unit
    flat_param: nn.Parameter  # this rank's 1-D shard; `.grad` is its gradient shard after backward
    params: tuple[ParamShard, ...]  # every original parameter of the unit, in flat order
    numel: int  # P_u
    padded_numel: int  # P_u rounded up to shard_world · shard_numel
    shard_numel: int
    shard_rank: int
    shard_world: int  # 1 for NO_SHARD (or a group of one)
    param_dtype: torch.dtype  # what is gathered and computed with
    reduce_dtype: torch.dtype  # what gradients are reduced in
    full: torch.Tensor  # the gathered copy (its storage is empty while resharded)
    aliased: bool  # `full` is the shard itself: never gathered nor freed

    @property
    def full_bytes(self) -> int:
        return self.padded_numel * self.param_dtype.itemsize


class FlatParamHandle:
    """The flat parameter of one unit: its shard, its gathered copy, its gradient reduction.

    `params`: (name, owner module, attribute) for each parameter of the unit, in registration
    order; a parameter reachable under several names (tied within the unit) is stored once.
    Parameters on the meta device get their values from `init_fn(param)` (the full tensor, on
    any device), called only for those that overlap this rank's shard, one at a time: a rank
    holds its shard and one parameter at most. The shard is allocated on `init_device` (default:
    the parameters' device, CPU for meta ones).
    `orig_params`: keep each original parameter registered, as a view of its piece of the shard.
    `replicate_group` (HSDP): the reduced shard is all-reduced over it too (`start_replicate`)."""

    def __init__(self, params: list[tuple[str, nn.Module, str]], group, shard: bool,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                 on_event: Callable[[str, FlatParamHandle], None] | None = None,
                 init_fn: Callable[[nn.Parameter], torch.Tensor] | None = None,
                 init_device: torch.device | None = None, orig_params: bool = False,
                 replicate_group=None):
        self.group, self.on_event, self.name = group, on_event, ""
        self.group_size = dist.get_world_size(group)
        self.replicate_group = replicate_group  # HSDP: the shards' replicas on other nodes
        self.replicate_size = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.dp_size = self.group_size * self.replicate_size  # the gradient's divisor
        self.shard_world = self.group_size if shard else 1
        self.shard_rank = dist.get_rank(group) if shard else 0
        unique: dict[int, int] = {}
        originals: list[nn.Parameter] = []
        self.names, self.shapes, self.setters = [], [], []
        for name, module, attr in params:
            p = module._parameters[attr]
            if id(p) not in unique:
                unique[id(p)] = len(originals)
                originals.append(p)
                self.names.append(name)
                self.shapes.append(p.shape)
            self.setters.append((module, attr, unique[id(p)]))
        dtypes = {p.dtype for p in originals}
        devices = {p.device for p in originals}
        grads = {p.requires_grad for p in originals}
        if len(dtypes) > 1 or len(devices) > 1 or len(grads) > 1:
            raise ValueError(f"a unit's parameters must share dtype, device and requires_grad; "
                             f"{self.names} have {dtypes}, {devices}, requires_grad {grads}: wrap "
                             "the differing modules as separate units")
        self.numels = [p.numel() for p in originals]
        self.numel = sum(self.numels)
        self.shard_numel = -(-self.numel // self.shard_world)  # ceil
        self.padded = self.shard_numel * self.shard_world
        self.pad = self.padded - self.numel
        dtype, device = dtypes.pop(), devices.pop()
        if device.type == "meta" and init_fn is None:
            raise ValueError(f"{self.names} are on the meta device: pass init_fn")
        device = torch.device(init_device or ("cpu" if device.type == "meta" else device))
        shard = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, (offset, n, at) in zip(originals, self.pieces(), strict=True):
                if n:
                    full = init_fn(p) if p.is_meta else p.detach()
                    shard[at : at + n] = full.reshape(-1)[offset : offset + n]
                    del full  # a drawn parameter must not outlive its copy: peak = shard + one
        del p
        self.flat_param = nn.Parameter(shard, requires_grad=grads.pop())
        self.orig: list[nn.Parameter] | None = None
        if orig_params:
            self.orig = [nn.Parameter(piece, requires_grad=self.flat_param.requires_grad)
                         for piece in self.split_shard(shard)]
        for module, attr, i in self.setters:
            if self.orig is None:
                delattr(module, attr)  # the module's weights become views of `full` in forward
            else:
                module._parameters[attr] = self.orig[i]
        originals.clear()  # the unit's whole parameters are freed here, before `full` is allocated
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.alias = self.shard_world == 1 and self.param_dtype == dtype
        if self.alias:  # one shard, same dtype: `full` IS the shard's storage
            self.full = torch.empty(0, dtype=dtype, device=device)
            self.full.set_(self.flat_param.untyped_storage(), 0, (self.padded,), (1,))
        else:
            self.full = torch.empty(self.padded, dtype=self.param_dtype, device=device)
            self.full.untyped_storage().resize_(0)
        self.full.requires_grad_(self.flat_param.requires_grad)
        self.allocated = self.alias
        self._gather: tuple[dist.Work | None, torch.Tensor] | None = None
        self._reduce: tuple[dist.Work | None, torch.Tensor, torch.Tensor | None] | None = None
        self._replicating = False  # HSDP: `_reduce` waits for the all-reduce over the replicas
        self._accumulated: torch.Tensor | None = None  # unsharded gradient under no_sync

    @property
    def full_bytes(self) -> int:
        """Bytes of the gathered copy: P_u (padded) · b_param."""
        return self.padded * self.full.element_size()

    # --- which piece of each parameter this rank holds ----------------------------------------

    def pieces(self) -> list[tuple[int, int, int]]:
        """(offset in the parameter, numel held, offset in the shard) for each parameter."""
        start, out, offset = self.shard_rank * self.shard_numel, [], 0
        end = start + self.shard_numel
        for n in self.numels:
            lo, hi = max(start, offset), min(end, offset + n)
            out.append((lo - offset, hi - lo, lo - start) if lo < hi
                       else (0, 0, min(max(offset - start, 0), self.shard_numel)))
            offset += n
        return out

    def param_shards(self, prefix: str, clean: Callable[[str], str]) -> tuple[ParamShard, ...]:
        return tuple(ParamShard(clean(prefix + name), shape, offset, n, at) for name, shape, (offset, n, at)
                     in zip(self.names, self.shapes, self.pieces(), strict=True))

    def split_shard(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's piece of a shard-sized tensor, as views: its own shape with one
        shard, else 1-D (torch's use_orig_params shapes)."""
        flat = flat.detach()
        return [flat[at : at + n].view(shape) if self.shard_world == 1 else flat[at : at + n]
                for (_, n, at), shape in zip(self.pieces(), self.shapes, strict=True)]

    # --- forward / backward life cycle --------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Allocate `full` and all-gather the shards into it (cast to param_dtype first)."""
        if self.allocated:
            return
        self.full.untyped_storage().resize_(self.full_bytes)
        self.allocated = True
        if self.on_event:
            self.on_event("gather", self)
        source = self.flat_param.detach().to(self.param_dtype)
        if self.shard_world == 1:
            self.full.data.copy_(source)
            return
        work = all_gather_single(self.full.data, source, self.group, async_op=async_op)
        self._gather = (work, source) if async_op else None

    def wait_unshard(self) -> None:
        if self._gather is not None:
            work, _ = self._gather
            self._gather = None
            work.wait()

    def use_views(self) -> None:
        """Point every parameter attribute of the unit at its slice of `full`."""
        views = self.full.split([*self.numels, self.pad] if self.pad else self.numels)
        for module, attr, i in self.setters:
            module._parameters.pop(attr, None)  # an original parameter steps aside for the forward
            setattr(module, attr, views[i].view(self.shapes[i]))

    def register_orig_params(self) -> None:
        """After the forward: register the original parameters (views of the shard) again."""
        if self.orig is not None:
            for module, attr, i in self.setters:
                module.__dict__.pop(attr, None)
                module._parameters[attr] = self.orig[i]

    def reshard(self) -> None:
        """Free the gathered copy (its views and saved activations keep the empty storage)."""
        if self.alias or not self.allocated:
            return
        self.wait_unshard()
        self.full.untyped_storage().resize_(0)
        self.allocated = False
        if self.on_event:
            self.on_event("free", self)

    def reduce_grad(self, grad: torch.Tensor, sync: bool) -> None:
        """Cast the unit's full gradient to reduce_dtype; under no_sync keep summing it locally,
        else start the SUM reduce-scatter (all-reduce for NO_SHARD) asynchronously (HSDP: the
        all-reduce over the replicas follows in `start_replicate`)."""
        grad = grad.to(self.reduce_dtype)
        if self._accumulated is not None:
            grad = self._accumulated.add_(grad)
            self._accumulated = None
        if not sync:
            self._accumulated = grad
            return
        if self.group_size == 1:
            self._reduce = (None, grad, grad)
        elif self.shard_world == 1:
            work = dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._reduce = (work, grad, grad)
        else:
            out = grad.new_empty(self.shard_numel)
            self._reduce = (reduce_scatter_single(out, grad, group=self.group, async_op=True), out, grad)
        self._replicating = False

    def start_replicate(self) -> None:
        """HSDP: wait for the shard's reduce-scatter, start its SUM all-reduce over the replicate
        group (asynchronous; torch issues it right after the reduce-scatter, on its own stream)."""
        if self._reduce is None or self._replicating or self.replicate_size == 1:
            return
        work, out, _ = self._reduce
        if work is not None:
            work.wait()
        work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.replicate_group, async_op=True)
        self._reduce, self._replicating = (work, out, None), True  # the unit's full gradient is free

    def finish_grad(self) -> None:
        """Wait for the reduction, divide by the data-parallel size (s·r: every rank's micro-batch
        entered the SUM) and accumulate into the shard's `.grad`."""
        self.start_replicate()
        if self._reduce is None:
            return
        work, out, _ = self._reduce
        self._reduce = None
        if work is not None:
            work.wait()
        if self.dp_size > 1:
            out.div_(self.dp_size)
        out = out.to(self.flat_param.dtype)
        if self.orig is not None:
            self._take_orig_grads()
        if self.flat_param.grad is None:
            self.flat_param.grad = out
        else:
            self.flat_param.grad.add_(out)
        if self.orig is not None:  # the original parameters' grads are views of the gradient shard
            for p, piece in zip(self.orig, self.split_shard(self.flat_param.grad), strict=True):
                p.grad = piece

    def _take_orig_grads(self) -> None:
        """What the user's optimizer did to the original parameters' grads since the last backward
        (zero_grad(set_to_none=True), an assignment) becomes the gradient shard's state."""
        flat = self.flat_param.grad
        if flat is None:
            return
        if all(p.grad is None for p in self.orig):
            self.flat_param.grad = None
            return
        for p, piece in zip(self.orig, self.split_shard(flat), strict=True):
            if p.grad is None:
                piece.zero_()
            elif p.grad.data_ptr() != piece.data_ptr():
                piece.copy_(p.grad)

    # --- whole tensors, for checks and checkpoints (collectives over the group) ---------------

    def gather(self, shard: torch.Tensor | None) -> torch.Tensor:
        """The full flat tensor from every rank's shard-sized `shard` (None: zeros)."""
        shard = (torch.zeros_like(self.flat_param) if shard is None else shard).detach()
        if self.shard_world == 1:
            return shard
        out = shard.new_empty(self.padded)
        all_gather_single(out, shard.contiguous(), self.group)
        return out

