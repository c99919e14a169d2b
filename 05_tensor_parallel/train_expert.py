"""Chapter 05 demo: train a mixture-of-experts LLaMA with expert parallelism (and tensor parallelism).

    torchrun --standalone --nproc-per-node 4 05_tensor_parallel/train_expert.py --ep 2 --check
    make run-5-ep ARGS="--ep 2 --dtype float64 --check"                        (--model tiny-moe)
    make run-5-ep ARGS="--tp 2 --ep 2 --sequence-parallel --dtype float64 --check"

Data parallelism over the dp = W/t ranks of each TP index, the experts sharded over EP groups of
`ep` consecutive data-parallel ranks (expert_parallel.py's all-to-all dispatch) and, with --tp t,
every expert cut over the TP group like the dense SwiGLU (moe_tensor_parallel.py), exact against
one device. Data-parallel rank d takes its own rows and
holds experts [i·E/ep, (i+1)·E/ep) of every MoE layer, i = d mod ep; every other parameter is
replicated over dp (its TP piece). The global loss is the mean of the dp ranks' losses, so its
gradient is (1/dp) Σ_d ∂L_d. Non-expert gradients: SUM over the dp group, / dp. An expert's local
gradient already sums every rank of its EP group (their tokens came to it, and their gradients
came back through the all-to-all's backward); the dp/ep ranks holding the same experts (same i)
saw disjoint tokens: SUM over that replica group, / dp (not / (dp/ep)).

Per MoE layer and micro-batch, rank r sends A = its kept slots routed to other ranks' experts and
receives B = the other ranks' slots for its experts; the all-to-alls then send
    dispatch A rows, combine B rows (forward), their backwards B and A rows: 2(A+B)·dim·e bytes,
plus the count exchange (ep-1)/ep · E · 8 bytes (int64). Load: rows this rank's experts process.
With --tp t every TP rank of a data-parallel rank dispatches the same rows in its own EP group
(the same bytes each), and the TP collectives add chapter 05's per block (formulas.py) plus each
MoE layer's router weight gradient, less SP's re-gather (moe_tensor_parallel.moe_block_extra_bytes).
--bias-update-rate γ: DeepSeek-V3's selection bias (common/kernel/moe.py), updated after each step
from the loads of every dp rank (one all-reduce of L·E counts over the dp group).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from common.cli import ConfigError, base_parser, batch_layout, model_config, require, validate_common
from common.data import split_inputs_targets
from common.dist import DistContext
from common.kernel.clip import clip_grads_by_global_norm_
from common.kernel.collectives import all_gather_single
from common.kernel.comm_bytes import ring_fraction
from common.kernel.mesh import MeshError, build_mesh, mesh_shape
from common.kernel.model import LlamaConfig, build_model, initializer, loss_fn, materialize
from common.kernel.moe import update_bias_after_each_step
from common.kernel.optimizer_bytes import optimizer_state_bytes
from common.memory import optimizer_state_tensors, storage_bytes
from common.mixed_precision import MasterWeights
from common.reference import make_optimizer
from common.run import Run, resolve_run
from common.training import Strategy, run_main
from tensor_parallel.expert_parallel import (
    CountingDispatcher,
    all_to_all_bytes,
    expert_parallel,
    expert_slice,
    is_expert,
    load_imbalance,
)
from tensor_parallel.formulas import Shape, microbatch_comm_bytes
from tensor_parallel.moe_tensor_parallel import moe_block_extra_bytes, parallelize_moe_llama
from tensor_parallel.parallelize import check_tp_sizes, vocab_parallel_loss
from tensor_parallel.sharding import gather_full, local_piece, tp_shard_specs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0])
    p.set_defaults(model="tiny-moe")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size: experts sharded over "
                   "groups of ep consecutive data-parallel ranks (default: every dp rank, dp = world / tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: every expert cut like the SwiGLU")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="shard the norm/residual regions along the sequence (with --tp)")
    p.add_argument("--bias-update-rate", type=float, default=None, metavar="GAMMA",
                   help="DeepSeek-V3's auxiliary-loss-free balancing: each expert's selection bias "
                        "moves by GAMMA after every step (default: the model's, 0 = off)")
    return p.parse_args(argv)


@dataclass(frozen=True)
class ExpertParallelOptions:
    """The demo's resolved flags (the run's `options`); tp, dp and ep are the run's mesh."""

    sequence_parallel: bool = False


