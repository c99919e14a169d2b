"""Chapter 05, Ulysses context parallelism: its attention equals one device's attention.

Output and dq, dk, dv against the single-device attention (float64, cp 2/4, GQA with fewer or more
K/V heads than ranks, causal or not, both layouts), the hybrid (Ulysses inside, the ring across),
a negative control, the refusals on every rank before any collective, and the bytes of each
direction against formulas.py."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from common.comm import CommMeter
from common.dist import init_distributed
from common.training import train
from tensor_parallel import shard_sequence
from tensor_parallel import train as tp_train
from tensor_parallel import ulysses as umod
from tensor_parallel.formulas import hybrid_comm_bytes, ulysses_comm_bytes
from tensor_parallel.ulysses import hybrid_attention, hybrid_shard, ulysses_attention
from tests.harness import RankError


def _seeded(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _inputs(b: int, heads: int, kv: int, s: int, d: int, seed: int):
    return [_seeded((b, h, s, d), seed + i) for i, h in enumerate((heads, kv, kv, heads))]


def _reference(q, k, v, dout, causal: bool):
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(group, 1),
                                         full[2].repeat_interleave(group, 1), is_causal=causal)
    out.backward(dout)
    return out.detach(), [x.grad for x in full]


def _diffs(out, local, reference, grads, mine) -> dict[str, float]:
    return {"out": _max_rel(out.detach(), mine(reference)),
            **{f"d{n}": _max_rel(x.grad, mine(g)) for n, x, g in zip("qkv", local, grads, strict=True)}}


def rank_order_not_sequence_order(pieces, dim, layout):
    """A plausible bug: the gathered tokens attended in rank order, not put back in sequence order."""
    return torch.cat(list(pieces), dim)


def ulysses_vs_full(b: int, heads: int, kv: int, s: int, d: int, causal: bool, layout: str,
                    seed: int, broken: bool = False) -> dict[str, float]:
    """Runs on every rank (the CP group = the world): Ulysses attention of this rank's tokens,
    forward and backward, against one device's; max relative differences on this rank's tokens."""
    cp, r = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = _inputs(b, heads, kv, s, d, seed)
    reference, grads = _reference(q, k, v, dout, causal)
    mine = lambda x: shard_sequence(x, cp, r, 2, layout)  # noqa: E731
    local = [mine(x).requires_grad_() for x in (q, k, v)]
    bug = mock.patch.object(umod, "unshard_sequence", rank_order_not_sequence_order)
    with bug if broken else nullcontext():
        out = ulysses_attention(*local, None, causal, layout)
        out.backward(mine(dout))
    return _diffs(out, local, reference, grads, mine)


HEADS = {2: [(2, 2), (4, 1), (4, 2), (8, 4)], 4: [(4, 4), (4, 1), (8, 2), (8, 8)]}  # (H, H_kv)


@example(cp=4, heads_kv=1, causal=True, layout="zigzag", b=1, d=2, c=1, seed=0)
@example(cp=4, heads_kv=2, causal=True, layout="contiguous", b=1, d=2, c=1, seed=2)
@example(cp=2, heads_kv=3, causal=False, layout="contiguous", b=2, d=4, c=2, seed=1)
@given(cp=st.sampled_from([2, 4]), heads_kv=st.integers(0, 3), causal=st.booleans(),
       layout=st.sampled_from(["zigzag", "contiguous"]), b=st.integers(1, 2), d=st.sampled_from([2, 4]),
       c=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_ulysses_attention_equals_one_device_float64(pools, cp, heads_kv, causal, layout, b, d, c, seed):
    """Output and dL/dq, dL/dk, dL/dv within 1e-10 (max relative), every rank; K/V heads fewer
    than, equal to and more than the ranks."""
    heads, kv = HEADS[cp][heads_kv]
    results = pools.run(cp, ulysses_vs_full, b, heads, kv, c * 2 * cp, d, causal, layout, seed)
    worst = {key: max(x[key] for x in results) for key in results[0]}
    assert max(worst.values()) < 1e-10, worst


def test_negative_control_tokens_left_in_rank_order_are_rejected(pools):
    """Under zig-zag the all-to-all's rank order is not the sequence's: the causal mask lands wrong."""
    results = pools.run(2, ulysses_vs_full, 1, 4, 2, 8, 4, True, "zigzag", 5, True)
    assert max(max(x.values()) for x in results) > 1e-3


def hybrid_vs_full(ulysses: int, b: int, heads: int, kv: int, s: int, d: int,
                   layout: str) -> dict[str, float]:
    """Runs on every rank: cp = world = u × r, rank = ring_rank·u + ulysses_rank (Ulysses groups of
    consecutive ranks); hybrid attention against one device's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ring = world // ulysses
    groups = {kind: [dist.new_group(ranks) for ranks in spans] for kind, spans in (
        ("u", [list(range(j * ulysses, (j + 1) * ulysses)) for j in range(ring)]),
        ("r", [list(range(i, world, ulysses)) for i in range(ulysses)]))}
    u_rank, r_rank = rank % ulysses, rank // ulysses
    q, k, v, dout = _inputs(b, heads, kv, s, d, 11)
    reference, grads = _reference(q, k, v, dout, True)
    mine = lambda x: hybrid_shard(x, ulysses, ring, u_rank, r_rank, 2, layout)  # noqa: E731
    local = [mine(x).requires_grad_() for x in (q, k, v)]
    with CommMeter() as meter:
        out = hybrid_attention(*local, groups["u"][r_rank], groups["r"][u_rank], True, layout)
        out.backward(mine(dout))
    return _diffs(out, local, reference, grads, mine) | {"sent": meter.bytes_sent}


