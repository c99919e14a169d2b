"""The numerics page's FP8 figure: the error of each scaling recipe (common/kernel/fp8.py) on
activations with outlier channels, as the outliers grow, and the values e4m3 and e5m2 hold.

The activations: x [tokens, channels] standard normal, `outliers` channels times `factor` (a few
channels of a transformer's hidden state are that much larger than the rest). What a recipe costs
is measured on the ordinary channels, whose precision the outliers' scale takes away: the mean
of |x̂ − x| / |x| there, and the share of them that x·s puts below e4m3's smallest normal (2⁻⁶:
fewer than 3 mantissa bits left). Blockwise scaling keeps the outliers' scale in their own tiles.
"""

from __future__ import annotations

import math

import torch

from common.figures import Figure, Source, draw
from common.kernel.fp8 import E4M3, E5M2, RECIPES, TILE, Quantized, block_shape, quantize

FACTORS = (1.0, 10.0, 100.0, 1e3, 1e4, 1e5)
CURVES = (*((r, "e4m3") for r in RECIPES), ("tensorwise", "e5m2"))
DTYPES = {"e4m3": E4M3, "e5m2": E5M2}


def outlier_activations(tokens: int = 64, channels: int = 1024, outliers: int = 4, factor: float = 100.0,
                        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, ordinary): x standard normal with `outliers` channels × factor; `ordinary` marks the rest."""
    # drawn in float64: float32 randn differs by CPU kernel (avx2, default)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=g, dtype=torch.float64).float()
    hot = torch.randperm(channels, generator=g)[:outliers]
    x[:, hot] *= factor
    ordinary = torch.ones(channels, dtype=torch.bool)
    ordinary[hot] = False
    return x, ordinary


def recipe_error(x: torch.Tensor, ordinary: torch.Tensor, recipe: str, fmt: str = "e4m3",
                 tile: int = TILE) -> dict:
    """One recipe on x: the mean relative error of the ordinary channels, the share of them below
    the format's smallest normal after scaling, and how many scales the recipe keeps."""
    q: Quantized = quantize(x, block_shape(recipe, tuple(x.shape), "activation", tile), DTYPES[fmt])
    xo, err = x[:, ordinary], (q.dequantize() - x)[:, ordinary]
    scaled = (q.data.float().abs())[:, ordinary]
    # the means in float64: no machine's order of summation shows in the figure's 9 digits
    return {"mean_rel_error": float((err.abs() / xo.abs()).double().mean()),
            "subnormal_share": float((scaled < torch.finfo(DTYPES[fmt]).smallest_normal).double().mean()),
            "scales": q.scale.numel()}


def gemm_error(x: torch.Tensor, recipe: str, out_features: int = 256, tile: int = TILE,
               seed: int = 1) -> float:
    """‖x̂ŵᵀ − xwᵀ‖ / ‖xwᵀ‖ for a weight w ~ 0.02·N(0, 1) quantized by the same recipe."""
    w = 0.02 * torch.randn(out_features, x.shape[1], generator=torch.Generator().manual_seed(seed),
                           dtype=torch.float64).float()
    qx = quantize(x, block_shape(recipe, tuple(x.shape), "activation", tile))
    qw = quantize(w, block_shape(recipe, tuple(w.shape), "weight", tile))
    y = x.double() @ w.double().T
    return float((qx.dequantize(torch.float64) @ qw.dequantize(torch.float64).T - y).norm() / y.norm())


def fp8_grid(fmt: str) -> list[float]:
    """Every positive finite value of the format: its 256 bit patterns read as floats."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(DTYPES[fmt]).double()
    return sorted({float(v) for v in values if math.isfinite(v) and v > 0})


def fp8_data(factors: tuple[float, ...] = FACTORS, table_factors: tuple[float, float] = (100.0, 1e4),
             tokens: int = 64, channels: int = 1024, outliers: int = 4, tile: int = TILE) -> dict:
    """Per curve (recipe, format) the mean relative error of the ordinary channels at each outlier
    factor; the page's table (e4m3, at `table_factors`); each format's grid of values."""
    sweep = {f"{r} {fmt}": [recipe_error(*outlier_activations(tokens, channels, outliers, f), r, fmt, tile)
                            ["mean_rel_error"] for f in factors] for r, fmt in CURVES}
    table = {}
    for r in RECIPES:
        low, high = (outlier_activations(tokens, channels, outliers, f) for f in table_factors)
        at_low = recipe_error(*low, r, "e4m3", tile)
        table[r] = {**at_low, "mean_rel_error_high": recipe_error(*high, r, "e4m3", tile)["mean_rel_error"],
                    "gemm_error": gemm_error(low[0], r, tile=tile)}
    return {"factors": list(factors), "sweep": sweep, "table": table, "table_factors": list(table_factors),
            "shape": [tokens, channels], "outliers": outliers, "tile": tile,
            "grids": {fmt: [math.log2(v) for v in fp8_grid(fmt)] for fmt in DTYPES}}


def fp8_draw(data: dict):
    fig, (left, right) = draw.figure(height=3.4, ncols=2, nrows=1, gridspec_kw={"width_ratios": [1.3, 1]})
    for i, (name, errors) in enumerate(data["sweep"].items()):
        left.plot(data["factors"], [100 * e for e in errors], "o--" if "e5m2" in name else "o-",
                  color=draw.rank_color(i), label=name, ms=3.5)
    left.set(xscale="log", yscale="log", xlabel="outlier channels' factor",
             ylabel="mean |x̂ − x| / |x| of the other channels, %")
    left.set_yticks([2, 5, 10, 20, 50], ["2", "5", "10", "20", "50"], minor=False)
    left.set_yticks([], minor=True)
    left.axvline(data["table_factors"][0], color="#555555", ls=":", lw=0.8)
    left.legend(fontsize=7.5, loc="upper left")
    tokens, channels = data["shape"]
    left.set_title(f"{data['outliers']} outlier channels in a {tokens} × {channels} activation;\n"
                   f"blockwise = 1 × {data['tile']} tiles", loc="left", fontsize=8.5)
    for i, (fmt, grid) in enumerate(data["grids"].items()):
        right.plot(grid, [i] * len(grid), "|", color=draw.rank_color(i), ms=14)
        label = f"{fmt}: {len(grid)} positive values, 2^{grid[0]:.0f} … 2^{grid[-1]:.1f}"
        right.text(grid[0], i + 0.3, label, fontsize=7.5)
    right.set_yticks(range(len(data["grids"])), list(data["grids"]), fontsize=8)
    right.set_ylim(-0.6, len(data["grids"]) - 0.1)
    right.set_xlabel("log₂ of the value")
    right.set_title("Every value float8 can hold (each bar one value)", loc="left", fontsize=8.5)
    fig.suptitle("FP8: one scale per block keeps the outliers' range out of the other channels' blocks",
                 x=0.01, ha="left", fontsize=9.5)
    fig.tight_layout()
    return fig


def doubled_scale(q: Quantized) -> Quantized:
    """A perturbation for the test: the same fp8 data read with twice the scale."""
    return Quantized(q.data, 2 * q.scale, q.block)


FIGURES = [
    Figure(name="num_fp8_recipes", path="01_data_parallel/figures/num_fp8_recipes.svg", data=fp8_data,
           draw=fp8_draw,
           sources=(Source("common.kernel.fp8:quantize", perturb=doubled_scale),
                    Source("common.kernel.fp8:block_shape", perturb=lambda b: (b[0], b[1] // 2))),
           alt="the error of tensorwise, rowwise and blockwise FP8 scaling as outlier channels grow; "
               "the values of e4m3 and e5m2"),
]
