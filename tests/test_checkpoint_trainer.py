"""Chapter 07 checkpoints in the 3D trainer: a float64 run saved at step k on one dp × pp × tp
mesh and resumed on another ends where the uninterrupted run ends (bitwise on the same mesh),
with the data order, the warm-up + cosine schedule and AdamW's state carried over
(parallel3d.checkpoint.trainer)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from common.cli import ConfigError
from common.data import SyntheticTokens
from common.dist import init_distributed
from common.kernel.model import LlamaConfig
from common.training import build_and_train, rank_micro_batches
from parallel3d import train as train3d
from parallel3d import train_checkpoint_flags as checkpoint_flags
from parallel3d.checkpoint.load import read_full
from parallel3d.checkpoint.save import CheckpointError
from parallel3d.checkpoint.trainer import (
    TrainerState,
    checkpoint_to_resume,
    data_mismatch,
    load_trainer_state,
    save_trainer_state,
    trainer_config,
)
from parallel3d.lr_schedule import warmup_cosine_scheduler
from tests.equivalence import TrainSpec, spec_args
from tests.forked import run_forked
from tests.harness import RankError

CFG = LlamaConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=32, multiple_of=8)
TOTAL, SAVED_AT = 3, 1


def make_args(mesh, steps: int = TOTAL, **checkpoint_flags):
    dp, pp, tp = mesh
    spec = TrainSpec(cfg=CFG, world_size=dp * pp * tp, dp=dp, global_batch=4, micro_batch=1,
                     seq_len=4, steps=steps, clip_grad=1e-2)
    flags = {"checkpoint_dir": None, "save_every": 0, "resume": "never", "keep": 2, **checkpoint_flags}
    return spec_args(spec, dp=dp, pp=pp, tp=tp, schedule="1f1b", microbatches=None,
                     virtual_stages=None, sequence_parallel=False, activation_checkpointing="none",
                     sharding_strategy="FULL_SHARD", lr_schedule="cosine", warmup_steps=1,
                     min_lr_ratio=0.1, **flags)


def build(mesh, steps: int = TOTAL):
    args = make_args(mesh, steps)
    config = train3d.validate(args, math.prod(mesh))
    return train3d.Parallel3DStrategy(config, init_distributed()), config, args


def identity(args) -> dict:
    """What save_trainer_state / load_trainer_state check a checkpoint against."""
    return {"data": checkpoint_flags.data_identity(args), "config": trainer_config(CFG, args.optimizer)}


def train(strategy, config, args, start: int, stop: int) -> None:
    data = SyntheticTokens(CFG.vocab_size, args.seq_len, args.seed)
    for step in range(start, stop):
        tokens = data.global_batch(step, args.global_batch)
        strategy.forward_backward(rank_micro_batches(strategy, tokens, config.micro_batch, strategy.device))
        strategy.step()
        strategy.zero_grad()


def trainer_state(strategy) -> TrainerState:
    """What the checkpoint glue takes: the shards, the optimizer, the scheduler, the device."""
    return TrainerState(strategy.shards, strategy.optimizer, strategy.scheduler, strategy.device)


def uninterrupted_and_save(root: str, mesh) -> dict | None:
    """Train TOTAL steps on `mesh`, saving after SAVED_AT; the final full parameters (rank 0)."""
    strategy, config, args = build(mesh)
    train(strategy, config, args, 0, SAVED_AT)
    save_trainer_state(trainer_state(strategy), root, SAVED_AT, **identity(args))
    train(strategy, config, args, SAVED_AT, TOTAL)
    return strategy.full_parameters()


def resumed(root: str, mesh) -> dict | None:
    strategy, config, args = build(mesh)
    start = load_trainer_state(trainer_state(strategy), root, **identity(args))
    train(strategy, config, args, start, TOTAL)
    return strategy.full_parameters()


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)


ONE_RANK_ENV = {0: {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": "0", "PFS_BACKEND": "gloo"}}


def resumed_on_one_rank(rank: int, root: str, expected: dict) -> None:
    """In a forked 1-rank job (cheaper than a pool of one): resume on dp1 × pp1 × tp1, compare."""
    assert max_rel_diff(resumed(root, (1, 1, 1)), expected) <= 1e-10


@pytest.mark.parametrize("resume_mesh", [(1, 2, 2), (2, 1, 2), (4, 1, 1), (1, 1, 1)])
def test_resume_on_any_mesh_continues_like_the_uninterrupted_run(pools, tmp_path, resume_mesh):
    save_mesh = (1, 2, 2)
    expected = pools.run(4, uninterrupted_and_save, str(tmp_path), save_mesh)[0]
    if resume_mesh == (1, 1, 1):
        assert run_forked(1, resumed_on_one_rank, str(tmp_path), expected, env=ONE_RANK_ENV) == [0]
        return
    got = pools.run(4, resumed, str(tmp_path), resume_mesh)[0]
    diff = max_rel_diff(got, expected)
    if resume_mesh == save_mesh:
        assert diff == 0.0  # bitwise: same mesh, same summation order
    assert diff <= 1e-10, (resume_mesh, diff)


def resumed_without_optimizer_state(root: str, mesh) -> dict | None:
    """The broken variant: weights restored, AdamW's moments and step count left fresh."""
    strategy, config, args = build(mesh)
    start = load_trainer_state(trainer_state(strategy), root, **identity(args))
    strategy.optimizer.state.clear()
    train(strategy, config, args, start, TOTAL)
    return strategy.full_parameters()


