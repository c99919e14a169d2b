"""Expert parallelism in the 3D trainer: what a mixture-of-experts model adds beside the recipe
(parallelize.py's `apply_expert_parallel` step cuts and wraps the experts): which expert slice a
rank's ShardMap places (`expert_slices`), the dispatch logs, the all-to-all's byte formula and the
load imbalance the report prints.

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

import torch
import torch.distributed as dist
from torch import nn

from common.kernel.collectives import all_gather_single
from common.kernel.mesh import ParallelMesh
from common.kernel.moe import moe_layers
from parallel3d.shards import EPSlice
from tensor_parallel.expert_parallel import all_to_all_bytes, expert_slice, is_expert
from tensor_parallel.expert_parallel import load_imbalance as ep_load_imbalance
from tensor_parallel.sharding import TPShard


def expert_slices(tp_specs: dict[str, TPShard], mesh: ParallelMesh, n_experts: int) -> dict[str, EPSlice]:
    """{reference name: EPSlice} of every expert tensor this rank holds: experts [e·E/ep, (e+1)·E/ep)."""
    start = expert_slice(mesh.ep_rank, mesh.ep, n_experts).start
    return {name: EPSlice(start, n_experts) for name in tp_specs if is_expert(name)}


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
