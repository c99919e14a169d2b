"""Chapter 04's lesson prints the code's numbers: HSDP's network cut (fsdp.formulas.network_bytes,
through test_fsdp_hybrid's `network_cut`)."""

from __future__ import annotations

from common.figures import ROOT
from tests.test_fsdp_hybrid import network_cut

CHAPTER = "04_fsdp"


def row(text: str, first_cell: str) -> list[str]:
    """The cells after the first of the table row that starts with `first_cell`."""
    line = next(line for line in text.splitlines() if line.startswith(f"| {first_cell} |"))
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def test_hsdp_page_quotes_network_bytes():
    text = (ROOT / "04_fsdp/hsdp.md").read_text()
    header = row(text, "FULL_SHARD ÷ HSDP, bytes leaving a node per step")
    nodes = [int(c.removeprefix("r = ")) for c in header]
    for first, kw in (("one micro-batch, b_p = b_r", {}),
                      ("the article's MixedPrecision: bf16 gathers, fp32 reduction", {"b_p": 2}),
                      ("4 micro-batches under `no_sync`, b_p = b_r", {"micro_batches": 4})):
        assert row(text, first) == [f"{network_cut(8, r, **kw):.2f}×" for r in nodes], first

