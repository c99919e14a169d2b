"""Checkpoints of the 3D trainer: its shards, optimizer, LR schedule and RNG, saved and loaded
on any mesh. What a rank holds is the ShardMap (shards.py): per piece, a flat range of an FSDP
flat shard that is a `Region` of a reference tensor. AdamW's exp_avg / exp_avg_sq are flat
tensors shaped like the shard, sliced the same way; its step counter is one scalar per flat
shard, saved under each of its names.

    save_trainer_state(state, root, step, data=, config=)   every rank; after `step` steps
    load_trainer_state(state, path, data=, config=)         every rank; returns the steps done
    Checkpointing(state, plan, steps, rank, world)          the trainer's schedule of saves

`state` (TrainerState) is what the files hold: the ShardMap, the optimizer, the scheduler, the
device whose RNG is saved and the modules whose buffers are saved whole (a MoE router's bias);
`data` (DATA_KEYS: the flags the batches depend on, train_checkpoint_flags.py's `data_identity`)
and `config` (trainer_config) are what a checkpoint must match to be resumed. The flags
(--checkpoint-dir, --save-every, --resume, --keep) and their validation into a CheckpointPlan are
the demo's (07_3d/train_checkpoint_flags.py). Depends only on torch (and the ShardMap of shards.py).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from parallel3d.checkpoint.load import load_checkpoint, resolve_checkpoint
from parallel3d.checkpoint.save import CheckpointError, save_checkpoint
from parallel3d.checkpoint.state import (
    ParamSlice,
    capture_rng_state,
    init_optimizer_state,
    load_param_groups_state,
    model_shards,
    optimizer_shards,
    param_groups_state,
    restore_rng_state,
)
from parallel3d.shards import ShardMap

DATA_KEYS = ("seed", "data", "global_batch", "seq_len")  # a resume must see the same batches
RESUME = ("never", "must", "auto")


@dataclass
class TrainerState:
    """What a checkpoint saves and restores on this rank."""

    shards: ShardMap
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    device: torch.device  # whose RNG is saved (CPU's always)
    info: dict = field(default_factory=dict)  # JSON saved beside it (mesh, dtype, ...)
    modules: Sequence[nn.Module] = ()  # whose buffers are saved whole (the chunks: routers' biases)


@dataclass(frozen=True)
class CheckpointPlan:
    """The validated checkpoint flags: where to save, how often, what to resume from, and what a
    checkpoint must match (None without --checkpoint-dir)."""

    directory: str | None = None
    save_every: int = 0
    keep: int = 2
    resume_from: Path | None = None
    data: dict | None = None
    config: dict | None = None


def param_slices(shards: ShardMap) -> dict[str, ParamSlice]:
    """{reference name: ParamSlice of a flat shard} for every piece this rank holds."""
    return {p.name: ParamSlice(shards.units[p.unit].flat_param, p.region, start=p.start)
            for p in shards.pieces}


def whole_buffers(modules: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """{reference name: buffer} of every persistent buffer of `modules` (a MoE router's bias
    `bias_steps`, the same on every rank that holds its layer: saved once, loaded whole; a dense
    LLaMA has none), the wrappers' segments dropped from the names. Read at each save and load:
    a layer may have moved its buffer to the device since."""
    wrapped = lambda part: part.startswith("_") and part.endswith("wrapped_module")  # noqa: E731
    return {".".join(p for p in name.split(".") if not wrapped(p)): b
            for m in modules for name, b in m.named_buffers()}


def data_mismatch(saved: dict, now: dict) -> str | None:
    """One line naming the first difference between a checkpoint's data identity and this run's."""
    for k in DATA_KEYS:
        if saved.get(k) != now[k]:
            return (f"--{k.replace('_', '-')} {now[k]}: the checkpoint was trained with {saved.get(k)}; "
                    "resume with the same value (the batch order depends on it)")
    if saved.get("corpus_crc32") != now.get("corpus_crc32"):
        return (f"--data {now['data'] or '(this repository)'}: the corpus changed since the checkpoint "
                f"was saved (crc32 {saved.get('corpus_crc32')} != {now.get('corpus_crc32')}): the same "
                "steps would draw other batches; resume on the corpus it was trained on")
    return None


def trainer_config(cfg, optimizer: str) -> dict:
    """What a checkpoint must match to be loaded by this run: the architecture and optimizer."""
    return {"model": asdict(cfg), "optimizer": optimizer}


def save_trainer_state(state: TrainerState, root: str | Path, step: int, *, data: dict, config: dict,
                       keep: int | None = None) -> Path:
    """Checkpoint `step` (optimizer steps done) under `root`; every rank calls it."""
    slices = param_slices(state.shards)
    opt = state.optimizer
    saved = {"step": step, "data": data,
             "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
             "param_groups": param_groups_state(opt), **state.info}
    shards = {**model_shards(slices), **optimizer_shards(opt, slices), **whole_buffers(state.modules)}
    return save_checkpoint(root, step, shards, saved, config=config,
                           rank_state=capture_rng_state(state.device), keep=keep)


def load_trainer_state(state: TrainerState, path: str | Path, *, data: dict, config: dict) -> int:
    """Load the checkpoint at `path` (root with `latest`, or a step directory), saved on any
    mesh, into this rank's shards, optimizer, schedule and RNG; returns the steps already done."""
    slices = param_slices(state.shards)
    init_optimizer_state(state.optimizer)  # its lazily built tensors, to be filled
    targets = {**model_shards(slices), **optimizer_shards(state.optimizer, slices),
               **whole_buffers(state.modules)}
    loaded = load_checkpoint(path, targets, config=config)
    saved = loaded.state
    if (mismatch := data_mismatch(saved["data"], data)) is not None:
        raise CheckpointError(f"{loaded.path}: {mismatch}")
    load_param_groups_state(state.optimizer, saved["param_groups"])
    if state.scheduler is not None and saved["scheduler"] is not None:
        state.scheduler.load_state_dict(saved["scheduler"])
    if loaded.rank_state is not None:  # same world size: each rank gets its own generators back
        restore_rng_state(loaded.rank_state, state.device)
    return loaded.step


