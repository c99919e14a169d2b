"""ZeRO stages 0-3 on flat buffers: each stage removes one redundant copy of the training state.

Per rank, for Ψ parameters on N ranks, b_p / b_g bytes per parameter / gradient element and K
bytes of optimizer state per parameter (mixed-precision AdamW: fp32 master 4 + m 4 + v 4 = 12):

    stage 0  plain DP        (b_p + b_g + K)·Ψ          grads all-reduced            2(N-1)/N·Ψ·b_g
    stage 1  optimizer       (b_p + b_g)·Ψ + K·Ψ/N      grads reduce-scattered,      (N-1)/N·Ψ·(b_g + b_p)
    stage 2  + gradients     b_p·Ψ + (b_g + K)·Ψ/N      owner steps its slice,       (N-1)/N·Ψ·(k·b_g + b_p)
    stage 3  + parameters    (b_p + b_g + K)·Ψ/N        params all-gathered          (N-1)/N·Ψ·k·(b_g + 2·b_p)

(wire bytes per step, k = gradient-accumulation micro-batches). Every rank owns a contiguous 1/N
of each flat group ([`flat.py`](flat.py)) and keeps the optimizer state (and, in bf16, the fp32
master weights) only for it. Gradients reach the owner through a reduce-scatter per bucket,
launched asynchronously from a post-accumulate-grad hook as soon as backward has filled the
bucket, in bucket order on every rank, and waited for in an autograd end-of-backward callback, so
a plain `loss.backward()` leaves the reduced shard in place (SUM, then divide by N: never AVG).
Clipping uses the true global norm ‖g‖ = sqrt(Σ_ranks Σ_shard g²), one scalar all-reduce. After
the step the owners' slices are all-gathered back into every rank's flat parameters (stage 3
re-gathers each unit, a transformer block or a module the blocks leave out, when it next runs
instead: see [`stage3.py`](stage3.py)). `offload_optimizer: cpu` keeps master, states and the
step on the CPU: on a GPU in exact-size page-locked buffers allocated once, the step on this
rank's share of the host's cores ([`offload.py`](offload.py)); on a CPU-only run that is the
device already, so the copies are skipped but the path is the same. Depends only on torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .config import ZeroConfig
from .flat import FlatGroup, UnitPolicy, assign_buckets, make_groups, module_units
from .offload import host_step_threads, pinned_empty
from .stage3 import ParameterPartitioner


def _all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class ZeroEngine:
    """Wraps `module` (its parameters become views of flat buffers) and builds the optimizer over
    this rank's master shards with `optimizer_fn(list_of_tensors)`. Use it like DeepSpeed's engine:
    `loss = loss_fn(engine(x), y) / k; loss.backward()` for k micro-batches, then `engine.step()`
    and `engine.zero_grad()`. `process_group` is the data-parallel group (default: world).
    `unit_policy(module) -> bool` picks stage 3's units, each gathered whole (e.g.
    `lambda m: isinstance(m, TransformerBlock)`; default: the items of every `nn.ModuleList`;
    see `flat.module_units`). A module built on the meta device needs `param_init_fn(name)`, the
    full initial values of each parameter, and `device`: the flat buffers are filled one group at
    a time, so at stage 3 a rank never holds more than its shards and one unit (twice: the values
    and their cast copy)."""

    def __init__(self, module: nn.Module, optimizer_fn: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 config: ZeroConfig | None = None, process_group=None,
                 gradient_accumulation_steps: int | None = None, unit_policy: UnitPolicy | None = None,
                 param_init_fn: Callable[[str], torch.Tensor] | None = None,
                 device: torch.device | None = None):
        self.module, self.config, self.group = module, config or ZeroConfig(), process_group
        config = self.config
        self.stage, self.world, self.rank = config.stage, dist.get_world_size(process_group), \
            dist.get_rank(process_group)
        self.gas = gradient_accumulation_steps or config.gradient_accumulation_steps or 1
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameters that require gradients")
        param_dtype, self.device = named[0][1].dtype, torch.device(device or named[0][1].device)
        self.param_init_fn = param_init_fn
        if config.bf16 and param_dtype != torch.float32:
            raise ValueError(f"bf16 mixed precision takes an fp32 model (the fp32 master weights "
                             f"come from it); got {param_dtype}")
        self.compute_dtype = torch.bfloat16 if config.bf16 else param_dtype
        self.master_dtype = self.reduce_dtype = torch.float32 if config.bf16 else param_dtype
        cpu = torch.device("cpu")
        self.offload_device = cpu if config.offload_optimizer == "cpu" else self.device
        self.param_device = cpu if config.offload_param == "cpu" else self.device
        if self.stage < 3:  # stage 0 "shards" over one rank: every rank owns everything
            shard_world, shard_rank = (1, 0) if self.stage == 0 else (self.world, self.rank)
            self.groups = make_groups(assign_buckets(named, config.reduce_bucket_size),
                                      shard_world, shard_rank)
            self.units: list[tuple[nn.Module, FlatGroup]] = []
        else:
            units = module_units(module, config.param_persistence_threshold, unit_policy)
            self.groups = make_groups([m for _, m, _ in units], self.world, self.rank,
                                      [persistent for *_, persistent in units])
            self.units = [(mod, g) for (mod, _, _), g in zip(units, self.groups, strict=True)]
        self._build_buffers(param_dtype)
        self.optimizer = optimizer_fn([g.master for g in self.groups])
        self._slot: dict[nn.Parameter, tuple[FlatGroup, int]] = {}
        for g in self.groups:
            for i, p in enumerate(g.params):
                self._slot[p] = (g, i)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.reduce_order: list[FlatGroup] = list(self.groups)  # stage 3: set from the forward trace
        self.micro_step, self._pending, self._next = 0, False, 0
        self.last_grad_norm: float | None = None
        self.partitioner = ParameterPartitioner(self) if self.stage == 3 else None

    # --- layout -------------------------------------------------------------------------------
    def _empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer allocated once per engine: on the host for a GPU, page-locked at its exact size
        (asynchronous copies; `tensor.pin_memory()` would round it up to a power of two)."""
        if self.config.pin_memory and device.type == "cpu" and self.device.type == "cuda":
            return pinned_empty(numel, dtype)
        return torch.empty(numel, dtype=dtype, device=device)

    def _build_buffers(self, param_dtype: torch.dtype) -> None:
        """Flat parameters (broadcast from the group's rank 0 so every replica starts equal), this
        rank's shard, its master copy, and the gradient buffers of the stage."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        shard_grads = []
        for g in self.groups:
            # the model's own values (fp32 masters are exact), or for a meta model its initial ones
            values = g.full_values(param_dtype, self.device, self.param_init_fn)
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
        for g in self.groups:
            g.host_grad = g.shard_grad if g.master.device == self.device else self._empty(
                g.shard_size, self.master_dtype, g.master.device).zero_()

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

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
            if self.partitioner is not None:
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
        if self.partitioner is not None:
            self.partitioner.end_of_backward()

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
        """torch's clip_grad_norm_ on sharded gradients: total = sqrt(all-reduce(Σ_shard g²))
        (stage 0 holds every gradient: no communication), coef = min(1, max / (total + 1e-6))."""
        sq = torch.zeros((), dtype=self.reduce_dtype, device=self.device)
        for g in self.groups:
            sq += g.shard_grad.pow(2).sum()
        if self.stage >= 1 and self.world > 1:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.group)
        total = sq.sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in self.groups:
            g.shard_grad.mul_(coef)
        return total

    def step(self) -> None:
        """Clip, step the optimizer on this rank's masters, and bring the parameters up to date."""
        if self.micro_step != self.gas:
            raise RuntimeError(f"step() after {self.micro_step} backward passes; this engine "
                               f"accumulates {self.gas} micro-batches per step")
        if self.config.clip is not None:
            self.last_grad_norm = self.clip_grad_norm_(self.config.clip).item()
        for g in self.groups:
            if g.host_grad is not g.shard_grad:  # offload: gradient shard to the optimizer's device
                g.host_grad.copy_(g.shard_grad, non_blocking=True)
            g.master.grad = g.host_grad
        if self.offload_device != self.device and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # D2H copies done before the CPU step
        with host_step_threads(self.device, self.offload_device):  # GPU + offload: the host's cores
            self.optimizer.step()
        for g in self.groups:
            if g.master is not g.shard:  # fp32 master → bf16 shard; host → device
                g.shard.copy_(g.master, non_blocking=True)
        self._gather_updated_parameters()
        self.micro_step = 0

    def _gather_updated_parameters(self) -> None:
        """Stages 1-2 (and stage 3's persistent groups): all-gather every owner's updated slice
        into the flat parameters, at most `allgather_bucket_size` elements in flight."""
        if self.stage == 0:
            return
        in_flight, elements = [], 0
        for g in self.groups:
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

    def zero_grad(self) -> None:
        for g in self.groups:
            (g.grad_flat if self.stage <= 1 else g.shard_grad).zero_()
            g.master.grad = None
        self.micro_step = 0

    # --- inspection (collectives: every rank of the group calls them) ---------------------------
    def _gathered(self, shard_of: Callable[[FlatGroup], torch.Tensor],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = {}
        for g in self.groups:
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
        opt = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {
            "params": [g.flat for g in self.groups] + [g.shard for g in self.groups if not g.persistent],
            "grads": [t for g in self.groups for t in (g.grad_flat, g.shard_grad, g.host_grad)
                      if t is not None],
            "optimizer": opt + [g.master for g in self.groups if g.master is not g.shard],
        }