def test_resume_that_drops_the_optimizer_state_is_caught(pools, tmp_path):
    expected = pools.run(4, uninterrupted_and_save, str(tmp_path), (1, 2, 2))[0]
    got = pools.run(4, resumed_without_optimizer_state, str(tmp_path), (2, 1, 2))[0]
    assert max_rel_diff(got, expected) > 1e-3


OTHER = LlamaConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=32, multiple_of=8)


def resume_other_model(rank: int, root: str) -> None:
    global CFG
    CFG = OTHER
    with pytest.raises(CheckpointError, match=r"checkpoint of another model config \(saved != this "
                                              r"run: model.n_kv_heads 2 != 4\)"):
        resumed(root, (1, 1, 1))


def test_an_edited_corpus_is_a_mismatch(tmp_path):
    """A byte corpus is named by its path, so its bytes are checksummed too: the default corpus is
    this repository's text, and an edit between save and resume moves every window."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"abcdefgh" * 64)
    args = make_args((1, 1, 1))
    args.data = str(corpus)
    saved = checkpoint_flags.data_identity(args)
    assert data_mismatch(saved, checkpoint_flags.data_identity(args)) is None
    corpus.write_bytes(b"abcdefgX" * 64)
    changed = data_mismatch(saved, checkpoint_flags.data_identity(args))
    assert "the corpus changed since the checkpoint was saved" in changed


def test_resume_rules_and_a_checkpoint_of_another_model(pools, tmp_path):
    assert checkpoint_to_resume(tmp_path / "new", "auto") is None  # first launch: start fresh
    (tmp_path / "crashed" / "step-00000001.tmp").mkdir(parents=True)
    assert checkpoint_to_resume(tmp_path / "crashed", "auto") is None  # nothing was committed
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_to_resume(tmp_path / "new", "must")
    pools.run(4, uninterrupted_and_save, str(tmp_path / "ck"), (1, 2, 2))
    assert checkpoint_to_resume(tmp_path / "ck", "auto") == tmp_path / "ck" / "step-00000001"
    assert run_forked(1, resume_other_model, str(tmp_path / "ck"), env=ONE_RANK_ENV) == [0]

    # the same checks as flags, before any collective (what train.py's validate would call)
    ck = str(tmp_path / "ck")
    assert checkpoint_flags.validate_checkpoint_flags(make_args((1, 1, 1), checkpoint_dir=ck, resume="must"),
                                             CFG).resume_from == tmp_path / "ck" / "step-00000001"
    bad = [({"checkpoint_dir": None, "resume": "must"}, {}, r"--resume must without --checkpoint-dir"),
           ({"checkpoint_dir": None, "save_every": 2}, {}, r"--save-every 2 without --checkpoint-dir"),
           ({"checkpoint_dir": str(tmp_path / "new"), "resume": "must"}, {},
            r"--resume: checkpoint directory .*new does not exist"),
           ({"checkpoint_dir": ck, "resume": "auto"}, {"seed": 7}, r"--seed 7: .* was trained with 0"),
           ({"checkpoint_dir": ck, "resume": "must"}, {"steps": 1}, r"--steps 1: .* already at step 1"),
           ({"checkpoint_dir": ck, "resume": "must"}, {"cfg": OTHER}, r"another model config"),
           ({"checkpoint_dir": ck, "resume": "must"}, {"check": True}, r"--check with --resume")]
    for flags, override, message in bad:
        args = make_args((1, 1, 1), **flags)
        vars(args).update(override)
        with pytest.raises(ConfigError, match=message):
            checkpoint_flags.validate_checkpoint_flags(args, override.get("cfg", CFG))


# --- the CLI: train.py's flags, the loop's start_step and after_step ---------------------------

CLI = ["--dp", "1", "--pp", "2", "--tp", "2", "--model", "tiny", "--dtype", "float64", "--data",
       "synthetic", "--seq-len", "8", "--global-batch", "4", "--clip-grad", "0.01", "--log-every", "0"]


class ForgetsTheSchedule(train3d.Parallel3DStrategy):
    """The broken variant: resumes weights and AdamW state but starts a fresh LR schedule."""

    def __init__(self, run, ctx):
        super().__init__(run, ctx)  # resumes
        fresh = warmup_cosine_scheduler(self.optimizer, run.steps, max(1, run.steps // 10),
                                        run.options.min_lr_ratio)
        self.scheduler = self.checkpoints.state.scheduler = fresh


def train_cli(argv: list[str], broken: bool = False) -> dict:
    """train.py's path in the rank pool: parse_args, validate, common.training.build_and_train."""
    run = train3d.validate(train3d.parse_args(argv), dist.get_world_size())
    return build_and_train(run, init_distributed(), ForgetsTheSchedule if broken else train3d.build, 7)


