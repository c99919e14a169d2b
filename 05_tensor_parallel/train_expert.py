"""Chapter 05 demo, MoE models: data parallelism over every rank, the experts sharded over EP
groups of `ep` consecutive ranks (expert_parallel.py's all-to-all dispatch), exact against one device.
Rank r takes its own rows (dp = world) and holds experts [i·E/ep, (i+1)·E/ep) of every MoE layer,
i = r mod ep; every other parameter is replicated. The global loss is the mean of the W ranks'
losses, so its gradient is (1/W) Σ_r ∂L_r. Non-expert gradients: SUM over the world, / W. An
expert's local gradient already sums every rank of its EP group (their tokens came to it, and
their gradients came back through the all-to-all's backward); the W/ep ranks holding the same
experts (same i) saw disjoint tokens: SUM over that replica group, / W (not / (W/ep)).

Per MoE layer and micro-batch, rank r sends A = its kept slots routed to other ranks' experts and
receives B = the other ranks' slots for its experts; the all-to-alls then send
    dispatch A rows, combine B rows (forward), their backwards B and A rows: 2(A+B)·dim·e bytes,
plus the count exchange (ep-1)/ep · E · 8 bytes (int64). Load: rows this rank's experts process.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from common.cli import ConfigError, batch_layout, model_config, require
from common.clip import clip_grads_by_global_norm_
from common.collectives import all_gather_single
from common.dist import DistContext
from common.memory import optimizer_state_tensors, storage_bytes
from common.mesh import MeshError, build_mesh, mesh_shape
from common.mixed_precision import MasterWeights
from common.model import build_model, initializer, materialize
from common.moe import RoutingPlan
from common.optimizer_bytes import optimizer_state_bytes
from common.reference import make_optimizer
from common.run import Run, resolve_run
from common.training import Strategy
from tensor_parallel.expert_parallel import AllToAllDispatcher, expert_parallel


def is_expert(name: str) -> bool:
    return ".experts." in name


def validate_moe(args: argparse.Namespace, world_size: int, options: object) -> Run:
    """A MoE model: only --tp 1 --cp 1 (no SP); --ep (default: the world) divides the world and E
    (the mesh's refusal: common/mesh.py)."""
    cfg = model_config(args)
    E, tp, cp = cfg.n_experts, args.tp, args.cp
    require(tp in (None, 1) and cp == 1 and not args.sequence_parallel,
            f"--model {args.model} is a mixture-of-experts model: chapter 05 trains it with expert "
            f"parallelism only, not --tp {tp} --cp {cp}{' --sequence-parallel' * args.sequence_parallel} "
            f"(routing needs whole sequences; TP of experts is not implemented): use --tp 1 --cp 1 "
            f"(the default for MoE) with --ep N")
    try:
        mesh = mesh_shape(world_size, ep=world_size if args.ep is None else args.ep, n_experts=E)
    except MeshError as error:
        raise ConfigError(f"--model {args.model}: {error}") from None
    layout = batch_layout(args.global_batch, world_size, args.micro_batch, args.grad_accum)
    return resolve_run(args, mesh, layout, options)


class CountingDispatcher(AllToAllDispatcher):
    """The all-to-all dispatcher, logging per dispatch from the routing counts (A, B, rows here)."""

    def __init__(self, group, n_experts: int):
        super().__init__(group, n_experts)
        self.mine = slice(dist.get_rank(group) * self.local, (dist.get_rank(group) + 1) * self.local)
        self.log: list[tuple[int, int, int]] = []

    def dispatch(self, x: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, list[int]]:
        counts = plan.counts.tolist()
        rows, local_counts = super().dispatch(x, plan)
        own = sum(counts[self.mine])
        self.log.append((sum(counts) - own, sum(local_counts) - own, sum(local_counts)))
        return rows, local_counts


class ExpertParallelStrategy(Strategy):
    """DP over the world, experts over EP groups, fp32 masters in mixed precision (as TP's)."""

    def __init__(self, run: Run, ctx: DistContext):
        cfg, self.mixed = run.model, run.mixed
        # EP group [r - i, r - i + ep), replica group {i, i + ep, …} (same experts), i = r mod ep
        grid = build_mesh(run.mesh, ("ep", "expert_dp"))
        self.ep_group, self.replica_group = grid.ep_group, grid.group("expert_dp")
        self.world, self.ep, self.dp_size, self.dp_rank = grid.size, grid.ep, grid.dp, grid.dp_rank
        self.model = build_model(cfg, dtype=run.dtype, device="meta")
        self.layers = expert_parallel(self.model, self.ep_group, CountingDispatcher)
        mine = self.layers[0].dispatcher.mine
        materialize(self.model, initializer(cfg, run.seed), ctx.device,
                    lambda name, full: full[mine] if is_expert(name) else full)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.weights = MasterWeights(self.model.parameters(), enabled=self.mixed)
        if self.mixed:
            self.model.to(torch.bfloat16)
        self.weights.accumulate_in_backward()
        self.optimizer = make_optimizer(self.weights.master, run.optimizer, run.lr)
        self.optimizer_name, self.clip_grad = run.optimizer, run.clip_grad
        self.name, self.mesh = "ep", {"dp": self.world, "ep": self.ep}
        self.dim, self.n_experts, self.device = cfg.dim, cfg.n_experts, ctx.device
        self.e = self.model.output.weight.itemsize
        self.reduce_itemsize = 4 if self.mixed else self.e  # fp32 master gradients in mixed precision
        self.steps_log: list[list[tuple[int, int, int]]] = []

    def _named(self, grads: bool) -> dict[str, torch.Tensor]:
        return {n: (m.grad if grads else m) for n, m in zip(self.names, self.weights.master, strict=True)}

    def after_backward(self) -> None:
        """Non-expert: SUM over the world; expert: SUM over the replica group; both / W."""
        named = self._named(True)
        replicas = self.world // self.ep
        for expert, group, size in ((False, None, self.world), (True, self.replica_group, replicas)):
            grads = [g for n, g in named.items() if is_expert(n) == expert]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if size > 1:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(self.world)
            for g, chunk in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(chunk.view_as(g))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """‖g‖² summed over the EP group: disjoint expert slices, the rest counted on its rank 0."""
        grads = self._named(True)
        first = dist.get_rank(self.ep_group) == 0
        counted = [g for n, g in grads.items() if is_expert(n) or first]
        return clip_grads_by_global_norm_(grads.values(), max_norm, counted, groups=(self.ep_group,))

    def _full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The experts gathered over the EP group (rank i's slice is rows [i·E/ep, (i+1)·E/ep))."""
        out = {n: t.detach() for n, t in tensors.items()}
        for n, t in out.items():
            if is_expert(n) and self.ep > 1:
                out[n] = t.new_empty(self.ep * t.shape[0], *t.shape[1:])
                all_gather_single(out[n], t.contiguous(), group=self.ep_group)
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self._full(self._named(True))

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self._full(self._named(False))

    def memory(self) -> dict[str, int]:
        extra = self.weights.master if self.mixed else []
        return {"params": storage_bytes(self.model.parameters()),
                "grads": storage_bytes(m.grad for m in self.weights.master),
                "optimizer": storage_bytes([*optimizer_state_tensors(self.optimizer), *extra])}

    def after_step(self, done: int) -> None:
        self.steps_log.append([entry for layer in self.layers for entry in layer.dispatcher.log])
        for layer in self.layers:
            layer.dispatcher.log = []

    def all_to_all_formula(self) -> float:
        """Σ over dispatches of 2(A+B)·dim·e + the counts' (ep-1)/ep · E · 8."""
        counts = (self.ep - 1) / self.ep * self.n_experts * 8
        return sum(2 * (a + b) * self.dim * self.e + counts for step in self.steps_log for a, b, _ in step)

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        """Per rank: the all-to-alls + per step 2(W-1)/W·P_rest·e_r + 2(g-1)/g·P_experts·e_r
        (g = W/ep) + the clip's one scalar over the EP group; params P_local·e, grads
        P_local·e_r, optimizer by optimizer_state_bytes (+ the fp32 master in mixed precision)."""
        sizes = {True: 0, False: 0}
        for n, p in self.model.named_parameters():
            sizes[is_expert(n)] += p.numel()
        g, P = self.world // self.ep, sum(sizes.values())
        per_step = ((2 * (self.world - 1) / self.world) * sizes[False] + (2 * (g - 1) / g) * sizes[True])
        per_step *= self.reduce_itemsize
        if self.clip_grad is not None:
            per_step += 2 * (self.ep - 1) / self.ep * (8 if self.e == 8 else 4)
        master = self.weights.master[0].itemsize
        opt = optimizer_state_bytes(self.optimizer_name, P, master, len(self.names))
        opt += P * master if self.mixed else 0
        return steps * per_step + self.all_to_all_formula(), {
            "params": P * self.e, "grads": P * self.reduce_itemsize, "optimizer": opt}

    def report_extras(self) -> dict:
        """The all-to-all formula; the rows each rank's experts processed in each dispatch (one per
        MoE layer and micro-batch) and per step, and per step `load_imbalance` of the dispatches.
        A collective."""
        load = torch.tensor([[n for _, _, n in step] for step in self.steps_log],
                            dtype=torch.float64, device=self.device)
        every = [torch.empty_like(load) for _ in range(self.world)]
        dist.all_gather(every, load)
        rows = torch.stack(every, -1)  # [steps, dispatches, world]
        imbalance = load_imbalance(rows, self.ep)
        return {"ep": self.ep, "ep_all_to_all_bytes_formula": self.all_to_all_formula(),
                "ep_rows_per_rank": rows.sum(1).tolist(), "ep_rows_per_dispatch": rows.tolist(),
                "ep_load_imbalance": imbalance.tolist(), "ep_load_imbalance_max": imbalance.max().item()}


def load_imbalance(rows: torch.Tensor, ep: int) -> torch.Tensor:
    """rows [steps, dispatches, world]: the rows each rank's experts took in each dispatch (EP
    groups: ep consecutive ranks) → per step, the max over dispatches and groups of max/mean
    over the group. Each layer's all-to-all waits for its slowest rank, so a step is as slow as
    its worst dispatch: rows summed over a step's layers would average the stragglers out."""
    grouped = rows.unflatten(-1, (-1, ep))
    return (grouped.amax(-1) / grouped.mean(-1).clamp_min(1e-300)).flatten(1).amax(-1)
