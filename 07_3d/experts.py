"""Expert parallelism in the 3D recipe: what a mixture-of-experts model adds to parallelize_3d.

    parallelize_moe_3d = parallelize_3d with
      TP   05's MoE plan: every expert and the shared expert cut like the dense SwiGLU over the TP
           group, the router whole on every TP rank (tensor_parallel.moe_tensor_parallel)
      EP   before recomputation and FSDP, each MoE layer keeps the experts of its EP slice
           e = the rank's place in its EP group (the mesh's ep coordinate), [e·E/ep, (e+1)·E/ep),
           and dispatches by all-to-all over the EP group (05's expert_parallel); its
           GroupedExperts becomes an FSDP unit of its own, sharded over dp_shard_mod_ep (the ranks
           of one replica that hold the same experts) and, under HSDP, all-reduced over
           dp_replicate. Everything else is sharded over dp_shard × cp as in a dense model.

EP borrows its ranks from dp_shard (common/kernel/mesh.py): an EP group is ep consecutive data-parallel
ranks of one TP index, one pipeline stage and one replica. Each takes its own rows, so its
experts see the tokens of all ep ranks, and the gradient that arrives in an expert's weights
after backward is already a sum over the EP group:

    g_e(rank) = Σ_{q in its EP group} ∂L_q/∂W_e                       (the all-to-all's backward)
    SUM over dp_shard_mod_ep (reduce-scatter), SUM over dp_replicate (HSDP's all-reduce)
        = Σ over all dp·cp data-parallel ranks q of ∂L_q/∂W_e
    ÷ dp·cp (set_gradient_divide_factor)  = ∂/∂W_e of the mean of the dp·cp ranks' losses

FSDP's own divisor would be its group's size, dp·cp/ep: gradients ep× too large (torchtitan
sets the same factor). Clipping counts each expert piece once: the EP slices are disjoint, and
within a slice the ShardMap's rule for its unit's group (shards.first_holder with j div ep).

    world 8 = pp 2 × dp_shard 2 × tp 2, ep 2:   ep {0,2} {1,3} {4,6} {5,7}   dp_shard_mod_ep: one rank
    world 8 = dp_replicate 2 × dp_shard 2 × tp 2, ep 2:   ep {0,2} {1,3} {4,6} {5,7},
              dp_replicate {0,4} {1,5} {2,6} {3,7} (each expert shard's all-reduce)

Routing needs whole sequences (the per-sequence aux loss, capacity): no context parallelism with
experts (train.py refuses it). Depends only on torch, common's kernel and chapters 04-06.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.collectives import all_gather_single
from common.kernel.mesh import ParallelMesh
from common.kernel.model import Llama, initializer
from common.kernel.moe import MoEFeedForward, moe_layers
from fsdp.fully_sharded import FullyShardedDataParallel
from fsdp.wrap import ShardingStrategy
from parallel3d.parallelize import Parallel3DConfig, fsdp_groups, mixed_precision, parallelize_3d
from parallel3d.shards import EPSlice
from pipeline.stage import LlamaChunk
from tensor_parallel.expert_parallel import CountingDispatcher, all_to_all_bytes, expert_parallel
from tensor_parallel.expert_parallel import load_imbalance as ep_load_imbalance
from tensor_parallel.moe_tensor_parallel import parallelize_moe_llama
from tensor_parallel.sharding import TPShard, local_piece


def is_expert(name: str) -> bool:
    """A routed expert's stacked weights (…feed_forward.experts.w1/w2/w3)."""
    return ".experts." in name


def expert_rank(mesh: ParallelMesh) -> int:
    """Which slice of the experts this rank holds: its place in its EP group (the mesh's ep
    coordinate, j mod ep), the order in which the all-to-all sends tokens to the group."""
    return mesh.ep_rank


def expert_slices(tp_specs: dict[str, TPShard], mesh: ParallelMesh, n_experts: int) -> dict[str, EPSlice]:
    """{reference name: EPSlice} of every expert tensor this rank holds: experts [e·E/ep, (e+1)·E/ep)."""
    n = n_experts // mesh.ep
    return {name: EPSlice(expert_rank(mesh) * n, n_experts) for name in tp_specs if is_expert(name)}