class Checkpointing:
    """The trainer's checkpoints: `resume()` once after building (the steps already done: the
    loop runs range(start_step, --steps), and data.global_batch(step) makes the step the data
    position), `restore_rng_once()` at the top of the first step, `after_step(done)` saves every
    --save-every steps and after the last."""

    def __init__(self, state: TrainerState, plan: CheckpointPlan, steps: int, rank: int, world: int):
        self.state, self.plan, self.steps, self.rank, self.world = state, plan, steps, rank, world
        self.rng_to_restore: dict | None = None

    def resume(self) -> int:
        """Shards, AdamW state, LR schedule and RNG from plan.resume_from (any mesh), or 0."""
        plan = self.plan
        if plan.resume_from is None:
            return 0
        done = load_trainer_state(self.state, plan.resume_from, data=plan.data, config=plan.config)
        # the loop reseeds every generator after build(): keep the checkpoint's for step 1
        self.rng_to_restore = capture_rng_state(self.state.device)
        return done

    def restore_rng_once(self) -> None:
        if self.rng_to_restore is not None:
            restore_rng_state(self.rng_to_restore, self.state.device)
            self.rng_to_restore = None

    def after_step(self, done: int) -> None:
        kill_if_asked(done, self.rank, self.world)
        plan = self.plan
        if plan.directory is not None and save_due(done, plan.save_every, self.steps):
            save_trainer_state(self.state, plan.directory, done, data=plan.data, config=plan.config,
                               keep=plan.keep)


def checkpoint_to_resume(root: str | Path, resume: str) -> Path | None:
    """What `--resume` means: 'never' → None; 'must' → the committed checkpoint under `root` or
    CheckpointError; 'auto' (restarts under torchrun) → that checkpoint, or None when `root` holds
    no committed checkpoint yet (missing, empty, or only a crashed first save's temporary dir)."""
    if resume == "never":
        return None
    try:
        return resolve_checkpoint(root)
    except CheckpointError:
        root = Path(root)
        fresh = not root.exists() or all(p.name.endswith(".tmp") for p in root.iterdir())
        if resume == "auto" and fresh:
            return None
        raise


def save_due(step: int, save_every: int, total: int) -> bool:
    """Save after step `step` (1-based count of steps done)? Every `save_every` steps and after
    the last one (save_every 0: after the last one only)."""
    return step == total or (save_every > 0 and step % save_every == 0)


def kill_if_asked(done: int, rank: int, world_size: int) -> None:
    """Fault injection for the kill-and-resume test: with PFS_KILL_AT_STEP=K (and PFS_KILL_RANK=R,
    default the last rank), rank R SIGKILLs itself after step K, before that step's checkpoint, in
    the first launch of a torchrun job only (TORCHELASTIC_RESTART_COUNT == "0"), so the restarted
    job, same command line, runs through."""
    at = os.environ.get("PFS_KILL_AT_STEP")
    if at is None or os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0" or done != int(at):
        return
    if rank == int(os.environ.get("PFS_KILL_RANK", world_size - 1)):
        os.kill(os.getpid(), signal.SIGKILL)
