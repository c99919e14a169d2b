"""FP8 by emulation: scaled quantization to float8 and the GEMM that uses it, exact on a CPU.

A float8 tensor holds 8-bit values (e4m3: max 448, 3 stored mantissa bits; e5m2: max 57344, 2)
and needs a scale of its own to land in that window. For each block b of x (amax-based scaling):

    s_b = fp8_max / amax_b            amax_b = max |x| over the block (s_b = 1 where amax_b = 0)
    q   = fp8(clamp(x · s_b, ±fp8_max))     x̂ = q / s_b              (round to nearest even)

so the block's largest element maps to fp8_max and every element is off by at most half an ulp
of q, divided by s_b: |x̂ − x| ≤ max(2^-(m+1)·|x|, ½·smallest_subnormal / s_b). `pow2` rounds s_b
down to a power of two (x·s and q/s then round nothing). The block shapes of the three recipes:

    tensorwise   one scale for the tensor
    rowwise      one per row (a token's activations, a weight's output channel)
    blockwise    DeepSeek-V3: 1 × 128 tiles for activations, 128 × 128 blocks for weights

e4m3 for forward tensors, e5m2 (more range, less precision) an option for gradients. The GEMM
y = x wᵀ quantizes both operands and multiplies what they stand for, x̂ ŵᵀ, accumulating in fp32;
`mm_by_k_blocks` computes the same sum as the hardware does, Σ_k-blocks (q_x q_wᵀ) / (s_x s_w): a
scale must be constant along the reduction dimension inside one k-block to factor out of it.
A flat buffer sharded over ranks (FSDP) quantizes rank by rank like the whole buffer only where
blocks do not straddle a shard boundary (`quantize_flat`). Part of the torch-only kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TILE = 128  # DeepSeek-V3's tile: 1 × 128 of an activation, 128 × 128 of a weight
RECIPES = ("tensorwise", "rowwise", "blockwise")


@dataclass(frozen=True)
class Quantized:
    """x ≈ data / scale blockwise: `data` fp8 of x's shape, `scale` fp32 [rows/bm, cols/bk]."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x̂ = q / s, each element by its block's scale, computed in fp32 (float64 if asked for)."""
        bm, bk = self.block
        work = torch.float64 if dtype == torch.float64 else torch.float32
        s = self.scale.to(work).repeat_interleave(bm, 0).repeat_interleave(bk, 1)
        return (self.data.to(work) / s).to(dtype)


def fp8_max(dtype: torch.dtype) -> float:
    if dtype not in (E4M3, E5M2):
        raise ValueError(f"fp8 dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return float(torch.finfo(dtype).max)


def amax_scale(amax: torch.Tensor, dtype: torch.dtype = E4M3, pow2: bool = False) -> torch.Tensor:
    """s = fp8_max / amax in fp32 (1 where amax = 0; amax is floored so that s stays finite);
    `pow2`: 2^⌊log₂ s⌋, which keeps |x·s| ≤ fp8_max."""
    top = fp8_max(dtype)
    amax = amax.float()
    s = top / amax.clamp(min=top / torch.finfo(torch.float32).max)
    s = torch.where(amax > 0, s, torch.ones_like(s))
    return torch.exp2(torch.floor(torch.log2(s))) if pow2 else s


def scale_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(x · s, ±fp8_max)): the clamp only catches fp32's rounding of amax · s."""
    top = fp8_max(dtype)
    return (x.float() * scale).clamp(-top, top).to(dtype)


def block_shape(recipe: str, shape: tuple[int, ...], kind: str = "activation",
                tile: int = TILE) -> tuple[int, int]:
    """The block one scale covers, for a 2-D tensor of `shape` that is an activation or a weight."""
    rows, cols = shape
    if kind not in ("activation", "weight"):
        raise ValueError(f"kind must be 'activation' or 'weight', got {kind!r}")
    blocks = {"tensorwise": (rows, cols), "rowwise": (1, cols),
              "blockwise": (1, tile) if kind == "activation" else (tile, tile)}
    if recipe not in blocks:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    return blocks[recipe]


