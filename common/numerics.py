"""The floating-point formats of training, read from torch.finfo, and the recipes built from them.

A binary float with m stored mantissa bits and e exponent bits holds ±(1 + f/2^m)·2^E: each
binade [2^E, 2^(E+1)) has 2^m evenly spaced values, so the spacing (ulp) at x is 2^⌊log₂|x|⌋·2^-m
and rounding to nearest is off by at most half of it, 2^-(m+1) relative. Below the smallest
normal 2^E_min the spacing stays 2^(E_min - m) down to zero (subnormals); above max, inf.

    format  bits  e  m   max        smallest normal   smallest subnormal   ulp at 1
    fp32    32    8  23  3.4e38     2^-126            2^-149               2^-23
    bf16    16    8  7   3.4e38     2^-126            2^-133               2^-7
    fp16    16    5  10  65504      2^-14             2^-24                2^-10
    e4m3    8     4  3   448        2^-6              2^-9                 2^-3
    e5m2    8     5  2   57344      2^-14             2^-16                2^-2

(e4m3 is torch's float8_e4m3fn, "finite": no inf, its top exponent holds numbers, so it reaches
448.) A recipe says which format each tensor of a training step is held or sent in (RECIPES); its
bytes per element are the itemsizes. Imports only torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FORMATS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                                   "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def float_format(dtype: torch.dtype) -> dict:
    """torch.finfo(dtype) as the numbers above: bits, exponent and stored mantissa bits, max, the
    smallest normal and subnormal, and eps = the ulp at 1 (2^-m)."""
    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))
    return {"bits": info.bits, "exponent_bits": info.bits - 1 - mantissa, "mantissa_bits": mantissa,
            "max": float(info.max), "smallest_normal": float(info.smallest_normal),
            "smallest_subnormal": float(info.smallest_normal) * float(info.eps), "eps": float(info.eps)}


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s values at |x| (a normal x): 2^⌊log₂|x|⌋ · eps."""
    f = float_format(dtype)
    return max(2.0 ** math.floor(math.log2(abs(x))), f["smallest_normal"]) * f["eps"]


def lost_updates(theta: torch.Tensor, delta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where θ held in `dtype` does not move at all under the update Δ: round(θ + Δ) == θ, i.e.
    |Δ| below half an ulp of θ (what a low-precision parameter without a master copy does)."""
    low = theta.to(dtype)
    return (low.double() + delta.double()).to(dtype) == low


@dataclass(frozen=True)
class Recipe:
    """The format of each tensor of a training step: what forward/backward compute in, what the
    gradient reduction sends, what the parameter gather sends (ZeRO-3, FSDP), what the master
    weights and the optimizer's m and v are held in; `loss_scaling`: fp16's dynamic scale."""

    compute: torch.dtype
    reduce: torch.dtype
    gather: torch.dtype
    master: torch.dtype
    state: torch.dtype
    loss_scaling: bool = False

    def bytes(self) -> dict[str, int]:
        """Bytes per element of each: the `b` of every memory and wire formula in the course."""
        sites = ("compute", "reduce", "gather", "master", "state")
        return {site: getattr(self, site).itemsize for site in sites}


# `--mixed-precision` none (fp32) | bf16 | fp16 (common/run.py): every chapter that trains them
RECIPES: dict[str, Recipe] = {
    "fp32": Recipe(torch.float32, torch.float32, torch.float32, torch.float32, torch.float32),
    "bf16": Recipe(torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.float32),
    "fp16": Recipe(torch.float16, torch.float32, torch.float16, torch.float32, torch.float32,
                   loss_scaling=True),
}
