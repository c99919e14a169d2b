"""Chapter 07: 3D parallelism (TP × PP × FSDP on one mesh; CP, EP and HSDP's replicas as more
dimensions) and the planner.

The pieces a trainer calls (core files: torch, common's kernel, chapters 04–06 by package name):
    (the mesh)         the kernel's common/kernel/mesh.py: build_mesh(mesh_shape(world, tp=, pp=, cp=))
                       -> ParallelMesh (TP innermost, then CP, DP (shard, then replicate), PP
                       outermost, EP borrowed from dp_shard × cp; .tp_group, .cp_group,
                       .dp_cp_group (FSDP's), .ep_group, .pp_group, .group(name))
    parallelize.py     parallelize_3d(model, mesh, Parallel3DConfig(...), device) -> (chunks,
                       tp_specs): the recipe, apply_pipeline_split → apply_tensor_parallel →
                       apply_context_parallel (cp > 1) → apply_expert_parallel (a MoE model: its
                       slice of the experts, all-to-all, FSDP units over dp_shard_mod_ep dividing
                       by dp·cp) → apply_recompute → apply_fsdp (over the DP × CP group);
                       activation_shape, rank_inputs (what the chunks take)
    experts.py         expert_slices (the ShardMap's EP slices), the dispatch logs, the all-to-all
                       formula and the load imbalance of a MoE model
    shards.py          shard_map(chunks, tp_specs, mesh, ep_slices=None) -> ShardMap: which elements
                       of which reference tensor this rank holds; gather_full (for --check)
    clip.py            clip_grad_norm_3d(shards, max_norm): the true global norm
    recompute.py       apply_recompute(blocks, "none" | "full" | "selective"), Recomputed
    lr_schedule.py     warmup_cosine(step, total, warmup, min_ratio), warmup_cosine_scheduler
    accounting.py      Rank3D and its closed forms (memory, activations; comm_formulas.py: bytes)

The demo: train.py (validate → the run, Train3DOptions its options; Parallel3DStrategy on the
shared loop).
The planner (use common/): memory_model.py (per-GPU memory and traffic of a layout) and
planner/ (`python -m parallel3d.planner --model llama2-70b --gpus 64 --gpu-mem-gb 80`).
Checkpoints: the subpackage checkpoint/ (parallel3d.checkpoint, its lesson is its README.md).
"""

from .clip import clip_grad_norm_3d
from .lr_schedule import warmup_cosine, warmup_cosine_scheduler
from .parallelize import Parallel3DConfig, activation_shape, parallelize_3d, rank_inputs
from .recompute import Recomputed, apply_recompute
from .shards import HeldPiece, ShardMap, gather_full, shard_map

__all__ = ["HeldPiece", "Parallel3DConfig", "Recomputed", "ShardMap", "activation_shape",
           "apply_recompute", "clip_grad_norm_3d", "gather_full", "parallelize_3d", "rank_inputs",
           "shard_map", "warmup_cosine", "warmup_cosine_scheduler"]
