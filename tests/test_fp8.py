"""FP8 by emulation (common/kernel/fp8.py): each recipe's round trip within half an ulp of the
format, the GEMM's two forms equal, the recipes' order on activations with outlier channels, and
the distributed properties: an FP8 all-gather of FSDP flat shards equals the single device's
quantization exactly iff no scaling block straddles a shard boundary, and an FP8 expert dispatch
sends half of bf16's payload bytes plus the scales.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from common.comm import CommMeter
from common.kernel.fp8 import (
    E4M3,
    E5M2,
    RECIPES,
    Quantized,
    aligned,
    amax_scale,
    block_shape,
    dequantize_flat,
    fp8_matmul,
    mm_by_k_blocks,
    quantize,
    quantize_as,
    quantize_flat,
)
from common.numerics import float_format

TILE = 16  # small blocks: the tests' tensors stay small


def activations(rows: int = 32, cols: int = 64, seed: int = 0) -> torch.Tensor:
    """Normal values over several binades, an outlier channel ×100 and a zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-6, 3, (rows, 1), generator=g))
    x[:, 5] *= 100
    x[3] = 0
    return x


def half_ulp_bound(x: torch.Tensor, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """max(2^-(m+1)·|x|, ½·smallest subnormal / s), per element, with fp32's own rounding on top."""
    f = float_format(dtype)
    bm, bk = q.block
    s = q.scale.repeat_interleave(bm, 0).repeat_interleave(bk, 1)
    return torch.maximum(f["eps"] / 2 * x.abs(), f["smallest_subnormal"] / 2 / s) * (1 + 2.0**-20)


def within_bound(x: torch.Tensor, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    return (q.dequantize() - x).abs() <= half_ulp_bound(x, q, dtype)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", ["activation", "weight"])
def test_round_trip_is_within_half_an_ulp_of_the_format(recipe, dtype, pow2, kind):
    x = activations()
    q = quantize_as(x, recipe, kind, dtype, TILE, pow2)
    assert q.data.dtype == dtype and q.scale.dtype == torch.float32
    assert q.scale.shape == tuple(n // b for n, b in zip(x.shape, q.block, strict=True))
    assert within_bound(x, q, dtype).all()
    ratio = ((q.dequantize() - x).abs() / half_ulp_bound(x, q, dtype)).max()
    assert ratio > 0.5, f"the bound is loose ({ratio:.2f}): the test could not see a wrong rounding"
    if not pow2:  # amax maps to fp8_max: every nonzero block's largest element is exact
        top = q.data.float().abs().reshape(q.scale.shape[0], q.block[0], -1, q.block[1]).amax(dim=(1, 3))
        assert torch.equal(top[q.scale != 1], torch.full_like(top, torch.finfo(dtype).max)[q.scale != 1])
    else:
        assert torch.equal(q.scale, torch.exp2(torch.log2(q.scale).round()))


def test_the_bound_sees_a_coarser_format_and_a_wrong_scale():
    """Negative controls: e5m2's rounding breaks e4m3's bound; so does reading with the wrong scale."""
    x = activations()
    q5 = quantize(x, (1, TILE), E5M2)
    assert not within_bound(x, q5, E4M3).all()
    q = quantize(x, (1, TILE), E4M3)
    assert not within_bound(x, Quantized(q.data, q.scale * 1.01, q.block), E4M3).all()


def test_blocks_of_each_recipe_and_the_amax_zero_guard():
    assert block_shape("tensorwise", (256, 512)) == (256, 512)
    assert block_shape("rowwise", (256, 512)) == (1, 512)
    assert block_shape("blockwise", (256, 512)) == (1, 128)
    assert block_shape("blockwise", (256, 512), "weight") == (128, 128)
    scale = amax_scale(torch.tensor([0.0, 1e-45, 448.0, 3.0]))
    assert scale[0] == 1 and torch.isfinite(scale).all() and scale[2] == 1
    assert torch.equal(amax_scale(torch.tensor([3.0]), pow2=True), torch.tensor([128.0]))
    zero = quantize(torch.zeros(4, 8), (2, 4))
    assert torch.equal(zero.dequantize(), torch.zeros(4, 8)) and torch.equal(zero.scale, torch.ones(2, 2))


def test_quantization_is_deterministic():
    x = activations()
    a, b = quantize(x, (1, TILE)), quantize(x.clone(), (1, TILE))
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)


def test_bad_input_is_refused_naming_the_shapes():
    with pytest.raises(ValueError, match=r"shape \(4, 10\) is not a whole number of blocks \(1, 4\)"):
        quantize(torch.ones(4, 10), (1, 4))
    with pytest.raises(ValueError, match="recipe must be one of"):
        block_shape("columnwise", (4, 4))
    with pytest.raises(ValueError, match="fp8 dtype"):
        quantize(torch.ones(4, 4), (1, 4), torch.bfloat16)


@pytest.mark.parametrize("recipe", RECIPES)
def test_gemm_is_the_product_of_what_the_operands_stand_for(recipe):
    """fp8_matmul = x̂ŵᵀ; and where the scales are constant along k inside a k-block, the
    hardware's form Σ_k-blocks (q_x q_wᵀ)/(s_x s_w) is the same sum (float64: 1e-12)."""
    x, w = activations(32, 64), activations(48, 64, seed=1)
    qx, qw = quantize_as(x, recipe, "activation", tile=TILE), quantize_as(w, recipe, "weight", tile=TILE)
    want = qx.dequantize(torch.float64) @ qw.dequantize(torch.float64).T
    y = fp8_matmul(x, w, recipe, TILE, out_dtype=torch.float32)
    assert torch.equal(y, qx.dequantize() @ qw.dequantize().T)
    assert ((y.double() - want).abs().max() / want.abs().max()) < 1e-6
    by_blocks = mm_by_k_blocks(qx, qw, torch.float64)
    assert ((by_blocks - want).abs().max() / want.abs().max()) < 1e-12
    broken = Quantized(qw.data, qw.scale.flip(1), qw.block)  # a scale read from the wrong k-block
    if qw.scale.shape[1] > 1:
        assert ((mm_by_k_blocks(qx, broken, torch.float64) - want).abs().max() / want.abs().max()) > 1e-3
    with pytest.raises(ValueError, match="k-width"):
        mm_by_k_blocks(quantize(x, (1, 16)), quantize(w, (1, 32)))


def test_blockwise_beats_rowwise_beats_tensorwise_on_outlier_channels():
    """Computed on the page's activations (a few channels ×100, and ×10⁴): the error of the
    ordinary channels and the share of them pushed into e4m3's subnormals fall with the block."""
    from data_parallel.figures.fp8 import fp8_data

    table = fp8_data(factors=(1.0,))["table"]
    for key in ("mean_rel_error", "subnormal_share", "mean_rel_error_high", "gemm_error"):
        values = [table[r][key] for r in ("blockwise", "rowwise", "tensorwise")]
        assert values == sorted(values) and len(set(values)) == 3, (key, values)


# ---------------------------------------------------------------------------------------------
# distributed: FSDP's all-gather and EP's dispatch in fp8 (gloo sends the uint8 view and the scales)


def flat_buffer(numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(numel, generator=g) * torch.exp2(torch.randint(-4, 4, (numel,), generator=g))


def fp8_all_gather(shard_numel: int, block: int) -> dict:
    """Each rank quantizes its flat shard in the whole buffer's blocks, with amaxes of its own;
    all-gather the payload (as uint8) and the fp32 scales; dequantize every rank's part."""
    n, rank = dist.get_world_size(), dist.get_rank()
    full = flat_buffer(n * shard_numel)
    offsets = [r * shard_numel for r in range(n)]
    counts = [(o + shard_numel - 1) // block - o // block + 1 for o in offsets]
    data, scale = quantize_flat(full[offsets[rank]:][:shard_numel], block, offsets[rank])
    payload = torch.empty(n * shard_numel, dtype=torch.uint8)
    scales = torch.zeros(n * max(counts))
    with CommMeter() as meter:
        dist.all_gather_into_tensor(payload, data.view(torch.uint8))
        dist.all_gather_into_tensor(scales, torch.cat([scale, scale.new_zeros(max(counts) - scale.numel())]))
    parts = [dequantize_flat(payload[o:o + shard_numel].view(E4M3), scales[r * max(counts):][:counts[r]],
                             block, o) for r, o in enumerate(offsets)]
    one_data, one_scale = quantize_flat(full, block)
    gathered, single = torch.cat(parts), dequantize_flat(one_data, one_scale, block)
    return {"payload_equal": torch.equal(payload, one_data.view(torch.uint8)),
            "equal": torch.equal(gathered, single), "differs_at": torch.nonzero(gathered != single).flatten(),
            "aligned": all(aligned(o, shard_numel, block) for o in offsets),
            "bytes": meter.bytes_sent, "scale_slots": max(counts)}


@pytest.mark.parametrize("world", [2, 4])
def test_fp8_all_gather_of_aligned_shards_is_the_single_device_quantization(pools, world):
    block, shard = 8, 32
    results = pools.run(world, fp8_all_gather, shard, block)
    for r in results:
        assert r["aligned"] and r["payload_equal"] and r["equal"]
        ring = (world - 1) / world
        assert r["bytes"] == ring * world * (shard * 1 + r["scale_slots"] * 4)
        assert ring * world * shard * 1 == ring * world * shard * torch.bfloat16.itemsize / 2


@pytest.mark.parametrize("world", [2, 4])
def test_fp8_all_gather_with_a_block_straddling_shards_is_not(pools, world):
    """A planted misalignment: blocks of 8 over shards of 12, so a block straddles every shard
    boundary and its two ranks each scale their half by their own amax."""
    block, shard = 8, 12
    for r in pools.run(world, fp8_all_gather, shard, block):
        assert not r["aligned"] and not r["equal"] and not r["payload_equal"]
        straddling = {o // block for o in range(shard, world * shard, shard)}
        assert {int(i) // block for i in r["differs_at"]} <= straddling, "only straddling blocks differ"


def fp8_dispatch(dim: int, tile: int) -> dict:
    """An expert dispatch of token rows: rank r sends r + q + 1 rows to rank q, blockwise fp8
    (1 × tile: the payload as uint8 plus fp32 scales), and the same rows in bf16; every rank checks
    the rows it got against each source's own quantization."""
    n, rank = dist.get_world_size(), dist.get_rank()
    splits = lambda src: [src + q + 1 for q in range(n)]  # noqa: E731
    rows = lambda src: torch.randn(sum(splits(src)), dim, generator=torch.Generator().manual_seed(src))  # noqa: E731
    from tensor_parallel.expert_parallel import all_to_all_rows

    q = quantize(rows(rank), (1, tile))
    got_splits = [splits(src)[rank] for src in range(n)]
    with CommMeter() as fp8_meter:
        payload = all_to_all_rows(q.data.view(torch.uint8), got_splits, splits(rank), None)
        scales = all_to_all_rows(q.scale, got_splits, splits(rank), None)
    with CommMeter() as bf16_meter:
        all_to_all_rows(rows(rank).to(torch.bfloat16), got_splits, splits(rank), None)
    got = Quantized(payload.view(E4M3), scales, (1, tile)).dequantize()
    want = []
    for src in range(n):
        theirs = quantize(rows(src), (1, tile)).dequantize()
        start = sum(splits(src)[:rank])
        want.append(theirs[start:start + splits(src)[rank]])
    sent = sum(splits(rank)) - splits(rank)[rank]
    return {"equal": torch.equal(got, torch.cat(want)), "sent": sent,
            "fp8": fp8_meter.bytes_sent, "bf16": bf16_meter.bytes_sent}


def test_fp8_dispatch_sends_half_of_bf16s_payload_plus_the_scales(pools):
    dim, tile = 64, 16
    for r in pools.run(4, fp8_dispatch, dim, tile):
        assert r["equal"]
        assert r["fp8"] == r["sent"] * (dim * 1 + dim // tile * 4)
        assert r["bf16"] == r["sent"] * dim * 2
        assert r["fp8"] - r["sent"] * dim // tile * 4 == r["bf16"] / 2


def test_the_planner_prices_deepseek_v3s_fp8_dispatch_at_the_metered_bytes():
    """07's planner (DeepSeek-V3's layout): the dispatch and the combine's backward in FP8 rows,
    1 + 4/128 bytes an element as the dispatch above meters them; the other half in bf16."""
    from parallel3d.memory_model import Layout
    from parallel3d.planner import RUNS
    from parallel3d.planner.moe import FP8_ROW_BYTES, all_to_all_bytes
    from parallel3d.planner.published import run_model

    run = next(r for r in RUNS if r.name == "DeepSeek-V3 pre-training")
    cfg, moe = run_model(run)
    layout = Layout(tp=run.tp, pp=run.pp, dp=run.dp, zero=run.zero, micro_batch=run.micro_batch,
                    recompute=run.recompute, ep=run.ep, schedule=run.schedule)
    bf16 = all_to_all_bytes(cfg, moe, layout, run.seq_len, 8)
    fp8 = all_to_all_bytes(cfg, moe, layout, run.seq_len, 8, fp8_dispatch=True)
    dim, tile = cfg.dim, 128
    assert FP8_ROW_BYTES * dim == dim * 1 + dim // tile * 4  # one row: payload + its tiles' scales
    assert fp8 / bf16 == pytest.approx((FP8_ROW_BYTES + 2) / (2 * 2), rel=1e-12)
    assert 0.75 < fp8 / bf16 < 0.76