def interrupted_at(src: Path, step: int, dst: Path) -> Path:
    """What a crash right after `step`'s save leaves: that checkpoint, committed by `latest`."""
    name = f"step-{step:08d}"
    shutil.copytree(src / name, dst / name)
    (dst / "latest").write_text(name + "\n")
    return dst


def test_cli_run_saved_at_step_2_and_resumed_ends_bitwise_equal(pools, tmp_path):
    """`train.py --steps 4 --checkpoint-dir A --save-every 2`, and the same command with --resume
    from A's step 2: the same losses for steps 3-4 and the same final checkpoint, bit for bit
    (weights, AdamW's moments and step counts, the LR schedule's position)."""
    whole, part, broken = tmp_path / "whole", tmp_path / "part", tmp_path / "broken"
    flags = [*CLI, "--steps", "4", "--save-every", "2"]
    full = pools.run(4, train_cli, [*flags, "--checkpoint-dir", str(whole)])[0]
    assert sorted(p.name for p in whole.iterdir()) == ["latest", "step-00000002", "step-00000004"]
    interrupted_at(whole, 2, part)
    resumed_report = pools.run(4, train_cli, [*flags, "--checkpoint-dir", str(part), "--resume"])[0]
    assert resumed_report["steps"] == 2 and resumed_report["losses"] == full["losses"][2:]
    expected, meta_expected = read_full(whole)
    got, meta = read_full(part)
    assert meta["step"] == meta_expected["step"] == 4
    assert meta["state"]["scheduler"] == meta_expected["state"]["scheduler"]
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected), \
        [n for n in expected if not torch.equal(got[n], expected[n])]

    # the negative control: the same resume with a fresh LR schedule misses
    interrupted_at(whole, 2, broken)
    pools.run(4, train_cli, [*flags, "--checkpoint-dir", str(broken), "--resume"], True)
    wrong, _ = read_full(broken, names=[n for n in expected if not n.startswith("optim")])
    assert max_rel_diff(wrong, {n: expected[n] for n in wrong}) > 1e-6


