"""Lab 07: compose 3D parallelism from the chapters' pieces, and clip by the true global norm.

You write README "The recipe" and "Clipping across three dimensions". The mesh is given
(common/kernel/mesh.py's `build_mesh`: world = pp × dp × cp × tp, TP innermost; `mesh.pp_rank`,
`mesh.tp_group`,
`mesh.cp_group`, `mesh.dp_cp_group`, ...) and so is the plumbing (the grader runs your chunks
with 06's PipelineExecutor, a torch optimizer and the data). Two functions are yours:

`parallelize`: this rank's part of a LLaMA built on the meta device (nothing allocated), in
torchtitan's order, each step one call of a chapter's public piece:

    split (06)  → this rank's pipeline stage(s): v chunks, stages pp_rank, pp + pp_rank, …
    TP    (05)  → each chunk cut over the TP group (attention by heads, MLP by columns, the
                  vocabulary of the embedding and head); returns {name: TPShard} per chunk
    CP    (05)  → only when mesh.cp > 1: every attention of every chunk through the ring
    FSDP  (04)  → each chunk flat-sharded over the ranks that hold the same (pp, tp) piece
                  (which of the mesh's groups is that, when cp > 1?), one unit per
                  TransformerBlock, materialized from the seed only where this rank's shard falls

    a rank holds 1/(dp·cp) of its TP piece of its stages' tensors, and nothing else.

`clip_global_norm`: torch.nn.utils.clip_grad_norm_'s contract for the whole model the mesh holds.
The norm must count every element of the full model's gradient once:

    ‖g‖ = sqrt( Σ_ranks Σ_{pieces this rank counts} ‖g_piece‖² )      one all-reduce of a scalar
    g  ← g · min(1, max_norm / (‖g‖ + 1e-6))                            every local gradient shard

FSDP shards are disjoint over dp × cp (all count); pipeline stages hold disjoint layers; a
TP-split piece is this rank's own; but a tensor each TP rank holds whole (an RMSNorm weight), or
that several TP ranks share (wk, wv when n_kv_heads < t), is a *copy*: it counts on one of them.

Tools (the chapters' public pieces; do not use 07's parallelize_3d, shard_map or
clip_grad_norm_3d: they are what you are writing):
- `pipeline.split_model(model, p, v, rank)` → [LlamaChunk]; a chunk's parameter names are the
  reference model's (`layers.2.attention.wq.weight`).
- `tensor_parallel.parallelize_llama(chunk, tp_group)` → {name: TPShard}, in place;
  `spec.copies`: how many consecutive TP ranks hold the same piece (1: a piece of its own);
  `tensor_parallel.local_piece(full, spec)` → this rank's piece of a full tensor.
- `tensor_parallel.apply_context_parallel(chunk, cp_group)`, in place.
- `fsdp.FSDP(chunk, process_group=…, auto_wrap_policy=fsdp.ModuleWrapPolicy({TransformerBlock}),
  device_id=device, shard_init_fn=fn)`: fn(name, meta_param) returns that parameter's values (as
  the module holds it), called only for the parameters overlapping this rank's shard.
  `common.kernel.model.initializer(model.cfg, seed)(name)` → the reference's full initial tensor.
- After backward: `chunk.shard_layout()` → one UnitShard per FSDP unit: `.flat_param` (this
  rank's shard; `.grad` its gradient) and `.params`, a ParamShard per original parameter: `.name`,
  and `flat_param[.shard_offset : .shard_offset + .numel]` holds its piece here (numel may be 0).
- `dist.all_reduce(t, op=dist.ReduceOp.SUM)` (no group: the whole world).

Check your work: `make lab-check N=7` (from the repo root), or `grade(7)` in the notebook. On
4-rank meshes (pp2×tp2, dp2×tp2, cp2×tp2, dp2×pp2; seeds 0 and 1) it compares what every rank
holds, two training steps and clipping (a max_norm below the norm and one above it) with one
device in float64 at 1e-10, piece by piece, names the rank (with its mesh coordinates) and the
tensor that differs, and checks the bytes each group carries against 07's formula. Only this
file is yours to edit; keep the names and signatures.
"""

from __future__ import annotations

import torch

from common.kernel.mesh import ParallelMesh
from common.kernel.model import Llama
from fsdp import FSDP
from tensor_parallel import TPShard

# What you will import (the Tools above): torch.distributed as dist; TransformerBlock, initializer
# from common.kernel.model; ModuleWrapPolicy from fsdp; split_model from pipeline; parallelize_llama,
# apply_context_parallel, local_piece from tensor_parallel.

def parallelize(model: Llama, mesh: ParallelMesh, device: torch.device, seed: int = 0,
                virtual_stages: int = 1) -> tuple[list[FSDP], dict[str, TPShard]]:
    """This rank's FSDP-wrapped chunks (one per virtual stage, in split_model's order) and the
    TPShard of every reference parameter they hold. `model` is on the meta device; the chunks'
    shards hold the values of `initializer(model.cfg, seed)`, cut to this rank's pieces."""
    raise NotImplementedError("parallelize: split_model → parallelize_llama per chunk → "
                              "apply_context_parallel (cp > 1) → FSDP per chunk")


def clip_global_norm(chunks: list[FSDP], tp_specs: dict[str, TPShard], mesh: ParallelMesh,
                     max_norm: float) -> torch.Tensor:
    """Scale this rank's gradient shards so that the whole model's gradient norm is at most
    `max_norm`; return the norm before clipping (a 0-dim tensor, the same on every rank). Every
    rank of the world calls it after backward, before the optimizer step."""
    raise NotImplementedError("clip_global_norm: Σ ‖counted pieces‖² over the world, sqrt, "
                              "scale every gradient shard")
