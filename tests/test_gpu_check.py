"""`make gpu-check` has no GPU in CI, so its pieces are exercised here on CPU with tiny sizes."""

from __future__ import annotations

import importlib

import pytest
import torch

from common.gpu_check import (
    PRECISIONS,
    REPO_ROOT,
    chapter_dirs,
    chapter_flags,
    flops_per_token,
    main,
    peak_tflops,
    run_chapter,
    throughput,
)
from common.model import get_config


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


PACKAGES = {"01_data_parallel": "data_parallel", "02_ring_allreduce": "ring_allreduce", "03_zero": "zero",
            "04_fsdp": "fsdp", "05_tensor_parallel": "tensor_parallel", "06_pipeline": "pipeline",
            "07_3d": "parallel3d"}


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_every_chapter_accepts_the_gpu_check_command_line(gpus):
    """The CUDA branch cannot run here, so its command lines are validated by each chapter's own
    parse_args + validate (what every rank runs before init) for 1, 2, 4 and 8 GPUs."""
    chapters = chapter_dirs()
    assert {c.name for c in chapters} <= PACKAGES.keys()
    for chapter in chapters:
        train = importlib.import_module(f"{PACKAGES[chapter.name]}.train")
        for flags in PRECISIONS.values():
            argv = ["--model", "small", "--steps", "5", "--global-batch", str(8 * gpus), *flags,
                    *chapter_flags(chapter.name, gpus)]
            train.validate(train.parse_args(argv), gpus)


def test_without_cuda_it_says_so_in_one_line_and_fails(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the branch under test is the CPU-only one")
    assert main([]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "nothing was checked" in out[0]
