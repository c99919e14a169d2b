"""Lab 07, the reference: the 3D recipe from the chapters' pieces, and clipping over the mesh.

`make lab-check N=7 SOLUTION=1` grades this file with the same properties as your lab.py. Read it
after you have passed them, or when you are stuck for good.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.kernel.mesh import ParallelMesh
from common.kernel.model import Llama, TransformerBlock, initializer
from fsdp import FSDP, ModuleWrapPolicy
from pipeline import split_model
from tensor_parallel import TPShard, apply_context_parallel, local_piece, parallelize_llama


def parallelize(model: Llama, mesh: ParallelMesh, device: torch.device, seed: int = 0,
                virtual_stages: int = 1) -> tuple[list[FSDP], dict[str, TPShard]]:
    """Split (06) → TP (05) → CP (05) → FSDP over DP × CP (04): torchtitan's order."""
    chunks = split_model(model, mesh.pp, virtual_stages, mesh.pp_rank)
    tp_specs: dict[str, TPShard] = {}
    for chunk in chunks:
        tp_specs.update(parallelize_llama(chunk, mesh.tp_group))
        if mesh.cp > 1:
            apply_context_parallel(chunk, mesh.cp_group)
    init = initializer(model.cfg, seed)

    def tp_piece(name: str, _meta: torch.Tensor) -> torch.Tensor:
        return local_piece(init(name), tp_specs[name])  # the seeded full tensor, cut to this TP rank

    return [FSDP(chunk, process_group=mesh.dp_cp_group, device_id=device, shard_init_fn=tp_piece,
                 auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
            for chunk in chunks], tp_specs


def clip_global_norm(chunks: list[FSDP], tp_specs: dict[str, TPShard], mesh: ParallelMesh,
                     max_norm: float) -> torch.Tensor:
    """‖g‖² = Σ_world Σ_{pieces this rank counts} ‖g_piece‖²; g ← g · min(1, max_norm / (‖g‖ + 1e-6))."""
    grads, total = [], None
    for chunk in chunks:
        for unit in chunk.shard_layout():
            grad = unit.flat_param.grad
            if grad is None:
                continue
            grads.append(grad)
            total = grad.new_zeros(()) if total is None else total
            for p in unit.params:  # FSDP shards are disjoint: a piece counts unless it is a TP copy
                if tp_specs[p.name].counted_here:
                    total += grad[p.shard_offset : p.shard_offset + p.numel].pow(2).sum()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)  # over the world: every stage, TP, DP and CP rank
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef)
    return norm