def validate(args: argparse.Namespace, world_size: int) -> Run:
    """A MoE model (routing and the per-sequence aux loss need whole sequences: no CP here); --tp t
    cuts every expert, --ep (default: every data-parallel rank) divides dp = W/t and E (the mesh's
    refusals: common/kernel/mesh.py)."""
    validate_common(args)
    cfg, tp = model_config(args), args.tp or 1
    require(cfg.n_experts > 0, f"--model {args.model} has no experts: expert parallelism needs a "
                               "mixture-of-experts model (e.g. --model tiny-moe); a dense one: make run-5")
    cfg = with_bias_update_rate(cfg, getattr(args, "bias_update_rate", None), args.check)
    try:
        dp = mesh_shape(world_size, tp=tp).dp
        mesh = mesh_shape(world_size, tp=tp, ep=dp if args.ep is None else args.ep, n_experts=cfg.n_experts)
        check_tp_sizes(tp, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim, args.seq_len,
                       args.sequence_parallel, cfg.expert_hidden_dim)
    except (MeshError, ValueError) as error:
        default = " (--ep defaults to every data-parallel rank)" if args.ep is None else ""
        raise ConfigError(f"--model {args.model}: {error}{default}") from None
    layout = batch_layout(args.global_batch, mesh.dp, args.micro_batch, args.grad_accum)
    return resolve_run(args, mesh, layout, ExpertParallelOptions(args.sequence_parallel), model=cfg)


def with_bias_update_rate(cfg: LlamaConfig, rate: float | None, check: bool) -> LlamaConfig:
    """--bias-update-rate into the model's config (None: the model's own). Refused with --check:
    the single-device reference does not update a bias (tests/test_moe_router.py compares one)."""
    if rate is not None:
        require(rate >= 0, f"--bias-update-rate {rate}: use >= 0 (0: no selection bias)")
        cfg = replace(cfg, bias_update_rate=rate)
    require(not (check and cfg.bias_update_rate), f"--bias-update-rate {cfg.bias_update_rate} with "
            "--check: the single-device reference of --check does not update the router's bias; "
            "drop one of the flags")
    return cfg


