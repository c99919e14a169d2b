"""Chapter 07 demo's checkpoint flags: where to save, how often, how many to keep, and the
checkpoint to resume from, checked on every rank before any collective (checkpoint/trainer.py
saves and loads; a checkpoint resumes only with the same model, optimizer and data).

    make run-7 ARGS="--steps 40 --checkpoint-dir ckpt --save-every 5"          (checkpoint/README.md)
    make run-7 NPROC=4 ARGS="--dp 2 --pp 1 --tp 2 --steps 40 --checkpoint-dir ckpt --resume"
"""

from __future__ import annotations

import argparse
import zlib

import torch

from common.cli import ConfigError, require
from common.data import ByteCorpus
from parallel3d.checkpoint.load import open_checkpoint
from parallel3d.checkpoint.save import CheckpointError
from parallel3d.checkpoint.trainer import (
    DATA_KEYS,
    RESUME,
    CheckpointPlan,
    checkpoint_to_resume,
    data_mismatch,
    trainer_config,
)


def data_identity(args: argparse.Namespace) -> dict:
    """What the batch of step s depends on: DATA_KEYS and, for a byte corpus, the crc32 of its
    bytes (the default corpus is this repository's text: an edit between save and resume moves
    every window)."""
    ident = {k: getattr(args, k, None) for k in DATA_KEYS}
    if ident["data"] != "synthetic":
        corpus = ByteCorpus(args.seq_len, args.seed, args.data).data
        ident["corpus_crc32"] = zlib.crc32(corpus.to(torch.uint8).numpy().tobytes())
    return ident


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save sharded checkpoints here (DIR/step-N/, DIR/latest)")
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="save after every K steps and after the last (0: after the last only)")
    p.add_argument("--resume", nargs="?", const="must", default="never", choices=RESUME,
                   help="continue from DIR/latest, saved on any mesh (bare --resume: must exist; "
                        "auto: start fresh when DIR has no committed checkpoint, for torchrun restarts)")
    p.add_argument("--keep", type=int, default=2, metavar="N", help="checkpoints kept in DIR")


def validate_checkpoint_flags(args: argparse.Namespace, cfg) -> CheckpointPlan:
    """Before any collective, on every rank: the flags, and the checkpoint to resume from (found,
    complete, same model and data, not already past --steps). Namespaces built without the flags
    (tests) mean no checkpoints."""
    directory = getattr(args, "checkpoint_dir", None)
    save_every, keep = getattr(args, "save_every", 0), getattr(args, "keep", 2)
    resume = getattr(args, "resume", "never")
    require(save_every >= 0, f"--save-every {save_every}: must be >= 0")
    require(keep >= 1, f"--keep {keep}: must be >= 1")
    require(save_every == 0 or directory is not None,
            f"--save-every {save_every} without --checkpoint-dir: name the directory to save in")
    require(resume == "never" or directory is not None,
            f"--resume {resume} without --checkpoint-dir: name the directory to resume from")
    require(resume == "never" or not args.check,
            "--check with --resume: the single-device reference trains from step 0; drop one")
    if directory is None:
        return CheckpointPlan(None, save_every, keep)
    data, config = data_identity(args), trainer_config(cfg, args.optimizer)
    try:
        path = checkpoint_to_resume(directory, resume)
        if path is None:
            return CheckpointPlan(directory, save_every, keep, None, data, config)
        found, meta = open_checkpoint(path, config)
    except CheckpointError as e:
        raise ConfigError(f"--checkpoint-dir {directory} --resume: {e}") from None
    mismatch = data_mismatch((meta.get("state") or {}).get("data", {}), data)
    require(mismatch is None, f"{found}: {mismatch}")
    require(meta["step"] < args.steps, f"--steps {args.steps}: {found} is already at step "
            f"{meta['step']}; pass a larger --steps (the total) to train on")
    return CheckpointPlan(directory, save_every, keep, found, data, config)
