"""Chapter 07: 3D parallelism (TP × PP × FSDP on one mesh) and the planner.

Core files (import only torch):
    mesh.py            mesh_shape(world, tp, pp, dp=None) -> (dp, pp, tp) or MeshError;
                       group_ranks(dp, pp, tp); init_device_mesh(tp, pp, dp) -> DeviceMesh3D
                       (TP innermost, then DP, PP outermost; .tp_group/.dp_group/.pp_group)
    clip.py            clip_grad_norm_(grads, counted, max_norm, group=None): the global norm
                       over all three dimensions, each element of the full model counted once
    checkpointing.py   apply_activation_checkpointing(blocks, "none" | "full" | "selective")
    lr_schedule.py     warmup_cosine(step, total, warmup, min_ratio), warmup_cosine_scheduler

Tools (use common/): memory_model.py (per-GPU memory and traffic of a layout), planner.py
(`python -m parallel3d.planner --model llama2-70b --gpus 64 --gpu-mem-gb 80`), comm_formulas.py
(the trainer's exact bytes), train.py (Parallel3DStrategy on the shared loop).
"""

from .checkpointing import CheckpointWrapper, apply_activation_checkpointing
from .clip import clip_grad_norm_, global_grad_norm
from .lr_schedule import warmup_cosine, warmup_cosine_scheduler
from .mesh import DeviceMesh3D, MeshError, group_ranks, init_device_mesh, mesh_shape

__all__ = ["CheckpointWrapper", "DeviceMesh3D", "MeshError", "apply_activation_checkpointing",
           "clip_grad_norm_", "global_grad_norm", "group_ranks", "init_device_mesh", "mesh_shape",
           "warmup_cosine", "warmup_cosine_scheduler"]