class ExpertParallelStrategy(Strategy):
    """DP over the ranks of each TP index, experts over EP groups (and cut over TP), fp32 masters
    in mixed precision (as TP's)."""

    def __init__(self, run: Run, ctx: DistContext):
        cfg, self.mixed = run.model, run.mixed
        self.sequence_parallel = run.options.sequence_parallel
        # EP group: ep consecutive dp ranks of one TP index; replica group: the dp ranks with the
        # same experts (same i = d mod ep); dp: every data-parallel rank of this TP index
        grid = build_mesh(run.mesh, ("tp", "ep", "dp", "expert_dp"))
        self.world, self.tp, self.ep, self.dp_size = grid.size, grid.tp, grid.ep, grid.dp
        self.ep_group, self.replica_group = grid.ep_group, grid.group("expert_dp")
        self.tp_group, self.dp_group, self.dp_rank = grid.tp_group, grid.dp_group, grid.dp_rank
        self.model = build_model(cfg, dtype=run.dtype, device="meta")
        self.specs = (parallelize_moe_llama(self.model, self.tp_group, self.sequence_parallel)
                      if self.tp > 1 else tp_shard_specs(self.model, self.tp_group))
        self.layers = expert_parallel(self.model, self.ep_group, CountingDispatcher)
        mine = expert_slice(grid.ep_rank, self.ep, cfg.n_experts)

        def piece(name: str, full: torch.Tensor) -> torch.Tensor:  # its TP piece, then its experts
            local = local_piece(full, self.specs[name])
            return local[mine] if is_expert(name) else local

        materialize(self.model, initializer(cfg, run.seed), ctx.device, piece)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.weights = MasterWeights(self.model.parameters(), enabled=self.mixed)
        if self.mixed:
            self.model.to(torch.bfloat16)
        self.weights.accumulate_in_backward()
        self.optimizer = make_optimizer(self.weights.master, run.optimizer, run.lr)
        update_bias_after_each_step(self.optimizer, self.model, self.dp_group)  # γ > 0: the loads of dp
        self.optimizer_name, self.clip_grad = run.optimizer, run.clip_grad
        self.name = "ep" if self.tp == 1 else "tp+ep"
        self.dim, self.n_experts, self.device = cfg.dim, cfg.n_experts, ctx.device
        self.bias_update_rate = cfg.bias_update_rate
        self.e = self.model.output.weight.itemsize
        self.reduce_itemsize = 4 if self.mixed else self.e  # fp32 master gradients in mixed precision
        self.steps_log: list[list[tuple[int, int, int]]] = []
        self.shape = Shape(run.micro_batch, run.seq_len, cfg.dim, cfg.n_heads, cfg.n_kv_heads,
                           cfg.hidden_dim, cfg.n_layers, cfg.vocab_size, cfg.head_dim, self.tp,
                           self.sequence_parallel, self.e)
        self.grad_accum = run.grad_accum

    def micro_batch_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = split_inputs_targets(tokens)
        if self.tp == 1:
            return loss_fn(self.model(inputs), targets)
        return vocab_parallel_loss(self.model.output, self.model(inputs), targets)

    def _named(self, grads: bool) -> dict[str, torch.Tensor]:
        return {n: (m.grad if grads else m) for n, m in zip(self.names, self.weights.master, strict=True)}

    def after_backward(self) -> None:
        """Non-expert: SUM over the dp group; expert: SUM over the replica group; both / dp."""
        named = self._named(True)
        replicas = self.dp_size // self.ep
        for expert, group, size in ((False, self.dp_group, self.dp_size),
                                    (True, self.replica_group, replicas)):
            grads = [g for n, g in named.items() if is_expert(n) == expert]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if size > 1:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(self.dp_size)
            for g, chunk in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(chunk.view_as(g))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """‖g‖² summed over the EP and TP groups: disjoint expert slices, the rest counted on the
        EP group's rank 0; TP pieces once (a replicated one on one of its copies)."""
        grads = self._named(True)
        first = dist.get_rank(self.ep_group) == 0
        counted = [g for n, g in grads.items() if self.specs[n].counted_here and (is_expert(n) or first)]
        return clip_grads_by_global_norm_(grads.values(), max_norm, counted,
                                          groups=(self.ep_group, self.tp_group))

    def _full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The TP pieces gathered over the TP group, then the experts over the EP group (rank i's
        slice is rows [i·E/ep, (i+1)·E/ep))."""
        out = gather_full(tensors, self.specs)
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
        """Σ over dispatches of 2(A+B)·dim·e + the counts' (ep-1)/ep · E · 8 (all_to_all_bytes)."""
        return sum(all_to_all_bytes(a, b, self.dim, self.e, self.ep, self.n_experts)
                   for step in self.steps_log for a, b, _ in step)

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        """Per rank: the all-to-alls + per step 2(d-1)/d·P_rest·e_r + 2(g-1)/g·P_experts·e_r
        (d = dp, g = dp/ep, P: this rank's TP pieces) + the clip's one scalar over the EP and TP
        groups (+ with a router bias 2(d-1)/d · L·E·8, the loads) + under TP, per micro-batch,
        chapter 05's blocks, embedding and head and each MoE layer's router gradient; params
        P_local·e, grads P_local·e_r, optimizer by optimizer_state_bytes (+ the fp32 master in
        mixed precision)."""
        sizes = {True: 0, False: 0}
        for n, p in self.model.named_parameters():
            sizes[is_expert(n)] += p.numel()
        d, g, P = self.dp_size, self.dp_size // self.ep, sum(sizes.values())
        per_step = (ring_fraction(d, 2) * sizes[False] + ring_fraction(g, 2) * sizes[True])
        per_step *= self.reduce_itemsize
        if self.clip_grad is not None:
            per_step += sum(ring_fraction(n, 2) * (8 if self.e == 8 else 4) for n in (self.ep, self.tp))
        if self.bias_update_rate:  # the routing loads: L·E int64 counts over the dp group
            per_step += ring_fraction(d, 2) * len(self.layers) * self.n_experts * 8
        if self.tp > 1:
            moe = len(self.layers) * moe_block_extra_bytes(self.shape, self.n_experts)
            per_step += self.grad_accum * (microbatch_comm_bytes(self.shape) + moe)
        master = self.weights.master[0].itemsize
        opt = optimizer_state_bytes(self.optimizer_name, P, master, len(self.names))
        opt += P * master if self.mixed else 0
        return steps * per_step + self.all_to_all_formula(), {
            "params": P * self.e, "grads": P * self.reduce_itemsize, "optimizer": opt}

    def report_extras(self) -> dict:
        """The all-to-all formula; the rows each rank's experts processed in each dispatch (one per
        MoE layer and micro-batch) and per step, and per step `load_imbalance` of the dispatches,
        over the dp ranks of this TP index (they hold the experts; its TP ranks take the same rows).
        A collective."""
        load = torch.tensor([[n for _, _, n in step] for step in self.steps_log],
                            dtype=torch.float64, device=self.device)
        every = [torch.empty_like(load) for _ in range(self.dp_size)]
        dist.all_gather(every, load, group=self.dp_group)
        rows = torch.stack(every, -1)  # [steps, dispatches, dp]
        imbalance = load_imbalance(rows, self.ep)
        return {"ep": self.ep, "ep_all_to_all_bytes_formula": self.all_to_all_formula(),
                "ep_rows_per_rank": rows.sum(1).tolist(), "ep_rows_per_dispatch": rows.tolist(),
                "ep_load_imbalance": imbalance.tolist(), "ep_load_imbalance_max": imbalance.max().item()}


def build(run: Run, ctx: DistContext) -> Strategy:
    return ExpertParallelStrategy(run, ctx)


if __name__ == "__main__":
    run_main(parse_args, validate, build, chapter=5)
