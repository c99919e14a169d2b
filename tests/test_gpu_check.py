"""`make gpu-check` has no GPU in CI, so its pieces are exercised here on CPU with tiny sizes."""

from __future__ import annotations

import importlib

import pytest
import torch

from common.chapters import CHAPTERS
from common.gpu_check import (
    CHECKS,
    REPO_ROOT,
    chapter_dirs,
    flops_per_token,
    main,
    peak_tflops,
    row_argv,
    run_chapter,
    throughput,
)
from common.kernel.model import get_config


def test_throughput_and_flop_count_on_cpu():
    cfg = get_config("tiny", n_layers=2)
    result = throughput(cfg, torch.device("cpu"), batch=2, seq_len=8, steps=1, warmup=1,
                        dtype=torch.float32)
    assert result["tokens_per_s"] > 0
    non_embedding = result["params"] - cfg.vocab_size * cfg.dim
    assert flops_per_token(cfg, result["params"], 8) == 6 * non_embedding + 12 * 2 * cfg.dim * 8
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("mystery") is None


@pytest.mark.slow
def test_run_chapter_reports_a_passing_check():
    row = run_chapter(REPO_ROOT / "01_data_parallel", 2,
                      ["--model", "tiny", "--steps", "2", "--dtype", "float64"])
    assert row["ok"] and row["max_grad_diff"] <= 1e-10 and row["comm_ratio"] == pytest.approx(1.0)
    assert row["precision"] == "float64" and row["cuda_peak"] is None


PACKAGES = {c.folder: c.package for c in CHAPTERS}


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_every_row_accepts_its_gpu_check_command_line(gpus):
    """The CUDA branch cannot run here, so each row's command line is validated by its chapter's
    own parse_args + validate (what every rank runs before init) on the ranks the row would use,
    for 1, 2, 3, 4 and 8 GPUs; a row that needs more GPUs is skipped there, and says so."""
    for check in CHECKS:
        if gpus < check.min_gpus:
            continue
        train = importlib.import_module(f"{PACKAGES[check.chapter]}.train")
        ranks = check.ranks(gpus)
        assert 1 <= ranks <= gpus
        for precision in check.precisions:
            train.validate(train.parse_args(row_argv(check, precision, ranks)), ranks)


def test_the_rows_cover_every_chapter_schedule_offload_and_prefetch():
    from pipeline.schedules import SCHEDULES

    assert {c.name for c in chapter_dirs()} == {c.chapter for c in CHECKS} <= PACKAGES.keys()
    argvs = {c.label: row_argv(c, "float32", c.ranks(8)) for c in CHECKS}
    pipeline = {a[a.index("--schedule") + 1] for label, a in argvs.items() if label.startswith("06")}
    assert pipeline == set(SCHEDULES)
    assert "--offload" in argvs["03 ZeRO-3 offload"] and "--no-prefetch" not in argvs["04 FSDP"]
    assert all(c.checked for c in CHECKS) and len({c.label for c in CHECKS}) == len(CHECKS)


def test_the_table_says_what_each_row_checked_and_why_one_was_skipped(capsys):
    from common.gpu_check import print_table

    rows = [{"label": "06 PP GPipe", "precision": "float32", "checked": "GPipe schedule",
             "skipped": "needs 2 GPUs"},
            {"label": "01 DDP", "precision": "float32", "checked": "bucketed all-reduce", "ok": True,
             "world": 1, "max_grad_diff": 0.0, "tolerance": 1e-5, "comm_ratio": None,
             "tokens_per_s": 10.0, "cuda_peak": 2**20, "state_formula": 2**20, "seconds": 1.0}]
    print_table(rows, 1)
    out = capsys.readouterr().out
    assert "skipped: needs 2 GPUs  (GPipe schedule)" in out and "bucketed all-reduce" in out


def test_without_cuda_it_says_so_in_one_line_and_fails(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the branch under test is the CPU-only one")
    assert main([]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "nothing was checked" in out[0]
