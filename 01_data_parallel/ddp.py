"""DistributedDataParallel from scratch: bucketed gradient all-reduce that overlaps backward.

Gradients become ready in roughly reverse registration order (the last layer's first), so the
parameters are packed in that order into flat buckets of at most `bucket_cap_mb`. From its first
backward on, `param.grad` is a view of its bucket slot (torch's `gradient_as_bucket_view`), so
autograd accumulates into the bucket in place and there is one copy of the gradients, not two. A hook
fires as each parameter's gradient is accumulated; when the last gradient of a bucket lands, the
bucket's all-reduce starts asynchronously while autograd goes on computing the earlier layers. At
the end of backward (an autograd-engine callback, as in torch's DDP) every bucket is waited for
and divided by n, so `loss.backward(); optimizer.step()` works unchanged:

    g = (1/n) Σ_r g_r          wire bytes per rank per step: 2(n-1)/n · P · bytes_per_grad

the same bytes as the naive version in ⌈P·b / bucket_cap⌉ calls instead of one per tensor, and
mostly hidden behind backward. Buckets launch strictly in index order on every rank, so the
collectives match across ranks even if autograd's order differs.

`reduce_dtype=torch.float32` with bf16 parameters keeps the buckets in fp32 (Megatron's
`main_grad`): each micro-batch's bf16 gradient is added into `param.main_grad` and freed, and the
sum is reduced in fp32 (2(n-1)/n · P · 4 bytes).

torch's arguments keep torch's meaning: `device_ids=[i]` (the module's device; inputs are moved
there), `process_group`, `bucket_cap_mb` (None: torch's 25 MiB, with the first bucket capped at
1 MiB so that it launches early; 0: a bucket per parameter; `math.inf`: one bucket per dtype),
`broadcast_buffers` (rank 0's buffers at every forward), `find_unused_parameters`, `no_sync()` and
`require_backward_grad_sync` (nanoGPT sets it per micro-batch), `zero_grad(set_to_none=True)` (a
`.grad` set to None is re-adopted by its bucket slot at the next backward, as torch's does with
`gradient_as_bucket_view`), and `state_dict()` keys start with "module.". Any other torch
argument is a TypeError. A parameter that gets no gradient in a step (a branch not taken, on some
ranks or on all) is an error naming it, unless `find_unused_parameters=True`: then, as torch does,
it is marked ready at the end of backward with a zero gradient, so every rank reduces every bucket,
and one all-reduce of a used-flag per parameter finds those that no rank used: as in torch, their
`.grad` is left as it was (None after `zero_grad()`, so the optimizer skips them as on one device).
With `reduce_dtype` the gradient is `param.main_grad` and `param.grad` stays None: clip and step
fp32 master copies (`master.grad = param.main_grad`), not `model.parameters()`. Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from .naive import broadcast_module

# torch DistributedDataParallel's other arguments: accepted at torch's default, else refused with the fix
TORCH_DEFAULTS = {"dim": 0, "init_sync": True, "check_reduction": False, "static_graph": False,
                  "delay_all_reduce_named_params": None, "param_to_hook_all_reduce": None,
                  "mixed_precision": None, "device_mesh": None, "skip_all_reduce_unused_params": False}
TORCH_ONLY = {"dim": "inputs are not scattered (one device per process): drop it",
              "init_sync": "the module is always broadcast from rank 0 at construction: drop it",
              "check_reduction": "deprecated in torch: drop it",
              "static_graph": "buckets are fixed at construction anyway: drop it",
              "delay_all_reduce_named_params": "every bucket's all-reduce overlaps backward: drop it",
              "param_to_hook_all_reduce": "every bucket's all-reduce overlaps backward: drop it",
              "mixed_precision": "pass reduce_dtype=torch.float32 for fp32 buckets of a bf16 model",
              "device_mesh": "pass process_group=mesh.get_group()",
              "skip_all_reduce_unused_params": "unused parameters are reduced as zeros "
                                               "(find_unused_parameters=True)"}


@dataclass
class Bucket:
    buffer: torch.Tensor
    params: list[nn.Parameter]
    names: list[str]
    ready: set[int] = field(default_factory=set)
    work: dist.Work | None = None


def assign_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_cap_bytes: float,
                   first_cap_bytes: float | None = None) -> list[list[tuple[str, nn.Parameter]]]:
    """Reverse registration order, a new bucket when the cap (for the first bucket
    `first_cap_bytes`, if given) would be exceeded or the dtype changes; a parameter larger than
    the cap gets a bucket of its own."""
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in reversed(named_params):
        nbytes = p.numel() * p.element_size()
        cap = first_cap_bytes if len(buckets) == 1 and first_cap_bytes is not None else bucket_cap_bytes
        if not buckets or size + nbytes > cap or buckets[-1][-1][1].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((name, p))
        size += nbytes
    return buckets


class DistributedDataParallel(nn.Module):
    """`loss.backward()` leaves the averaged gradient in `param.grad` (or, with a wider
    `reduce_dtype`, in `param.main_grad`) on every rank."""

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None, *,
                 output_device=None, process_group=None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = True, all_reduce: Callable | None = None,
                 reduce_dtype: torch.dtype | None = None, **torch_only):
        """`all_reduce`: a drop-in for `dist.all_reduce(tensor, op=, group=, async_op=True)`
        returning a handle with `.wait()`, e.g. chapter 02's `ring_all_reduce`. The gradients are
        always bucket views (`gradient_as_bucket_view=False`, torch's default, gives the same
        numbers there with one more copy); `output_device` is unused, as in torch for a module
        on one device. torch's other arguments (`torch_only`) are refused, each naming its fix."""
        refused = [f"{k}: {TORCH_ONLY.get(k, 'not an argument of torch DistributedDataParallel')}"
                   for k, v in torch_only.items() if k not in TORCH_DEFAULTS or v != TORCH_DEFAULTS[k]]
        if refused:
            raise TypeError(f"DistributedDataParallel does not implement {'; '.join(refused)}")
        super().__init__()
        if bucket_cap_mb is not None and not bucket_cap_mb >= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be >= 0 (None: torch's default 25; "
                             "0: a bucket per parameter; math.inf: one bucket)")
        self._input_device = self._check_device_ids(module, device_ids)
        self.device = next(module.parameters()).device  # torch's: where the module lives
        self.module, self.group, self._all_reduce = module, process_group, all_reduce
        self.world_size = dist.get_world_size(process_group)
        self.find_unused_parameters, self.broadcast_buffers = find_unused_parameters, broadcast_buffers
        self.require_backward_grad_sync, self._pending = True, False  # torch's name: no_sync() clears it
        self._used: set[nn.Parameter] = set()  # got a gradient since the last reduction
        broadcast_module(module, process_group)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.main_grad = reduce_dtype is not None and any(p.dtype != reduce_dtype for _, p in named)
        self.buckets: list[Bucket] = []
        self._slot: dict[nn.Parameter, tuple[int, int, torch.Tensor]] = {}
        cap = 25 * 2**20 if bucket_cap_mb is None else bucket_cap_mb * 2**20
        first = 2**20 if bucket_cap_mb is None else None  # dist._DEFAULT_FIRST_BUCKET_BYTES
        for b, members in enumerate(assign_buckets(named, cap, first)):
            params = [p for _, p in members]
            buffer = torch.zeros(sum(p.numel() for p in params), device=params[0].device,
                                 dtype=reduce_dtype if self.main_grad else params[0].dtype)
            offset = 0
            for i, p in enumerate(params):
                self._slot[p] = (b, i, buffer[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            self.buckets.append(Bucket(buffer, params, [n for n, _ in members]))
        self._next_bucket = 0
        for p, (_, _, slot) in self._slot.items():  # p.grad: None until its first backward, as in torch
            if self.main_grad:
                p.main_grad = slot
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @staticmethod
    def _check_device_ids(module: nn.Module, device_ids) -> torch.device | None:
        """torch's rule: None for a CPU module, else the one device the module is on."""
        if device_ids is None:
            return None
        devices = {p.device for p in module.parameters()}
        ids = list(device_ids)
        wanted = torch.device(ids[0]) if len(ids) == 1 and not isinstance(ids[0], int) else (
            torch.device("cuda", ids[0]) if len(ids) == 1 else None)
        if wanted is None or devices != {wanted}:
            raise ValueError(f"device_ids={device_ids} but the module's parameters are on "
                             f"{sorted(map(str, devices))}: move the module to its one device first "
                             "(model.to(device)) and pass device_ids=[that device], or None on CPU")
        return wanted

    def forward(self, *args, **kwargs):
        if self._input_device is not None:  # torch moves the inputs to device_ids[0]
            to = self._input_device
            args, kwargs = tree_map(lambda t: t.to(to) if torch.is_tensor(t) else t, (args, kwargs))
        if self.broadcast_buffers and torch.is_grad_enabled():
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            for buffer in self.module.buffers():  # rank 0's running statistics, as torch's DDP
                dist.broadcast(buffer, src=src, group=self.group)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate local gradients without communicating (gradient accumulation)."""
        self.require_backward_grad_sync, previous = False, self.require_backward_grad_sync
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """nn.Module's: every `.grad` to None (each re-adopts its bucket slot at the next backward)
        or zeroed in place; fp32 `main_grad` buckets are zeroed either way."""
        super().zero_grad(set_to_none)
        if self.main_grad:
            for bucket in self.buckets:
                bucket.buffer.zero_()

    def _adopt(self, p: nn.Parameter, slot: torch.Tensor) -> None:
        """Make p.grad its bucket slot again (the optimizer may have set it to None: a fresh
        tensor, or nothing, which is a zero gradient)."""
        if p.grad is None:
            slot.zero_()
        elif p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
        p.grad = slot

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b, i, slot = self._slot[p]
        self._used.add(p)
        if self.main_grad:
            slot.add_(p.grad)  # bf16 → fp32 accumulation, every micro-batch
            p.grad = None
        else:
            self._adopt(p, slot)
        if not self.require_backward_grad_sync:
            return
        bucket = self.buckets[b]
        if i in bucket.ready:
            raise RuntimeError(f"gradient of {bucket.names[i]!r} became ready twice before its "
                               "bucket was reduced: one backward per step, or use no_sync()")
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        bucket.ready.add(i)
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if len(bucket.ready) < len(bucket.params):
                return
            all_reduce = self._all_reduce or dist.all_reduce  # looked up late: meters wrap it
            bucket.work = all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group,
                                     async_op=True)
            self._next_bucket += 1

    def finish(self) -> None:
        """Wait for every bucket's all-reduce and divide by n (SUM then divide: never AVG). Runs
        by itself at the end of backward; calling it again is harmless."""
        if not self._pending:
            return
        self._pending = False
        missing = [(bucket, i) for bucket in self.buckets for i in range(len(bucket.params))
                   if i not in bucket.ready]
        untouched = {p for p in self._slot if p not in self._used}
        had_none = {p for p in untouched if p.grad is None}  # torch leaves their .grad as it was
        if self.find_unused_parameters:  # on every rank, every step: the all-reduces must match
            for bucket, i in missing:  # every rank then launches every bucket, in index order
                if not self.main_grad:
                    self._adopt(bucket.params[i], self._slot[bucket.params[i]][2])
                bucket.ready.add(i)
            self._launch_ready_buckets()
            unused_everywhere = self._unused_on_every_rank(untouched)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.buffer.div_(self.world_size)
            bucket.ready.clear()
            bucket.work = None
        self._next_bucket, self._used = 0, set()
        if not self.find_unused_parameters and missing:
            names = [bucket.names[i] for bucket, i in missing]
            raise RuntimeError(
                f"parameters received no gradient this step: {names}. Every parameter must take "
                "part in the loss, or set requires_grad=False on the unused ones, or pass "
                "find_unused_parameters=True"
            )
        if self.find_unused_parameters and not self.main_grad:
            for p in unused_everywhere:  # None stays None: the optimizer skips it, as on one device
                if p in had_none:
                    p.grad = None

    def _unused_on_every_rank(self, untouched: set[nn.Parameter]) -> list[nn.Parameter]:
        """Of the parameters this rank did not use since the last reduction, those no rank used:
        one all-reduce (MIN) of a flag per parameter, after every bucket was launched."""
        params = list(self._slot)
        flags = torch.tensor([p in untouched for p in params], dtype=torch.int32,
                             device=self.buckets[0].buffer.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group)
        return [p for p, flag in zip(params, flags.tolist(), strict=True) if flag]
