"""The numerics page (01_data_parallel/numerics.md) says what the code does: its table of formats
is torch.finfo's, and its recipes are the dtypes the chapters train with."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.numerics import FORMATS, RECIPES, float_format, lost_updates, ulp
from common.run import COMPUTE_DTYPES

PAGE = Path(__file__).resolve().parent.parent / "01_data_parallel" / "numerics.md"
SUPERSCRIPT = str.maketrans("⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "-0123456789")


def power_of_two(cell: str) -> float:
    """'2⁻¹²⁶' → 2**-126."""
    return 2.0 ** int(cell.strip().removeprefix("2").translate(SUPERSCRIPT))


def format_rows() -> dict[str, list[str]]:
    rows = {}
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in FORMATS and len(cells) == 7:
            rows[cells[0]] = cells
    return rows


def test_the_pages_format_table_is_torch_finfo():
    rows = format_rows()
    assert list(rows) == list(FORMATS), f"the page's table lists {list(rows)}"
    for name, (_, dtype, bits, top, normal, subnormal, at_one) in rows.items():
        f = float_format(FORMATS[name])
        assert dtype == f"`{str(FORMATS[name]).removeprefix('torch.')}`"
        assert bits == f"{f['bits']} ({f['exponent_bits']}, {f['mantissa_bits']})", (name, bits)
        assert math.isclose(float(top), f["max"], rel_tol=5e-3), (name, top, f["max"])
        assert power_of_two(normal) == f["smallest_normal"], (name, normal)
        assert power_of_two(subnormal) == f["smallest_subnormal"], (name, subnormal)
        assert power_of_two(at_one) == f["eps"] == ulp(1.0, FORMATS[name]), (name, at_one)


def test_the_table_check_can_fail(monkeypatch):
    """Negative control: a format whose max were 2× torch's no longer matches the page."""
    import tests.test_numerics_page as me

    true = float_format
    monkeypatch.setattr(me, "float_format", lambda d: {**true(d), "max": 2 * true(d)["max"]})
    with pytest.raises(AssertionError):
        test_the_pages_format_table_is_torch_finfo()


def test_recipes_are_what_the_chapters_train_with():
    """--mixed-precision bf16/fp16: the Run's compute dtype, FSDP's MixedPrecision (param_dtype
    gathered, reduce_dtype reduced) and 07's are the recipe's."""
    from fsdp.train import MIXED
    from parallel3d.parallelize import Parallel3DConfig, mixed_precision

    for name in ("bf16", "fp16"):
        recipe = RECIPES[name]
        assert COMPUTE_DTYPES[name] == recipe.compute
        assert (MIXED[name].param_dtype, MIXED[name].reduce_dtype) == (recipe.gather, recipe.reduce)
    mp = mixed_precision(Parallel3DConfig(mixed_precision="bf16"))
    assert (mp.param_dtype, mp.reduce_dtype) == (RECIPES["bf16"].gather, RECIPES["bf16"].reduce)


def test_an_update_below_half_an_ulp_is_lost():
    """bf16 at 1.0: ulp 2⁻⁷; an update of 2⁻⁹ vanishes, one of 2⁻⁷ lands; fp32 keeps both."""
    theta = torch.ones(2)
    delta = torch.tensor([2.0**-9, 2.0**-7])
    assert lost_updates(theta, delta, torch.bfloat16).tolist() == [True, False]
    assert lost_updates(theta, delta, torch.float32).tolist() == [False, False]


def fp8_rows() -> dict[str, list[str]]:
    rows = {}
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in ("tensorwise", "rowwise", "blockwise") and len(cells) == 7:
            rows[cells[0]] = cells
    return rows


def fp8_table_cells(table: dict) -> dict[str, list[str]]:
    """The page's FP8 table as the code computes it (data_parallel.figures.fp8, the figure's data)."""
    pct = lambda v: f"{100 * v:.3g}%"  # noqa: E731
    return {r: [str(t["scales"]), pct(t["mean_rel_error"]), pct(t["subnormal_share"]),
                pct(t["mean_rel_error_high"]), pct(t["gemm_error"])] for r, t in table.items()}


@pytest.fixture(scope="module")
def fp8_table() -> dict:
    from data_parallel.figures.fp8 import fp8_data

    return fp8_data(factors=(1.0,))["table"]


def test_the_pages_fp8_table_is_computed(fp8_table):
    rows = fp8_rows()
    assert list(rows) == ["tensorwise", "rowwise", "blockwise"], f"the page's FP8 table lists {list(rows)}"
    want = fp8_table_cells(fp8_table)
    for name, cells in rows.items():
        assert cells[2:] == want[name], f"{name}: the page says {cells[2:]}, the code gives {want[name]}"


def test_the_fp8_table_check_can_fail(fp8_table):
    """Negative control: blockwise's error 1% larger no longer matches the page."""
    off = {**fp8_table, "blockwise": {**fp8_table["blockwise"],
                                      "mean_rel_error": 1.01 * fp8_table["blockwise"]["mean_rel_error"]}}
    assert fp8_table_cells(off)["blockwise"] != fp8_rows()["blockwise"][2:]


def test_the_pages_fp8_formats_and_byte_ratios():
    """The prose's numbers: e4m3's count of positive values, and the dispatch's (d + 4d/128)/2d."""
    from data_parallel.figures.fp8 import fp8_grid

    text = " ".join(PAGE.read_text(encoding="utf-8").split())
    assert f"({len(fp8_grid('e4m3'))} positive values)" in text
    ratio = (1 + 4 / 128) / 2
    assert f"{100 * ratio:.1f}%" in text and f"{100 * 4 / 128:.0f}% more" in text
