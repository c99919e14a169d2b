"""Checkpoints of the 3D trainer (train.py's Parallel3DStrategy): which region of which reference
tensor each element of a rank's FSDP flat shards is, and the training state around it.

A rank of the pp × dp × cp × tp mesh holds, per FSDP unit of its pipeline chunks, one flat shard:

    flat  = cat(TP-local tensor of each name in the unit) ++ padding     (FSDP, 04)
    shard = flat[r·S : (r+1)·S]                                          r = rank in the unit's dp × cp group
    TP-local tensor of `name` = box at offsets (i·local[dim] along dim) of the full tensor,
                                i = tp_rank // copies                    (05's TPShard)

so each name's overlap with [r·S, (r+1)·S) is a flat range of a TP box: one `Region`
(reshard.py). AdamW's exp_avg / exp_avg_sq are flat tensors shaped like the shard, sliced the
same way; its step counter is one scalar per flat shard, saved under each of its names.

    save_trainer_state(strategy, root, step)   every rank; after optimizer step `step` (1-based count)
    load_trainer_state(strategy, path)         every rank; returns the number of steps done
"""

from __future__ import annotations

import argparse
import os
import signal
import zlib
from dataclasses import asdict
from pathlib import Path

import torch

from common.cli import ConfigError, require
from common.data import ByteCorpus
from parallel3d.checkpoint.load import load_checkpoint, open_checkpoint, resolve_checkpoint
from parallel3d.checkpoint.reshard import Region
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
from parallel3d.recompute import unwrapped_name

DATA_KEYS = ("seed", "data", "global_batch", "seq_len")  # a resume must see the same batches
RESUME = ("never", "must", "auto")
CHECKPOINT_DEFAULTS = {"checkpoint_dir": None, "save_every": 0, "resume": "never", "keep": 2}


