"""Chapter 07: 3D parallelism (TP × PP × FSDP on one mesh) and the planner.

The trainer (use 04–06 and common/):
    parallelize.py     parallelize_3d(model, mesh, config, device) -> (chunks, tp_specs): the recipe,
                       apply_pipeline_split → apply_tensor_parallel → apply_context_parallel
                       (cp > 1) → apply_recompute → apply_fsdp (over the DP × CP group)
    train.py           Parallel3DStrategy on the shared loop; flags and validation
    comm_formulas.py   the trainer's exact bytes per step

Core files (import only torch):
    mesh.py            mesh_shape(world, tp, pp, dp=None, cp=1) -> (dp, pp, cp, tp) or MeshError;
                       group_ranks(dp, pp, tp, cp=1); init_device_mesh(tp, pp, dp, cp=cp) ->
                       DeviceMesh3D (TP innermost, then CP, DP, PP outermost; .tp_group/.cp_group/
                       .dp_group/.dp_cp_group (FSDP's)/.pp_group)
    recompute.py       apply_recompute(blocks, "none" | "full" | "selective"), CheckpointWrapper
    lr_schedule.py     warmup_cosine(step, total, warmup, min_ratio), warmup_cosine_scheduler

The planner (use common/): memory_model.py (per-GPU memory and traffic of a layout), planner.py
(`python -m parallel3d.planner --model llama2-70b --gpus 64 --gpu-mem-gb 80`).
Checkpoints: the subpackage checkpoint/ (parallel3d.checkpoint, its lesson is its README.md).
"""

from .lr_schedule import warmup_cosine, warmup_cosine_scheduler
from .mesh import DeviceMesh3D, MeshError, group_ranks, init_device_mesh, mesh_shape
from .recompute import CheckpointWrapper, apply_recompute

__all__ = ["CheckpointWrapper", "DeviceMesh3D", "MeshError", "apply_recompute",
           "group_ranks", "init_device_mesh", "mesh_shape",
           "warmup_cosine", "warmup_cosine_scheduler"]