def apply_expert_parallel(chunks: list[LlamaChunk], tp_specs: dict[str, TPShard], mesh: ParallelMesh,
                          config: Parallel3DConfig, device: torch.device) -> list[MoEFeedForward]:
    """EP on every MoE layer of this rank's chunks, in place (on the meta device, before
    recomputation and FSDP): its experts' slice, the counting all-to-all dispatcher over the EP
    group, and its GroupedExperts as an FSDP unit over dp_shard_mod_ep (HSDP: and dp_replicate),
    dividing its gradient by dp·cp. Each unit draws only the TP piece of its experts that overlaps
    this rank's shard. Returns the MoE layers."""
    cfg = chunks[0].cfg
    init, slices = initializer(cfg, config.seed), expert_slices(tp_specs, mesh, cfg.n_experts)
    layers = []
    for chunk in chunks:
        for prefix, layer in chunk.named_modules():
            if not isinstance(layer, MoEFeedForward):
                continue
            if mesh.ep > 1:  # else every expert here: the local dispatcher, no all-to-all
                expert_parallel(layer, mesh.ep_group, CountingDispatcher)

            def piece(name: str, _, prefix: str = prefix) -> torch.Tensor:
                full = f"{prefix}.experts.{name}"
                s = slices[full]
                local = local_piece(init(full), tp_specs[full])
                return local[s.start : s.start + s.full // mesh.ep]

            layer.experts = FullyShardedDataParallel(
                layer.experts, process_group=fsdp_groups(mesh, config.sharding_strategy, "dp_shard_mod_ep"),
                sharding_strategy=ShardingStrategy[config.sharding_strategy],
                mixed_precision=mixed_precision(config), device_id=device, shard_init_fn=piece)
            layer.experts.set_gradient_divide_factor(mesh.dp * mesh.cp)
            layers.append(layer)
    return layers


def parallelize_moe_3d(model: Llama, mesh: ParallelMesh, config: Parallel3DConfig, device: torch.device
                       ) -> tuple[list[FullyShardedDataParallel], dict[str, TPShard]]:
    """parallelize_3d for a MoE LLaMA: 05's MoE plan, then expert parallelism before FSDP."""
    experts = partial(apply_expert_parallel, mesh=mesh, config=config, device=device)
    return parallelize_3d(model, mesh, config, device, parallelize_moe_llama, experts)


def dispatch_logs(model: nn.Module) -> list[tuple[int, int, int]]:
    """Every MoE layer's dispatches since the last call (A, B, rows), emptied."""
    out = []
    for layer in moe_layers(model):
        out += getattr(layer.dispatcher, "log", [])
        layer.dispatcher.log = []
    return out


def all_to_all_formula(steps_log: list[list[tuple[int, int, int]]], dim: int, e: int, ep: int,
                       n_experts: int, recomputed: bool) -> float:
    """This rank's all-to-all bytes from its routing counts (05's all_to_all_bytes per dispatch):
    every dispatch's forward; the backward once per original forward (under full recomputation
    every second dispatch is a block's forward run again, with the same A and B)."""
    forward = sum(all_to_all_bytes(a, b, dim, e, ep, n_experts, backward=False)
                  for step in steps_log for a, b, _ in step)
    rows = sum(a + b for step in steps_log for a, b, _ in step) * dim * e
    return forward + rows / (2 if recomputed else 1) if ep > 1 else 0.0


def load_imbalance(steps_log: list[list[tuple[int, int, int]]], mesh: ParallelMesh,
                   device: torch.device) -> tuple[list[float], list]:
    """Per step, 05's load_imbalance: the max over dispatches (MoE layer × micro-batch, in the
    order the schedule runs them, the same on every rank of an EP group) and EP groups of max/mean
    of the rows each rank's experts processed (1: balanced); and this rank's EP group's rows
    [steps][dispatches][ep]. A collective over the EP group, then over the world (MAX: the
    pipeline stages hold different layers)."""
    rows = torch.tensor([[float(n) for *_, n in step] for step in steps_log], dtype=torch.float64,
                        device=device).view(len(steps_log), -1)  # [steps, dispatches]
    every = torch.empty(mesh.ep * rows.numel(), dtype=torch.float64, device=device)
    all_gather_single(every, rows.reshape(-1), group=mesh.ep_group)
    every = every.view(mesh.ep, *rows.shape).permute(1, 2, 0)  # [steps, dispatches, ep]
    worst = (ep_load_imbalance(every, mesh.ep) if rows.shape[1]
             else torch.zeros(len(steps_log), dtype=torch.float64, device=device))  # a stage without MoE
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.tolist(), every.tolist()