def param_slices(strategy) -> dict[str, ParamSlice]:
    """{reference name: ParamSlice of a flat shard} for every element this rank holds: FSDP's
    description of each piece (fsdp's shard_layout) placed in the full tensor by its TP box."""
    tp_rank = strategy.mesh3d.tp_rank
    out: dict[str, ParamSlice] = {}
    for unit in strategy.unit_shards:
        for p in unit.params:
            if not p.numel:
                continue
            ref = unwrapped_name(p.name)
            spec, local = strategy.tp_specs[ref], tuple(p.shape)
            offsets, full = [0] * len(local), list(local)
            if not spec.replicated:
                offsets[spec.dim] = (tp_rank // spec.copies) * local[spec.dim]
                full[spec.dim] = spec.full_size
            region = Region(tuple(full), tuple(offsets), local, p.offset, p.numel)
            out[ref] = ParamSlice(unit.flat_param, region, start=p.shard_offset)
    return out


def data_identity(args: argparse.Namespace) -> dict:
    """What the batch of step s depends on: DATA_KEYS and, for a byte corpus, the crc32 of its bytes
    (the default corpus is this repository's text: an edit between save and resume moves every
    window). Computed once per run (cached on `args`)."""
    if getattr(args, "data_identity", None) is None:
        ident = {k: getattr(args, k, None) for k in DATA_KEYS}
        if ident["data"] != "synthetic":
            corpus = ByteCorpus(args.seq_len, args.seed, args.data).data
            ident["corpus_crc32"] = zlib.crc32(corpus.to(torch.uint8).numpy().tobytes())
        args.data_identity = ident
    return args.data_identity


def data_mismatch(saved: dict, args: argparse.Namespace) -> str | None:
    """One line naming the first difference between a checkpoint's data identity and this run's."""
    now = data_identity(args)
    for k in DATA_KEYS:
        if saved.get(k) != now[k]:
            return (f"--{k.replace('_', '-')} {now[k]}: the checkpoint was trained with {saved.get(k)}; "
                    "resume with the same value (the batch order depends on it)")
    if saved.get("corpus_crc32") != now.get("corpus_crc32"):
        return (f"--data {args.data or '(this repository)'}: the corpus changed since the checkpoint "
                f"was saved (crc32 {saved.get('corpus_crc32')} != {now.get('corpus_crc32')}): the same "
                "steps would draw other batches; resume on the corpus it was trained on")
    return None


def trainer_config(cfg, optimizer: str) -> dict:
    """What a checkpoint must match to be loaded by this run: the architecture and optimizer."""
    return {"model": asdict(cfg), "optimizer": optimizer}


def save_trainer_state(strategy, root: str | Path, step: int, keep: int | None = None) -> Path:
    """Checkpoint `step` (optimizer steps done) under `root`; every rank calls it."""
    slices = param_slices(strategy)
    opt = strategy.optimizer
    args = strategy.args
    state = {"step": step, "data": data_identity(args),
             "scheduler": strategy.scheduler.state_dict() if strategy.scheduler is not None else None,
             "param_groups": param_groups_state(opt), "mesh": strategy.mesh,
             "dtype": args.dtype, "mixed_precision": args.mixed_precision}
    shards = {**model_shards(slices), **optimizer_shards(opt, slices)}
    return save_checkpoint(root, step, shards, state, config=trainer_config(strategy.cfg, args.optimizer),
                           rank_state=capture_rng_state(strategy.device), keep=keep)


def load_trainer_state(strategy, path: str | Path) -> int:
    """Load the checkpoint at `path` (root with `latest`, or a step directory), saved on any
    mesh, into this rank's shards, optimizer, schedule and RNG; returns the steps already done."""
    slices = param_slices(strategy)
    args = strategy.args
    if strategy.args.optimizer != "sgd":
        init_optimizer_state(strategy.optimizer)
    targets = {**model_shards(slices), **optimizer_shards(strategy.optimizer, slices)}
    loaded = load_checkpoint(path, targets, config=trainer_config(strategy.cfg, args.optimizer))
    state = loaded.state
    if (mismatch := data_mismatch(state["data"], args)) is not None:
        raise CheckpointError(f"{loaded.path}: {mismatch}")
    load_param_groups_state(strategy.optimizer, state["param_groups"])
    if strategy.scheduler is not None and state["scheduler"] is not None:
        strategy.scheduler.load_state_dict(state["scheduler"])
    if loaded.rank_state is not None:  # same world size: each rank gets its own generators back
        restore_rng_state(loaded.rank_state, strategy.device)
    return loaded.step


class ResumableStrategy:
    """Mixin of train.py's Parallel3DStrategy: `resume` at the end of __init__ (sets `start_step`:
    the loop runs range(start_step, --steps), and data.global_batch(step) makes the step the data
    position), `restore_rng_once` at the top of forward_backward, saves in `after_step`."""

    start_step: int = 0
    _rng_to_restore: dict | None = None

    def resume(self, path: str | Path | None) -> None:
        """Shards, AdamW state, LR schedule and RNG from the checkpoint at `path` (any mesh)."""
        if path is None:
            return
        self.start_step = load_trainer_state(self, path)
        # the loop reseeds every generator after build(): keep the checkpoint's for step 1
        self._rng_to_restore = capture_rng_state(self.device)

    def restore_rng_once(self) -> None:
        if self._rng_to_restore is not None:
            restore_rng_state(self._rng_to_restore, self.device)
            self._rng_to_restore = None

    def after_step(self, done: int) -> None:
        """Save every --save-every steps and after the last one (with --checkpoint-dir)."""
        kill_if_asked(done, self.mesh3d.rank, self.mesh3d.size)
        root = getattr(self.args, "checkpoint_dir", None)
        if root is not None and save_due(done, self.args.save_every, self.args.steps):
            save_trainer_state(self, root, done, keep=self.args.keep)


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


# --- the flags, for train.py ----------------------------------------------------------------

def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save sharded checkpoints here (DIR/step-N/, DIR/latest)")
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="save after every K steps and after the last (0: after the last only)")
    p.add_argument("--resume", nargs="?", const="must", default="never", choices=RESUME,
                   help="continue from DIR/latest, saved on any mesh (bare --resume: must exist; "
                        "auto: start fresh when DIR has no committed checkpoint, for torchrun restarts)")
    p.add_argument("--keep", type=int, default=2, metavar="N", help="checkpoints kept in DIR")


def validate_checkpoint_flags(args: argparse.Namespace, cfg) -> Path | None:
    """Before any collective, on every rank: the flags, and the checkpoint to resume from (found,
    complete, same model and data, not already past --steps). Returns its directory or None."""
    for flag, default in CHECKPOINT_DEFAULTS.items():  # namespaces built without the flags (tests)
        vars(args).setdefault(flag, default)
    resume = args.resume
    require(args.save_every >= 0, f"--save-every {args.save_every}: must be >= 0")
    require(args.keep >= 1, f"--keep {args.keep}: must be >= 1")
    require(args.save_every == 0 or args.checkpoint_dir is not None,
            f"--save-every {args.save_every} without --checkpoint-dir: name the directory to save in")
    require(resume == "never" or args.checkpoint_dir is not None,
            f"--resume {resume} without --checkpoint-dir: name the directory to resume from")
    require(resume == "never" or not args.check,
            "--check with --resume: the single-device reference trains from step 0; drop one")
    if args.checkpoint_dir is None:
        return None
    try:
        path = checkpoint_to_resume(args.checkpoint_dir, resume)
        if path is None:
            return None
        directory, meta = open_checkpoint(path, trainer_config(cfg, args.optimizer))
    except CheckpointError as e:
        raise ConfigError(f"--checkpoint-dir {args.checkpoint_dir} --resume: {e}") from None
    mismatch = data_mismatch((meta.get("state") or {}).get("data", {}), args)
    require(mismatch is None, f"{directory}: {mismatch}")
    require(meta["step"] < args.steps, f"--steps {args.steps}: {directory} is already at step "
            f"{meta['step']}; pass a larger --steps (the total) to train on")
    return directory
