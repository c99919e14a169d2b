"""ZeroOptimizer: ZeRO's sharded optimizer as a torch optimizer, in ZeroRedundancyOptimizer's shape.

    opt = ZeroOptimizer([{"params": matrices}, {"params": norms_and_biases, "weight_decay": 0.0}],
                        torch.optim.AdamW, stage=2, lr=3e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); sched.step(); opt.zero_grad()

Per rank, for Ψ parameters on N ranks, b_p / b_g bytes per parameter / gradient element and K
bytes of optimizer state per parameter (mixed-precision AdamW: fp32 master 4 + m 4 + v 4 = 12):

    stage 0  plain DP        (b_p + b_g + K)·Ψ          grads all-reduced            2(N-1)/N·Ψ·b_g
    stage 1  optimizer       (b_p + b_g)·Ψ + K·Ψ/N      grads reduce-scattered,      (N-1)/N·Ψ·(b_g + b_p)
    stage 2  + gradients     b_p·Ψ + (b_g + K)·Ψ/N      owner steps its slice,       (N-1)/N·Ψ·(k·b_g + b_p)
    stage 3  + parameters    (b_p + b_g + K)·Ψ/N        params all-gathered          (N-1)/N·Ψ·k·(b_g + 2·b_p)

(wire bytes per step, k = gradient-accumulation micro-batches; stage 3 needs the module's units:
`ZeroEngine`). Each param group is laid out in flat buckets of its own ([`flat.py`](flat.py));
every rank owns one slice of each and keeps the optimizer state (and, in bf16, the fp32 master
weights) only for it: the inner `optimizer_class` steps those shards, one inner group per param
group with the same settings (copied from `param_groups` before every step, so LR schedulers work).
Gradients reach the owner through a reduce-scatter per bucket, launched asynchronously from a
post-accumulate-grad hook as soon as backward has filled the bucket, in bucket order on every
rank, and waited for in an autograd end-of-backward callback, so a plain `loss.backward()` leaves
the reduced shard in place (SUM, then divide by N: never AVG). After the step the owners' slices
are all-gathered back into every rank's flat parameters.

Ownership. "slice" (default): rank r owns [r·s, (r+1)·s) of each bucket, exactly 1/N, but a
slice crosses parameter boundaries, so the inner optimizer sees 1-D pieces and only an
element-wise optimizer (`ELEMENTWISE`) gives single-device results; any other is refused.
"parameter": each rank owns whole tensors (largest first, to the least-loaded rank), laid inside
its slice (`flat.assign_owners`), and steps them in their own shapes: any optimizer (Adafactor's
row/column factors), at the price of the padding that evens the shares out.

`offload_optimizer: cpu` keeps master, states and the step on the CPU: on a GPU in exact-size
page-locked buffers allocated once, the step on this rank's share of the host's cores
([`offload.py`](offload.py)); on a CPU-only run that is the device already, so the copies are
skipped but the path is the same. Clipping: `common.clip.clip_grad_norm_` over this rank's shard
of the gradients, summed over the data-parallel group. `state_dict()` is consolidated (every
rank returns the whole, in torch's per-parameter format, like ZeroRedundancyOptimizer's
`consolidate_state_dict` + `state_dict`); `load_state_dict` takes such a dict, from any world
size or from a single-device torch optimizer. Depends only on torch and common/clip.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common.clip import clip_grad_norm_

from .config import ZeroConfig
from .flat import FlatGroup, Unit, assign_buckets, assign_owners, make_groups
from .offload import host_step_threads, pinned_empty
from .optimizer_state import consolidated_state_dict, load_consolidated_state_dict

# torch optimizers whose update of an element reads only that element's own gradient and state
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta,
               torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD)
OWNERSHIPS = ("slice", "parameter")


def _all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class ZeroOptimizer(torch.optim.Optimizer):
    """`params` (tensors or param groups) sharded over `process_group` (default: world) at
    `stage` 0-2 (default: `config.stage`, else 1); `optimizer_class(param_groups, **defaults)`
    steps this rank's shards. `config` carries DeepSpeed's other knobs (buckets, overlap, bf16,
    offload, gradient_accumulation_steps: step() expects that many backward passes). Building it
    and `add_param_group` are collectives, and so are `step`, `clip_grad_norm_` and `state_dict`.
    For `ZeroEngine`: `param_names` ({param: name}, for messages and gathered dicts), `units`
    (stage 3's flat groups), `param_init_fn` and `device` (a model built on the meta device)."""

    def __init__(self, params: Iterable, optimizer_class: Callable[..., torch.optim.Optimizer], *,
                 process_group=None, stage: int | None = None, ownership: str = "slice",
                 config: ZeroConfig | None = None, param_names: Mapping[nn.Parameter, str] | None = None,
                 units: list[Unit] | None = None, param_init_fn: Callable[[str], torch.Tensor] | None = None,
                 device: torch.device | None = None, **defaults):
        config = config or ZeroConfig(stage=1)
        self.config = config = replace(config, stage=config.stage if stage is None else stage)
        if ownership not in OWNERSHIPS:
            raise ValueError(f"ownership={ownership!r}: use 'slice' or 'parameter'")
        if config.stage not in (0, 1, 2, 3) or (config.stage == 3) != (units is not None):
            raise ValueError(f"stage={config.stage}: ZeroOptimizer shards the optimizer (1) and the "
                             "gradients (2); stage 3 also shards the parameters of a module: use ZeroEngine")
        if units is not None and ownership != "slice":
            raise ValueError("stage 3 gathers slices; whole-parameter ownership is for stages 0-2")
        self.stage, self.group, self.ownership = config.stage, process_group, ownership
        self.world, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.shard_world, self.shard_rank = (1, 0) if self.stage == 0 else (self.world, self.rank)
        self.gas = config.gradient_accumulation_steps or 1
        self.optimizer_class, self.optim = optimizer_class, None
        self.param_names, self.units, self.param_init_fn = param_names or {}, units, param_init_fn
        self.device = None if device is None else torch.device(device)
        self.flat_groups: list[FlatGroup] = []
        self.unit_groups: list[tuple[nn.Module, FlatGroup]] = []  # stage 3: (module, its group)
        self.reduce_order: list[FlatGroup] = []  # stage 3: set from the forward trace
        self.end_of_backward_hooks: list[Callable[[], None]] = []
        # each inner tensor: (its flat group's index, the parameter's index in it or None for the slice)
        self.pieces: list[tuple[torch.Tensor, int, int | None]] = []
        self._slot: dict[nn.Parameter, tuple[FlatGroup, int]] = {}
        self.micro_step, self._pending, self._next = 0, False, 0
        super().__init__(params, defaults)

    # --- layout -------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, then lay the group out in flat buckets of its own and hand
        the inner optimizer its shards as one group with the same settings."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        named = [(self.param_names.get(p, f"param_groups[{len(self.param_groups) - 1}][{i}]"), p)
                 for i, p in enumerate(group["params"]) if p.requires_grad]
        if not named:
            raise ValueError(f"param group {len(self.param_groups) - 1} has no parameter that requires grad")
        if self.optim is None:
            self._choose_dtypes(named[0][1])
        groups = self._layout(named)
        self._build_buffers(groups)
        first = len(self.flat_groups)
        self.flat_groups += groups
        self.reduce_order += groups
        inner = self._inner_tensors(groups, first)
        settings = {k: v for k, v in group.items() if k != "params"}
        if self.optim is None:
            self.optim = self.optimizer_class([{"params": inner, **settings}])
            self._require_elementwise()
        else:
            self.optim.add_param_group({"params": inner, **settings})
        for key, value in self.optim.param_groups[-1].items():  # lr, betas, ...: visible to schedulers
            if key != "params":
                group.setdefault(key, value)
        for g in groups:
            for i, p in enumerate(g.params):
                self._slot[p] = (g, i)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _choose_dtypes(self, first: nn.Parameter) -> None:
        config, cpu = self.config, torch.device("cpu")
        self.param_dtype, self.device = first.dtype, self.device or first.device
        if config.bf16 and first.dtype != torch.float32:
            raise ValueError(f"bf16 mixed precision takes an fp32 model (the fp32 master weights "
                             f"come from it); got {first.dtype}")
        self.compute_dtype = torch.bfloat16 if config.bf16 else first.dtype
        self.master_dtype = self.reduce_dtype = torch.float32 if config.bf16 else first.dtype
        self.offload_device = cpu if config.offload_optimizer == "cpu" else self.device
        self.param_device = cpu if config.offload_param == "cpu" else self.device

    def _layout(self, named: list[tuple[str, nn.Parameter]]) -> list[FlatGroup]:
        """Stages 0-2: reduce buckets (stage 0 "shards" over one rank: each owns everything);
        stage 3: the engine's units, restricted to this param group's parameters."""
        if self.units is None:
            whole = self.ownership == "parameter"
            owner = assign_owners([p for _, p in named], self.shard_world) if whole else None
            return make_groups(assign_buckets(named, self.config.reduce_bucket_size), self.shard_world,
                               self.shard_rank, owner=owner)
        ids = {id(p) for _, p in named}
        units = [(mod, [(n, p) for n, p in members if id(p) in ids], persistent)
                 for mod, members, persistent in self.units]
        units = [unit for unit in units if unit[1]]
        groups = make_groups([m for _, m, _ in units], self.world, self.rank, [p for *_, p in units])
        self.unit_groups += [(mod, g) for (mod, _, _), g in zip(units, groups, strict=True)]
        return groups

    def _empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer allocated once: on the host for a GPU, page-locked at its exact size
        (asynchronous copies; `tensor.pin_memory()` would round it up to a power of two)."""
        if self.config.pin_memory and device.type == "cpu" and self.device.type == "cuda":
            return pinned_empty(numel, dtype)
        return torch.empty(numel, dtype=dtype, device=device)

    def _build_buffers(self, groups: list[FlatGroup]) -> None:
        """Flat parameters (broadcast from the group's rank 0 so every replica starts equal), this
        rank's shard, its master copy, and the gradient buffers of the stage."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        shard_grads = []
        for g in groups:
            # the model's own values (fp32 masters are exact), or for a meta model its initial ones
            values = g.full_values(self.param_dtype, self.device, self.param_init_fn)
            if self.world > 1:
                dist.broadcast(values, src=src, group=self.group)
            own = values[g.start : g.start + g.shard_size]
            g.bind(values, self.compute_dtype)
            if g.persistent:
                g.shard = g.flat[g.start : g.start + g.shard_size]
            else:  # stage 3: the shard is all this rank keeps of the parameters
                own_compute = g.flat[g.start : g.start + g.shard_size]
                g.shard = self._empty(g.shard_size, self.compute_dtype, self.param_device).copy_(own_compute)
                g.free()
            aliased = self.master_dtype == self.compute_dtype and g.shard.device == self.offload_device
            g.master = g.shard if aliased else self._empty(
                g.shard_size, self.master_dtype, self.offload_device).copy_(own)
            if self.stage <= 1:  # full gradients stay; the shard is a view of them
                g.grad_flat = torch.zeros(g.padded, dtype=self.reduce_dtype, device=self.device)
                g.shard_grad = g.grad_flat[g.start : g.start + g.shard_size]
            else:
                shard_grads.append(g)
        if shard_grads and self.config.contiguous_gradients:  # one buffer for every reduced shard
            buffer = torch.zeros(sum(g.shard_size for g in shard_grads), dtype=self.reduce_dtype,
                                 device=self.device)
            offset = 0
            for g in shard_grads:
                g.shard_grad = buffer[offset : offset + g.shard_size]
                offset += g.shard_size
        else:
            for g in shard_grads:
                g.shard_grad = torch.zeros(g.shard_size, dtype=self.reduce_dtype, device=self.device)
        for g in groups:
            g.host_grad = g.shard_grad if g.master.device == self.device else self._empty(
                g.shard_size, self.master_dtype, g.master.device).zero_()

    def _inner_tensors(self, groups: list[FlatGroup], first: int) -> list[torch.Tensor]:
        """What the inner optimizer steps: each master slice, or (whole-parameter ownership) a
        view of it per parameter this rank owns, in the parameter's shape."""
        inner = []
        for gi, g in enumerate(groups, start=first):
            if self.ownership == "slice":
                self.pieces.append((g.master, gi, None))
                inner.append(g.master)
                continue
            for i, (p, off) in enumerate(zip(g.params, g.offsets, strict=True)):
                local = off - g.start
                if 0 <= local < g.shard_size and p.numel():
                    view = g.master[local : local + p.numel()].view(p.shape)
                    self.pieces.append((view, gi, i))
                    inner.append(view)
        return inner

    def _require_elementwise(self) -> None:
        cls = type(self.optim)
        if self.ownership == "slice" and cls not in ELEMENTWISE:
            raise ValueError(
                f"{cls.__name__} is not element-wise, and ZeRO's slices are 1-D pieces that cross "
                f"parameter boundaries: it would step shapes no single-device run has (silently "
                f"off). Pass ownership='parameter' (each rank steps whole tensors), or one of: "
                f"{', '.join(c.__name__ for c in ELEMENTWISE)}")

    # --- backward: gradients to their owners ---------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """Stages 0-1 keep full gradients and reduce once per step (in the last micro-batch's
        backward); stages 2-3 cannot keep them, so they reduce in every micro-batch."""
        return self.stage >= 2 or self.micro_step + 1 == self.gas

    def ensure_end_of_backward_callback(self) -> None:
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        g, i = self._slot[p]
        if g.grad_flat is None:  # stages 2-3: the bucket exists only until its reduce-scatter
            g.grad_flat = torch.zeros(g.padded, dtype=self.reduce_dtype, device=self.device)
        off = g.offsets[i]
        g.grad_flat[off : off + p.numel()].view(p.shape).add_(p.grad)  # bf16 → fp32 when mixed
        p.grad = None
        self.ensure_end_of_backward_callback()
        if not self.is_gradient_accumulation_boundary():
            return
        if i in g.ready:
            raise RuntimeError(f"gradient of {g.names[i]!r} became ready twice in one backward: each "
                               "parameter may take part in the loss once per micro-batch")
        g.ready.add(i)
        if len(g.ready) == len(g.params):
            g.free()  # stage 3: this module's backward is done, drop its full parameters
            if self.config.overlap_comm:
                self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch complete groups strictly in `reduce_order`, so every rank issues the same
        collectives in the same order whatever order autograd finished them in."""
        while self._next < len(self.reduce_order):
            g = self.reduce_order[self._next]
            if len(g.ready) < len(g.params):
                return
            if self.stage == 0:
                g.work = dist.all_reduce(g.grad_flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            else:
                g.recv = torch.empty(g.shard_size, dtype=self.reduce_dtype, device=self.device)
                g.work = _reduce_scatter(g.recv, g.grad_flat, self.group, async_op=True)
            self._next += 1

    def _end_of_backward(self) -> None:
        """Runs once at the end of every backward: finish the reductions, count the micro-step."""
        self._pending = False
        if self.is_gradient_accumulation_boundary():
            self._launch_ready()
            missing = [name for g in self.reduce_order for i, name in enumerate(g.names)
                       if i not in g.ready]
            for g in self.reduce_order:
                if g.work is not None:
                    g.work.wait()
                    self._complete(g)
                g.ready.clear()
            self._next = 0
            if missing:
                raise RuntimeError(f"parameters received no gradient this micro-batch: {missing}. "
                                   "Every parameter must take part in the loss (or set "
                                   "requires_grad=False on the unused ones)")
        self.micro_step += 1
        for hook in self.end_of_backward_hooks:
            hook()

    def _complete(self, g: FlatGroup) -> None:
        if self.stage == 0:
            g.grad_flat.div_(self.world)
        elif self.stage == 1:
            g.shard_grad.copy_(g.recv.div_(self.world))
        else:  # accumulate the reduced micro-batch into the shard, drop the bucket
            g.shard_grad.add_(g.recv.div_(self.world))
            g.grad_flat = None
        g.work, g.recv = None, None

    # --- step ---------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ on sharded gradients: ‖g‖ = sqrt(all-reduce(Σ_shard g²)) (stage
        0 holds every gradient: no communication), coef = min(1, max / (‖g‖ + 1e-6))."""
        shards = [g.shard_grad for g in self.flat_groups]
        groups = (self.group or dist.group.WORLD,) if self.stage >= 1 else ()
        return clip_grad_norm_(shards, max_norm, counted=shards, groups=groups, device=self.device)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the inner optimizer on this rank's masters (with `param_groups`' current settings)
        and bring every rank's parameters up to date. `closure` (forward + backward) runs first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.micro_step != self.gas:
            raise RuntimeError(f"step() after {self.micro_step} backward passes; this optimizer "
                               f"accumulates {self.gas} micro-batches per step")
        for outer, inner in zip(self.param_groups, self.optim.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        for g in self.flat_groups:
            if g.host_grad is not g.shard_grad:  # offload: gradient shard to the optimizer's device
                g.host_grad.copy_(g.shard_grad, non_blocking=True)
        for t, gi, i in self.pieces:
            g = self.flat_groups[gi]
            t.grad = g.host_grad if i is None else self._span(g, i, g.host_grad)
        if self.offload_device != self.device and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # D2H copies done before the CPU step
        with host_step_threads(self.device, self.offload_device):  # GPU + offload: the host's cores
            self.optim.step()
        for g in self.flat_groups:
            if g.master is not g.shard:  # fp32 master → bf16 shard; host → device
                g.shard.copy_(g.master, non_blocking=True)
        self._gather_updated_parameters()
        self.micro_step = 0
        return loss

    @staticmethod
    def _span(g: FlatGroup, i: int, shard: torch.Tensor) -> torch.Tensor:
        """Parameter i of `g` within this rank's slice `shard` (whole-parameter ownership)."""
        p, local = g.params[i], g.offsets[i] - g.start
        return shard[local : local + p.numel()].view(p.shape)

    def _gather_updated_parameters(self) -> None:
        """Stages 1-2 (and stage 3's persistent groups): all-gather every owner's updated slice
        into the flat parameters, at most `allgather_bucket_size` elements in flight."""
        if self.stage == 0:
            return
        in_flight, elements = [], 0
        for g in self.flat_groups:
            if not g.persistent:
                continue
            if in_flight and elements + g.padded > self.config.allgather_bucket_size:
                for work in in_flight:
                    work.wait()
                in_flight, elements = [], 0
            in_flight.append(_all_gather(g.flat, g.shard.clone(), self.group, async_op=True))
            elements += g.padded
        for work in in_flight:
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (the parameters' own `.grad` is never kept: the hooks move
        it into the buffers)."""
        for g in self.flat_groups:
            (g.grad_flat if self.stage <= 1 else g.shard_grad).zero_()
        for t, _, _ in self.pieces:
            t.grad = None
        self.micro_step = 0

    # --- checkpoints: torch's per-parameter format, consolidated ([`optimizer_state.py`](optimizer_state.py))
    def state_dict(self) -> dict[str, Any]:
        """{"state": {index: {key: full-shape tensor}}, "param_groups": [...]} on every rank, as a
        single-device torch optimizer writes it (a collective; bf16 adds each fp32 "master")."""
        return consolidated_state_dict(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a consolidated (or single-device torch) state dict; each rank cuts its own shards."""
        load_consolidated_state_dict(self, state_dict)

    # --- inspection (collectives: every rank of the group calls them) ---------------------------
    def _gathered(self, shard_of: Callable[[FlatGroup], torch.Tensor],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = {}
        for g in self.flat_groups:
            shard = shard_of(g).to(self.device)
            if self.stage == 0:
                full = shard.clone()
            else:
                full = torch.empty(g.padded, dtype=dtype, device=self.device)
                _all_gather(full, shard, self.group)
            out.update(g.split(full))
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The reduced gradients (before clipping), gathered to full shape on every rank."""
        return self._gathered(lambda g: g.shard_grad, self.reduce_dtype)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The master parameters (fp32 in bf16 mode), gathered to full shape on every rank."""
        return self._gathered(lambda g: g.master, self.master_dtype)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The live tensors of the training state by kind (for a storage-deduplicated ledger)."""
        opt = [v for s in self.optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        groups = self.flat_groups
        return {
            "params": [g.flat for g in groups] + [g.shard for g in groups if not g.persistent],
            "grads": [t for g in groups for t in (g.grad_flat, g.shard_grad, g.host_grad) if t is not None],
            "optimizer": opt + [g.master for g in groups if g.master is not g.shard],
        }