def validate_cli(argv: list[str]):
    fail = mock.Mock(side_effect=AssertionError("entered a collective"))
    with mock.patch.multiple(dist, all_gather_object=fail, broadcast_object_list=fail, barrier=fail,
                             all_reduce=fail, broadcast=fail, new_group=fail):
        return train3d.validate(train3d.parse_args(argv), dist.get_world_size())


@pytest.mark.parametrize("case, message", [
    ("check", r"--check with --resume: the single-device reference trains from step 0"),
    ("partial", r"--resume: .*step-00000002 is partial: it has no metadata.json"),
])
def test_bad_resume_fails_on_every_rank_before_any_collective(pools, tmp_path, case, message):
    argv = [*CLI, "--steps", "4", "--checkpoint-dir", str(tmp_path), "--resume", "auto"]
    if case == "check":
        argv += ["--check", "--lr-schedule", "constant"]
    else:  # `latest` names a step directory whose metadata is gone
        (tmp_path / "step-00000002").mkdir()
        (tmp_path / "latest").write_text("step-00000002\n")
    with pytest.raises(RankError, match=message) as info:
        pools.run(4, validate_cli, argv)
    assert sorted(info.value.errors) == list(range(4))


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_torchrun_restarts_after_a_rank_is_killed_and_ends_like_the_uninterrupted_run(pools, tmp_path):
    """The issue's fault tolerance: under `torchrun --max-restarts 1`, the last rank SIGKILLs itself
    after step 4 (before that step's save; PFS_KILL_AT_STEP, first launch only); torchrun restarts
    both ranks (pp 2) with the same command, `--resume auto` finds step 2, and the job trains steps
    3-6. Its final checkpoint equals an uninterrupted run's, bit for bit. (The one test that needs
    torchrun itself: its restart; two ranks, since each attempt pays ~2.5 s per rank to import torch.)"""
    flags = [*CLI[:4], "--tp", "1", *CLI[6:], "--steps", "6", "--save-every", "2"]
    root, report = tmp_path / "ckpt", tmp_path / "report.json"
    # torchrun (2.5+) shares its rendezvous TCPStore with the workers; a restarted gloo job then
    # reads the dead attempt's addresses from it and fails to connect (pytorch/pytorch#135712)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PFS_KILL_AT_STEP": "4",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", "07_3d/train.py", *flags, "--checkpoint-dir", str(root),
         "--resume", "auto", "--report", str(report)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=180)
    finally:  # a hung job: take torchrun and its workers down, not just torchrun
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    assert "exitcode: -9" in stderr  # the first attempt lost a rank to SIGKILL
    ran = json.loads(report.read_text())
    assert ran["steps"] == 4 and len(ran["losses"]) == 4  # the restart resumed from step 2
    uninterrupted = tmp_path / "uninterrupted"
    full = pools.run(2, train_cli, [*flags, "--checkpoint-dir", str(uninterrupted)])[0]
    assert ran["losses"] == full["losses"][2:]
    expected, meta_expected = read_full(uninterrupted)
    got, meta = read_full(root)
    assert meta["step"] == meta_expected["step"] == 6 and expected.keys() == got.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected), \
        [n for n in expected if not torch.equal(got[n], expected[n])]