def quantize(x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = E4M3,
             pow2: bool = False) -> Quantized:
    """x (2-D) to fp8 with one amax-based scale per `block` (its shape must divide x's)."""
    if x.dim() != 2 or x.shape[0] % block[0] or x.shape[1] % block[1]:
        raise ValueError(f"quantize: x of shape {tuple(x.shape)} is not a whole number of blocks "
                         f"{tuple(block)}; pass a 2-D x whose dimensions the block's divide (pad x)")
    rows, cols = x.shape[0] // block[0], x.shape[1] // block[1]
    tiles = x.reshape(rows, block[0], cols, block[1])
    scale = amax_scale(tiles.abs().amax(dim=(1, 3)), dtype, pow2)
    data = scale_to_fp8(tiles, scale[:, None, :, None], dtype).reshape(x.shape)
    return Quantized(data, scale, tuple(block))


def quantize_as(x: torch.Tensor, recipe: str, kind: str = "activation", dtype: torch.dtype = E4M3,
                tile: int = TILE, pow2: bool = False) -> Quantized:
    """quantize with `recipe`'s block for an activation or a weight."""
    return quantize(x, block_shape(recipe, tuple(x.shape), kind, tile), dtype, pow2)


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, recipe: str = "blockwise", tile: int = TILE,
               dtype: torch.dtype = E4M3, out_dtype: torch.dtype = torch.bfloat16, pow2: bool = False
               ) -> torch.Tensor:
    """y = x̂ ŵᵀ for x [M, K] (an activation) and w [N, K] (a weight), both quantized by `recipe`,
    multiplied in fp32 (fp32 accumulation) and returned as `out_dtype`."""
    qx = quantize_as(x, recipe, "activation", dtype, tile, pow2)
    qw = quantize_as(w, recipe, "weight", dtype, tile, pow2)
    return (qx.dequantize() @ qw.dequantize().T).to(out_dtype)


def mm_by_k_blocks(qx: Quantized, qw: Quantized, acc: torch.dtype = torch.float32) -> torch.Tensor:
    """Σ over k-blocks of (q_x q_wᵀ) / (s_x s_w) in `acc`: the fp8 products summed inside each
    k-block with no scale, then scaled once. Needs both operands' blocks to share their k-width."""
    (bm, bk), (bn, bk_w) = qx.block, qw.block
    if bk != bk_w:
        raise ValueError(f"mm_by_k_blocks: x's blocks are {bk} wide along k and w's {bk_w}; "
                         "quantize both with the same k-width")
    y = 0
    for b in range(qx.data.shape[1] // bk):
        k = slice(b * bk, (b + 1) * bk)
        partial = qx.data[:, k].to(acc) @ qw.data[:, k].to(acc).T
        sx = qx.scale[:, b].to(acc).repeat_interleave(bm)[:, None]
        sw = qw.scale[:, b].to(acc).repeat_interleave(bn)[None, :]
        y = y + partial / (sx * sw)
    return y


def quantize_flat(x: torch.Tensor, block: int, offset: int = 0, dtype: torch.dtype = E4M3,
                  pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat shard x whose first element is element `offset` of the whole buffer, quantized in
    the buffer's blocks [j·block, (j+1)·block): (fp8 data, one fp32 scale per block x touches).
    Each scale comes from the part of its block this shard holds, so the shard quantizes exactly as
    the whole buffer does iff no block straddles its ends (`aligned`)."""
    groups = (offset + torch.arange(x.numel())) // block - offset // block
    amax = torch.zeros(int(groups[-1]) + 1 if x.numel() else 0, dtype=torch.float32)
    amax = amax.scatter_reduce(0, groups, x.detach().float().abs().flatten(), "amax")
    scale = amax_scale(amax, dtype, pow2)
    return scale_to_fp8(x.flatten(), scale[groups], dtype), scale


def dequantize_flat(data: torch.Tensor, scale: torch.Tensor, block: int, offset: int = 0) -> torch.Tensor:
    """x̂ = q / s of `quantize_flat`'s output, in fp32."""
    groups = (offset + torch.arange(data.numel())) // block - offset // block
    return data.float() / scale[groups]


def aligned(offset: int, numel: int, block: int) -> bool:
    """Does a shard [offset, offset + numel) cut no block of `block` elements in two?"""
    return offset % block == 0 and numel % block == 0
