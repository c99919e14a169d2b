"""ZeroOptimizer: ZeRO's sharded optimizer as a torch optimizer, in ZeroRedundancyOptimizer's shape
(but it reduces the gradients itself: no DDP around the model, sole_reducer.py).

    opt = ZeroOptimizer([{"params": matrices}, {"params": norms_and_biases, "weight_decay": 0.0}],
                        torch.optim.AdamW, stage=2, lr=3e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); sched.step(); opt.zero_grad()
    opt.consolidate_state_dict(to=0)                      # every rank (a collective); then
    if rank == 0: torch.save(opt.state_dict(), path)      # and to resume, on every rank:
    opt.load_state_dict(torch.load(path))

Per rank, for Ψ parameters on N ranks, b_p / b_g bytes per parameter / gradient element and K
bytes of optimizer state per parameter (mixed-precision AdamW: fp32 master 4 + m 4 + v 4 = 12):

    stage 0  plain DP        (b_p + b_g + K)·Ψ          grads all-reduced            2(N-1)/N·Ψ·b_g
    stage 1  optimizer       (b_p + b_g)·Ψ + K·Ψ/N      grads reduce-scattered,      (N-1)/N·Ψ·(b_g + b_p)
    stage 2  + gradients     b_p·Ψ + (b_g + K)·Ψ/N      owner steps its slice,       (N-1)/N·Ψ·(k·b_g + b_p)
    stage 3  + parameters    (b_p + b_g + K)·Ψ/N        params all-gathered          (N-1)/N·Ψ·k·(b_g + 2·b_p)

(wire bytes per step, k = backward passes that reduce; stage 3 needs the module's units:
`ZeroEngine`). Each param group is laid out in flat buckets of its own ([`flat.py`](flat.py));
every rank owns one slice of each and keeps the optimizer state (in bf16 also the fp32 masters)
only for it: the inner `optimizer_class` steps those shards, one inner group per param group
(settings copied from `param_groups` before every step, so LR schedulers work). A bucket is
reduce-scattered to its owners as soon as backward has filled it (a post-accumulate-grad hook),
in bucket order on every rank, and waited for in an end-of-backward callback (SUM, then divide
by N: never AVG); after the step the owners' slices are all-gathered into every rank's parameters.

Accumulation: any number of backward passes before `step()`; each reduces its gradient into the
shard (DeepSpeed's stage 2). Under `no_sync()` a backward only adds into local full-size buckets
and the next one outside it reduces the sum (stages 0-1: one reduction for k micro-batches).
`p.grad` after backward: at stage 0 (parameter dtype = reduce dtype) a view of the all-reduced
gradient, so torch's `clip_grad_norm_(model.parameters())` is exact; otherwise a `ShardedGrad`
whose every read raises, naming the fix (`opt.clip_grad_norm_(max_norm)`). `model.zero_grad()` and
`opt.zero_grad()` (either `set_to_none`) zero the gradients as torch's do.

Ownership "slice" (default): rank r owns [r·s, (r+1)·s) of each bucket, crossing parameter
boundaries, so only an element-wise optimizer (`ELEMENTWISE`) is exact and any other is refused
([`arguments.py`](arguments.py): every argument refused before anything is built); "parameter":
whole tensors, largest first to the least-loaded rank (`flat.assign_owners`), for any optimizer.
Offload: [`offload.py`](offload.py); checkpoints (torch's ZeroRedundancyOptimizer pair, above) in
torch's per-parameter format: [`optimizer_state.py`](optimizer_state.py). Depends only on torch,
common/kernel/clip.py and common/kernel/collectives.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.clip import clip_grads_by_global_norm_

from . import arguments, flat, optimizer_state, sole_reducer
from .flat import FlatGroup, Unit
from .offload import buffer_empty, host_step_threads


class ZeroOptimizer(torch.optim.Optimizer):
    """`params` (tensors or param groups) sharded over `process_group` (default: world) at `stage`
    0-2; `optimizer_class(param_groups, **defaults)` steps this rank's shards. DeepSpeed's knobs
    by their names: `reduce_bucket_size` / `allgather_bucket_size` (elements), `overlap_comm`
    (reduce while backward runs), `contiguous_gradients` (stage 2: one buffer for every shard),
    `bf16` / `fp16` (fp32 model, bf16 / fp16 compute, fp32 masters and reduction; fp16's loss
    scaling is the caller's), `offload_optimizer` (master, state, step on the CPU), `pin_memory`.
    Building it, `add_param_group`, `step`, `clip_grad_norm_` and `consolidate_state_dict` are collectives.
    For `ZeroEngine` (stage 3): `param_names` ({param: name}, for messages), `units`,
    `offload_param`, `init_values_fn` and `device` (a model built on the meta device)."""

    def __init__(self, params: Iterable, optimizer_class: Callable[..., torch.optim.Optimizer], *,
                 process_group=None, stage: int = 1, ownership: str = "slice",
                 reduce_bucket_size: int = 500_000_000, allgather_bucket_size: int = 500_000_000,
                 overlap_comm: bool = True, contiguous_gradients: bool = True, bf16: bool = False,
                 fp16: bool = False, offload_optimizer: bool = False, pin_memory: bool = True,
                 param_names: Mapping[nn.Parameter, str] | None = None, units: list[Unit] | None = None,
                 offload_param: bool = False, init_values_fn: Callable[[str], torch.Tensor] | None = None,
                 device: torch.device | None = None, **defaults):
        arguments.refuse_bad_arguments(stage, ownership, units is not None, reduce_bucket_size,
                                       allgather_bucket_size, offload_param, defaults)
        self.stage, self.group, self.ownership = stage, process_group, ownership
        self.world, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.shard_world, self.shard_rank = (1, 0) if stage == 0 else (self.world, self.rank)
        self.reduce_bucket_size = int(reduce_bucket_size)
        self.allgather_bucket_size = int(allgather_bucket_size)
        self.overlap_comm, self.contiguous_gradients = overlap_comm, contiguous_gradients
        self.bf16, self.fp16, self.pin_memory = bf16, fp16, pin_memory
        self.offload_optimizer, self.offload_param = offload_optimizer, offload_param
        self.optimizer_class, self.optim = optimizer_class, None
        self.param_names, self.units, self.init_values_fn = param_names or {}, units, init_values_fn
        self.device = None if device is None else torch.device(device)
        self.flat_groups: list[FlatGroup] = []
        self.unit_groups: list[tuple[nn.Module, FlatGroup]] = []  # stage 3: (module, its group)
        self.reduce_order: list[FlatGroup] = []  # stage 3: set from the forward trace
        self.end_of_backward_hooks: list[Callable[[], None]] = []
        self.pieces: optimizer_state.Pieces = []  # (inner tensor, flat group index, param index | None)
        self._slot: dict[nn.Parameter, tuple[FlatGroup, int]] = {}
        self.require_backward_grad_sync = True  # torch DDP's name; no_sync() turns it off
        self._pending, self._next, self._consolidated = False, 0, None  # _consolidated: state_dict()'s
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
        sole_reducer.refuse_other_hooks(named)
        if self.optim is None:
            self._choose_dtypes(named[0][1])
        groups = self._layout(named)
        self._build_buffers(groups)
        first = len(self.flat_groups)
        self.flat_groups += groups
        self.reduce_order += groups
        pieces = optimizer_state.inner_tensors(groups, first, whole_params=self.ownership == "parameter")
        self.pieces += pieces
        inner = [t for t, _, _ in pieces]
        settings = {k: v for k, v in group.items() if k != "params"}
        if self.optim is None:
            self.optim = self.optimizer_class([{"params": inner, **settings}])
            arguments.require_elementwise(self.optim, self.ownership)
        else:
            self.optim.add_param_group({"params": inner, **settings})
        for key, value in self.optim.param_groups[-1].items():  # lr, betas, ...: visible to schedulers
            if key != "params":
                group.setdefault(key, value)
        for g in groups:
            for i, p in enumerate(g.params):
                self._slot[p] = (g, i)
                for handle in getattr(p, "_zero_hooks", ()):  # a new optimizer over them takes over
                    handle.remove()
                    p.grad = None  # the old one's unreadable ShardedGrad: a zero gradient, for torch
                p._zero_hooks = (p.register_hook(lambda grad, p=p: self._before_accumulation(p)),
                                 p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _choose_dtypes(self, first: nn.Parameter) -> None:
        self.param_dtype, self.device = first.dtype, self.device or first.device
        compute = {(True, False): torch.bfloat16, (False, True): torch.float16}.get((self.bf16, self.fp16))
        if (self.bf16 or self.fp16) and (compute is None or first.dtype != torch.float32):
            raise ValueError(f"bf16={self.bf16}, fp16={self.fp16} with a {first.dtype} model: mixed "
                             "precision takes one of the two and an fp32 model (the masters come from it)")
        self.compute_dtype = compute or first.dtype
        self.master_dtype = self.reduce_dtype = torch.float32 if compute else first.dtype
        self.offload_device = torch.device("cpu") if self.offload_optimizer else self.device
        self.param_device = torch.device("cpu") if self.offload_param else self.device

    def _layout(self, named: list[tuple[str, nn.Parameter]]) -> list[FlatGroup]:
        """Stages 0-2: reduce buckets (stage 0 "shards" over one rank: each owns everything);
        stage 3: the engine's units, restricted to this param group's parameters."""
        if self.units is None:
            whole = self.ownership == "parameter"
            owner = flat.assign_owners([p for _, p in named], self.shard_world) if whole else None
            return flat.make_groups(flat.assign_buckets(named, self.reduce_bucket_size), self.shard_world,
                               self.shard_rank, owner=owner)
        units = flat.restrict_units(self.units, [p for _, p in named])
        groups = flat.make_groups([m for _, m, _ in units], self.world, self.rank, [p for *_, p in units])
        self.unit_groups += [(mod, g) for (mod, _, _), g in zip(units, groups, strict=True)]
        return groups

    def _empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return buffer_empty(numel, dtype, device, self.device, self.pin_memory)

    def _build_buffers(self, groups: list[FlatGroup]) -> None:
        """Flat parameters (broadcast from the group's rank 0 so every replica starts equal), this
        rank's shard, its master copy, the gradient buffers of the stage, and what p.grad shows."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        shard_grads = []
        for g in groups:
            # the model's own values (fp32 masters are exact), or for a meta model its initial ones
            values = g.full_values(self.param_dtype, self.device, self.init_values_fn)
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
            g.keep_grads = self.stage <= 1
            if g.keep_grads:  # full gradients stay; the shard is a view of them
                g.grad_flat = torch.zeros(g.padded, dtype=self.reduce_dtype, device=self.device)
                g.shard_grad = g.grad_flat[g.start : g.start + g.shard_size]
            else:
                shard_grads.append(g)
        sizes = [g.shard_size for g in shard_grads]  # stage 2: contiguous_gradients, one buffer for all
        zeros = lambda n: torch.zeros(n, dtype=self.reduce_dtype, device=self.device)  # noqa: E731
        buffers = zeros(sum(sizes)).split(sizes) if self.contiguous_gradients else [zeros(n) for n in sizes]
        for g, buffer in zip(shard_grads, buffers, strict=True):
            g.shard_grad = buffer
        for g in groups:
            g.host_grad = g.shard_grad if g.master.device == self.device else self._empty(
                g.shard_size, self.master_dtype, g.master.device).zero_()
            g.make_grads(None if self.stage == 0 and self.reduce_dtype == self.compute_dtype else
                         f"fp32 for a {self.compute_dtype} parameter" if self.stage == 0 else
                         f"stage {self.stage}: each of the {self.world} ranks holds only its reduced slice")

    # --- backward: gradients to their owners ---------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only add into the local full-size buckets; the next one outside
        reduces the sum (one reduction for k micro-batches; stage 2 holds full buckets meanwhile)."""
        self.require_backward_grad_sync, previous = False, self.require_backward_grad_sync
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def ensure_end_of_backward_callback(self) -> None:
        """At the first hook of a backward: queue `_end_of_backward`, and read what the user did
        to p.grad since the last one (None or `zero_()`: a zero gradient, as in torch)."""
        if self._pending:
            return
        for g in self.flat_groups:
            g.read_user_grads()
        self._pending = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _before_accumulation(self, p: nn.Parameter) -> None:
        """A tensor hook on the leaf runs before autograd accumulates into p.grad: empty it, so
        autograd hands `_on_grad_ready` this backward's gradient alone."""
        self.ensure_end_of_backward_callback()
        p.grad = None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        g, i = self._slot[p]
        if not g.window:
            g.open_window(self.reduce_dtype, self.device)
        off = g.offsets[i]
        g.grad_flat[off : off + p.numel()].view(p.shape).add_(p.grad)  # bf16 → fp32 when mixed
        p.grad = None
        if not self.require_backward_grad_sync:
            return
        if i in g.ready:
            raise RuntimeError(f"gradient of {g.names[i]!r} became ready twice in one backward: each "
                               "parameter may take part in the loss once per backward")
        g.ready.add(i)
        if len(g.ready) == len(g.params):
            g.free()  # stage 3: this module's backward is done, drop its full parameters
            if self.overlap_comm:
                self._launch_ready()

    def _launch_ready(self) -> None:
        """Complete groups strictly in `reduce_order`: every rank posts the same collectives in order."""
        while self._next < len(self.reduce_order):
            g = self.reduce_order[self._next]
            if len(g.ready) < len(g.params):
                return
            g.reduce(self.group, all_reduce=self.stage == 0)
            self._next += 1

    def _end_of_backward(self) -> None:
        """Runs once at the end of every backward: finish the reductions, show p.grad."""
        self._pending = False
        if self.require_backward_grad_sync:
            self._launch_ready()
            missing = [name for g in self.reduce_order for i, name in enumerate(g.names)
                       if i not in g.ready]
            for g in self.reduce_order:
                if g.work is not None:
                    g.complete(self.world)  # shard += sum / N
                g.ready.clear()
            self._next = 0
            if missing:
                raise RuntimeError(f"parameters received no gradient in this backward: {missing}. "
                                   "Every parameter must take part in the loss (or set "
                                   "requires_grad=False on the unused ones)")
        for g in self.flat_groups:
            g.show_grads()
        for hook in self.end_of_backward_hooks:
            hook()
        if self.stage == 0 and self.reduce_dtype == self.compute_dtype:  # p.grad: views of grad_flat
            sole_reducer.watch([g.grad_flat for g in self.flat_groups])

    # --- step ---------------------------------------------------------------------------------
    def _require_reduced(self, what: str) -> bool:
        """False when every p.grad is None (torch's step then changes nothing); raises when the
        gradients are half-cleared or not reduced yet."""
        cleared = [g.names[i] for g in self.flat_groups for i, p in enumerate(g.params) if p.grad is None]
        if len(cleared) == len(self._slot):
            return False
        if cleared:
            raise RuntimeError(f"{what}: {cleared} have .grad None and the others do not; ZeroOptimizer "
                               "steps whole flat shards and cannot skip single parameters: clear all "
                               "gradients (opt.zero_grad()) or none")
        if any(g.window for g in self.flat_groups):
            raise RuntimeError(f"{what} after a backward under no_sync(): its gradients are not reduced "
                               "yet; run the last backward before it outside no_sync()")
        return True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ on sharded gradients: ‖g‖ = sqrt(all-reduce(Σ_shard g²)) (stage
        0 holds every gradient: no communication), coef = min(1, max / (‖g‖ + 1e-6))."""
        self._require_reduced("clip_grad_norm_()")
        shards = [g.shard_grad for g in self.flat_groups]
        groups = (self.group or dist.group.WORLD,) if self.stage >= 1 else ()
        return clip_grads_by_global_norm_(shards, max_norm, counted=shards, groups=groups, device=self.device)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the inner optimizer on this rank's masters (with `param_groups`' current settings)
        and bring every rank's parameters up to date. `closure` (forward + backward) runs first."""
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        if not self._require_reduced("step()"):
            return loss
        for outer, inner in zip(self.param_groups, self.optim.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        for g in self.flat_groups:
            if g.host_grad is not g.shard_grad:  # offload: gradient shard to the optimizer's device
                g.host_grad.copy_(g.shard_grad, non_blocking=True)
        for t, gi, i in self.pieces:  # each inner tensor's span of the (host) gradient shard
            g = self.flat_groups[gi]
            local = 0 if i is None else g.offsets[i] - g.start
            t.grad = g.host_grad[local : local + t.numel()].view(t.shape)
        if self.offload_device != self.device and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # D2H copies done before the CPU step
        with host_step_threads(self.device, self.offload_device):  # GPU + offload: the host's cores
            self.optim.step()
        for g in self.flat_groups:
            if g.master is not g.shard:  # fp32 master → bf16 shard; host → device
                g.shard.copy_(g.master, non_blocking=True)
        if self.stage > 0:  # every owner's updated slice into every rank's (persistent) flat groups
            flat.all_gather_shards(self.flat_groups, self.group, self.allgather_bucket_size)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (and no_sync's); `set_to_none`: every p.grad None, as torch's."""
        for g in self.flat_groups:
            g.zero_grad()
            for p in g.params if set_to_none else ():
                p.grad = None
        for t, _, _ in self.pieces:
            t.grad = None

    # --- checkpoints: torch's ZeroRedundancyOptimizer pair, per-parameter format ---------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """The whole state (bf16: with fp32 "master"s) on group rank `to`, none elsewhere (collective)."""
        self._consolidated = optimizer_state.consolidate(
            self.flat_groups, self.pieces, self.optim, self.param_groups, self.group, to,
            self.shard_world, with_master=self.master_dtype != self.compute_dtype)

    def state_dict(self) -> dict[str, Any]:
        """Local: the last consolidated state, current param_groups; raises where none (torch's)."""
        return optimizer_state.consolidated_state_dict(self._consolidated, self.param_groups, self.rank)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Local, every rank: the whole state dict (consolidated, or a torch optimizer's) cut to shards."""
        optimizer_state.load_consolidated_state_dict(state_dict, self.param_groups, self.flat_groups,
                                                     self.pieces, self.optim)

    # --- inspection (collectives: every rank of the group calls them) ---------------------------
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The reduced gradients, gathered to full shape on every rank."""
        return optimizer_state.gathered(self.flat_groups, lambda g: g.shard_grad, self.reduce_dtype,
                                        self.device, self.group, sharded=self.stage > 0)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The master parameters (fp32 in bf16 mode), gathered to full shape on every rank."""
        return optimizer_state.gathered(self.flat_groups, lambda g: g.master, self.master_dtype,
                                        self.device, self.group, sharded=self.stage > 0)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The live tensors of the training state by kind (for a storage-deduplicated ledger)."""
        return optimizer_state.state_tensors(self.flat_groups, self.optim)