@pytest.mark.parametrize("ulysses, layout", [(2, "zigzag"), (2, "contiguous")])
def test_hybrid_ulysses_ring_equals_one_device_and_sends_the_formula(pools, ulysses, layout):
    """cp 4 = 2 Ulysses × 2 ring, GQA (2 K/V heads): exact, and every rank's bytes the formula."""
    b, heads, kv, s, d = 1, 4, 2, 16, 4
    results = pools.run(4, hybrid_vs_full, ulysses, b, heads, kv, s, d, layout)
    assert max(max(v for key, v in x.items() if key != "sent") for x in results) < 1e-10
    ring = 4 // ulysses
    want = sum(hybrid_comm_bytes(b, s, heads, kv, d, ulysses, ring, 8).values())
    assert all(x["sent"] == want for x in results), (results[0]["sent"], want)


# --- refusals and bytes ------------------------------------------------------------------------------


def attend_sizes(b: int, heads: int, kv: int, t: int, d: int) -> None:
    """Runs on every rank: Ulysses on t local tokens of these heads (expected to refuse)."""
    q, k, v = (torch.zeros(b, h, t, d, dtype=torch.float64) for h in (heads, kv, kv))
    ulysses_attention(q, k, v, None)


@pytest.mark.parametrize("cp, heads, kv, t, message", [
    (4, 2, 2, 2, r"cp 4 × tp 1 = 4 ranks > 2 query heads \(its ceiling\)"),
    (4, 6, 2, 2, r"splits the 6 query heads .* use a cp that divides 6"),
    (2, 6, 3, 2, r"3 K/V heads per TP rank neither divide nor are a multiple of cp"),
    (2, 4, 2, 1, r"cuts the 2 tokens of a sequence into 4 equal chunks"),
])
def test_bad_ulysses_sizes_fail_on_every_rank_before_any_collective(pools, cp, heads, kv, t, message):
    with pytest.raises(RankError, match=message) as info:
        pools.run(cp, attend_sizes, 1, heads, kv, t, 2)
    assert sorted(info.value.errors) == list(range(cp))


def metered(b: int, heads: int, kv: int, s: int, d: int) -> tuple[float, float]:
    """Runs on every rank: the bytes Ulysses sends forward, then backward."""
    cp, r = dist.get_world_size(), dist.get_rank()
    q, k, v = (shard_sequence(x, cp, r, 2).requires_grad_() for x in _inputs(b, heads, kv, s, d, 0)[:3])
    with CommMeter() as forward:
        out = ulysses_attention(q, k, v, None)
    with CommMeter() as backward:
        out.backward(torch.ones_like(out))
    return forward.bytes_sent, backward.bytes_sent


@pytest.mark.parametrize("cp, heads, kv", [(2, 4, 2), (4, 8, 2)])
def test_ulysses_bytes_per_rank_are_the_formula(pools, cp, heads, kv):
    """(cp-1)/cp · b·(s/cp)·d·(2H + 2·max(H_kv, cp))·e each way, ratio 1 on every rank."""
    b, s, d = 2, 8 * cp, 4
    want = ulysses_comm_bytes(b, s, heads, kv, d, cp, 8)
    for forward, backward in pools.run(cp, metered, b, heads, kv, s, d):
        assert (forward, backward) == tuple(want.values())


# --- 05's trainer with --cp-variant ulysses -------------------------------------------------------------


def train_cli(argv: list[str]) -> dict:
    args = tp_train.parse_args(argv)
    run = tp_train.validate(args, dist.get_world_size())
    ctx = init_distributed()
    return train(run, ctx, tp_train.build(run, ctx), 5)


def test_train_cp_ulysses_check_passes_and_report_matches_formulas(pools):
    """`--tp 2 --cp 2 --cp-variant ulysses --dtype float64 --check` (GQA, K/V heads repeated within a
    TP rank): PASS; the all-to-all bytes, the whole comm and every memory row equal their formulas."""
    argv = ["--model", "tiny", "--dtype", "float64", "--steps", "2", "--global-batch", "2",
            "--seq-len", "8", "--check", "--data", "synthetic", "--log-every", "0",
            "--tp", "2", "--cp", "2", "--cp-variant", "ulysses"]
    reports = pools.run(4, train_cli, argv)
    report = reports[0]
    assert all(r["check_passed"] for r in reports)
    assert report["mesh"] == {"dp": 1, "cp": 2, "tp": 2} and report["cp_variant"] == "ulysses"
    assert report["comm_bytes_per_rank"] == pytest.approx(report["comm_bytes_formula"], rel=1e-12)
    assert report["comm"]["all_to_all_single"]["bytes"] == pytest.approx(report["cp_ulysses_bytes_formula"],
                                                                       rel=1e-12)
    for key in ("params", "grads", "optimizer", "activations_peak"):
        assert report["memory"][key] == pytest.approx(report["memory_formula"][key], rel=1e-12), key


def validate_argv(argv: list[str]):
    return tp_train.validate(tp_train.parse_args(argv), dist.get_world_size())


def test_trainer_refuses_a_sequence_ulysses_cannot_split_on_every_rank(pools):
    """--cp 4 --cp-variant ulysses --seq-len 12: refused by validate on every rank, naming the fix.
    (The head refusals are `check_ulysses_sizes`', tested above; no registry model has fewer than 4
    query heads, so a world of 4 cannot cross tiny's ceiling.)"""
    with pytest.raises(RankError, match=r"into 8 equal chunks \(cp = 4\)") as info:
        pools.run(4, validate_argv, ["--cp", "4", "--cp-variant", "ulysses", "--seq-len", "12"])
    assert sorted(info.value.errors) == [0, 1, 2, 3]
