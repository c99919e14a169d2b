"""Numbers the lessons state, held against the code that computes them: a page that quotes a figure
must say what the code says today (a formula that moves makes the page's number go red here)."""

from __future__ import annotations

import math
import re

from common.chapters import ROOT
from common.kernel.model import get_config
from tensor_parallel.formulas import Shape, layer_activation_bytes


def page(path: str) -> str:
    return " ".join((ROOT / path).read_text(encoding="utf-8").split())


def quoted(path: str, pattern: str) -> float:
    match = re.search(pattern, page(path))
    assert match, f"{path} no longer says {pattern!r}: update this test with the page"
    return float(match.group(1))


def test_context_parallel_page_quotes_the_405b_block_at_128k() -> None:
    """05's CP page: one 405B block at 128K tokens, t = 8 with SP, bf16 (notebook (f))."""
    c = get_config("llama3.1-405b")
    x = Shape(1, 131072, c.dim, c.n_heads, c.n_kv_heads, c.hidden_dim, 1, c.vocab_size, c.head_dim,
              8, True, 2)
    gb = layer_activation_bytes(x) / 1e9
    said = quoted("05_tensor_parallel/context_parallel.md",
                  r"405B at 128K tokens saves about ([\d.]+) GB per GPU at t = 8 with SP")
    assert abs(said - gb) <= 0.05, f"the page says {said} GB, formulas.py gives {gb:.2f} GB"



def test_overlap_page_table_is_overlap_tokens() -> None:
    """01's overlap page: every row's tokens and ρ from `overlap_tokens` (8 ranks, F half an H100's
    989 TFLOP/s, t = 16,384 tokens per rank)."""
    from data_parallel.train import overlap_tokens

    rows = re.findall(r"^\| ([^|]+), ([\d.×\s]+) GB/s \| [^|]*\(b = (\d)\) \| ([\d,]+) \| ([\d.]+) \|$",
                      (ROOT / "01_data_parallel/overlap.md").read_text(encoding="utf-8"), re.M)
    assert len(rows) == 5, rows
    for where, bandwidth, b, tokens, rho in rows:
        busbw = math.prod(float(x) for x in bandwidth.split("×")) * 1e9  # "8 × 45" → 360e9
        need = overlap_tokens(8, int(b), 989e12 / 2, busbw)
        assert int(tokens.replace(",", "")) == round(need), (where, b, need)
        assert float(rho) == round(need / 16_384, 2), (where, b, need / 16_384)
