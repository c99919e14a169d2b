"""Chapter 03's lesson prints the code's numbers: the paper's per-stage table
(zero.accounting.paper_table) and the lab model's padding (zero.flat.padded_size)."""

from __future__ import annotations

import re

import pytest

from common.figures import ROOT
from common.kernel.model import build_model, count_parameters, get_config
from zero.accounting import paper_table
from zero.flat import padded_size

CHAPTER = "03_zero"


def row(text: str, first_cell: str) -> list[str]:
    """The cells after the first of the table row that starts with `first_cell`."""
    line = next(line for line in text.splitlines() if line.startswith(f"| {first_cell} |"))
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def number(cell: str) -> float:
    return float(re.sub(r"[^0-9.]", "", cell))


def test_zero_paper_table_is_paper_table():
    text = (ROOT / "03_zero/README.md").read_text()
    for stage, first in enumerate(("0 (plain DP)", "1", "2", "3")):
        cells = row(text, first)
        want = paper_table(7e9, 8)[stage]
        got = [number(c) for c in cells[1:]]
        assert got == pytest.approx([want["params"], want["grads"], want["optimizer"], want["total"]],
                                    abs=0.005), (first, cells)


def test_zero_lab_padding_is_computed():
    """The lab's model (lab_check: tiny with 2 blocks) on 3 ranks: s = ⌈Ψ/3⌉ and its padding."""
    psi = count_parameters(build_model(get_config("tiny", n_layers=2), device="meta"))
    s, pad = padded_size(psi, 3) // 3, padded_size(psi, 3) - psi
    text = " ".join((ROOT / "03_zero/README.md").read_text().split())
    assert f"Ψ = {psi:,}, float64; on 3 ranks s = {s:,} and {pad} elements of padding" in text, (psi, s, pad)

