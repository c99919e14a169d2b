"""`make gpu-check` has no GPU in CI, so its pieces are exercised here on CPU with tiny sizes."""

from __future__ import annotations

import pytest
import torch

from common.gpu_check import REPO_ROOT, flops_per_token, peak_tflops, run_chapter, throughput
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
    assert row["ok"] and row["max_param_diff"] <= 1e-10 and row["comm_ratio"] == pytest.approx(1.0)
