"""Sharded checkpoints of the 3D trainer (the lesson is README.md in this folder).

Core files (import only torch; the copy set "checkpoint save/load" of common/copy_sets.py is
save.py, load.py, state.py and reshard.py):
    reshard.py        Region: which elements of a global tensor a local tensor holds; copy_overlap
    save.py           Shard, save_checkpoint: the on-disk format, dedup of replicas, atomic commit
    load.py           load_checkpoint (any mesh), read_full, verify_checkpoint, resolve_checkpoint
    state.py          optimizer state sliced like its parameter, param-group state, RNG capture
    shard_layout.py   the region of each LLaMA tensor a rank of a dp × pp × tp mesh holds
    trainer.py        save/load a TrainerState (the 3D trainer's ShardMap, optimizer, scheduler,
                      RNG); its flags are 07_3d/train_checkpoint_flags.py's
    export.py         `python -m parallel3d.checkpoint.export DIR --out FILE [--hf]` (common/kernel/model.py;
                      safetensors for --hf, imported where it is used)
"""

from .load import load_checkpoint, read_full, resolve_checkpoint, verify_checkpoint
from .reshard import Region, copy_overlap
from .save import CheckpointError, Shard, save_checkpoint

__all__ = ["CheckpointError", "Region", "Shard", "copy_overlap", "load_checkpoint", "read_full",
           "resolve_checkpoint", "save_checkpoint", "verify_checkpoint"]
